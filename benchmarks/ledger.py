"""Ledger costs, best cases beside worst: bytes per consumed sample, merge time, elastic start.

    python benchmarks/ledger.py [--samples 1000000] [--rank-files 1000] [--commits 10] [--repeats 5]

Shards hold 1,000 samples and are named like ``s3://bucket/dataset/train-000123.tar`` (40
characters: a ledger stores each shard's URL once per commit that touched it). How the consumed
ordinals lie decides the size: roaring bitmaps store a run of consecutive ordinals in a few
bytes, an ordinal with no neighbour in 2. The patterns, from best to worst:

- **whole shards**: every ordinal of each shard (what sequential shard reading leaves);
- **a contiguous half / tenth of each shard**: one run per shard, but partial shards (a shard
  shared by 2 or 10 ranks in blocks);
- **every other sample**: half of each shard, no two ordinals adjacent (2 ranks striding);
- **a random half / tenth of each shard**: the shard's samples dealt at random to 2 or 10 ranks;
- **a random tenth, every shard in every commit**: as above, but each commit holds a tenth of
  every shard's part, so each URL is stored ``--commits`` times.

1. **Size**: rank 0's ledger after it consumed ``--samples`` samples in that pattern, committed
   ``--commits`` times; bytes on disk per consumed sample (exact, no repeats needed).
2. **Merge**: ``--rank-files`` ranks of one run, each with 10,000 consumed samples in that
   pattern (the ranks sharing a shard take complementary parts, so the merge is every shard
   whole) and ``--commits`` commits, merged into one consumed set (``Ledger.consumed``; the
   count is checked). Median of ``--repeats`` rounds, the patterns alternating.
3. **Elastic start**: a 100-shard epoch of 10,000 samples with 10 %, 50 % or 90 % consumed,
   either contiguously (the first shards, whole) or scattered (a random subset); then
   ``Ledger.resume`` under a changed configuration (shard shuffle on, batch 32): the time to the
   first batch, and to the end of the epoch (the samples delivered are checked to be exactly the
   unconsumed ones). Medians of ``--repeats`` rounds, the cases alternating.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

import wdsraft as wds

HERE = Path(__file__).resolve().parent
SHARD = 1000
PATTERNS = {  # name -> (ranks sharing a shard, layout of a rank's part, every shard in every commit)
    "whole shards": (1, "block", False),
    "a contiguous half of each shard": (2, "block", False),
    "a contiguous tenth of each shard": (10, "block", False),
    "every other sample": (2, "stride", False),
    "a random half of each shard": (2, "random", False),
    "a random tenth of each shard": (10, "random", False),
    "a random tenth, every shard in every commit": (10, "random", True),
}


def url(shard: int) -> str:
    return f"s3://bucket/dataset/train-{shard:06d}.tar"


def part(shard: int, k: int, share: int, layout: str) -> np.ndarray:
    """The ordinals of ``shard`` that rank ``k`` of the ``share`` ranks sharing it consumed."""
    if layout == "block":
        return np.arange(k * SHARD // share, (k + 1) * SHARD // share)
    if layout == "stride":
        return np.arange(k, SHARD, share)
    order = np.random.default_rng(shard).permutation(SHARD)  # (the same for every rank of the group)
    return np.sort(order[k::share])


def write_rank(ledger: wds.Ledger, shards: range, k: int, pattern: str, commits: int) -> int:
    """Record and commit one rank's consumption; returns the samples recorded."""
    share, layout, spread = PATTERNS[pattern]
    parts = [(url(shard), part(shard, k, share, layout)) for shard in shards]
    if spread:  # commit c holds the c-th slice of every shard's part
        splits = [(u, np.array_split(p, commits)) for u, p in parts]
        chunks = [[(u, pieces[c]) for u, pieces in splits] for c in range(commits)]
    else:  # shard after shard, a commit every (samples / commits) samples, cutting through shards
        stream = [(u, int(o)) for u, p in parts for o in p]
        cuts = np.linspace(0, len(stream), commits + 1).astype(int)
        chunks = []
        for a, b in itertools.pairwise(cuts):
            by_shard: dict[str, list[int]] = {}
            for u, o in stream[a:b]:
                by_shard.setdefault(u, []).append(o)
            chunks.append(list(by_shard.items()))
    total = 0
    for step, chunk in enumerate(chunks):
        for u, ordinals in chunk:
            ordinals = [int(o) for o in ordinals]
            ledger.record({"__url__": [u] * len(ordinals), "__ordinal__": ordinals}, epoch=0)
            total += len(ordinals)
        ledger.commit(step=step)
    return total


def size_per_sample(workdir: Path, pattern: str, samples: int, commits: int) -> float:
    share = PATTERNS[pattern][0]
    ledger = wds.Ledger(str(workdir / "size" / pattern.replace(" ", "-")), run="size", rank=0, world_size=1)
    recorded = write_rank(ledger, range(samples * share // SHARD), 0, pattern, commits)
    assert recorded == samples, (recorded, samples)
    return sum(os.path.getsize(path) for path in ledger.files()) / samples


def write_merge(workdir: Path, pattern: str, ranks: int, commits: int) -> Path:
    share = PATTERNS[pattern][0]
    directory = workdir / "merge" / pattern.replace(" ", "-")
    per_group = 10 * share  # shards per group of sharing ranks: 10,000 samples per rank
    for rank in range(ranks):
        group, k = divmod(rank, share)
        ledger = wds.Ledger(str(directory), run="big", rank=rank, world_size=ranks)
        write_rank(ledger, range(group * per_group, (group + 1) * per_group), k, pattern, commits)
    return directory


def merge_time(directory: Path, ranks: int, commits: int) -> float:
    reader = wds.Ledger(str(directory), run="reader")
    start = time.perf_counter()
    merged = reader.consumed(0, {"big": commits})
    elapsed = time.perf_counter() - start
    assert merged.count() == ranks * 10_000, merged.count()
    return elapsed


def elastic_data(workdir: Path) -> list[str]:
    directory = workdir / "data"
    with wds.ShardWriter(str(directory / "e-%04d.tar"), maxcount=100, verbose=0) as sink:
        for number in range(100 * 100):
            sink.write({"__key__": f"{number:07d}", "txt": "x" * 200})
    return sorted(str(p) for p in directory.glob("e-*.tar"))


def elastic_start(
    workdir: Path, urls: list[str], fraction: float, scattered: bool, attempt: int
) -> tuple[float, float]:
    """Seconds to the first batch and to the end of the epoch after an elastic resume."""
    path = str(workdir / f"elastic-{fraction}-{scattered}-{attempt}")
    ledger = wds.Ledger(path, run="first", rank=0, world_size=1)
    consumed = int(len(urls) * 100 * fraction)
    if scattered:
        chosen = np.sort(np.random.default_rng(int(fraction * 100)).choice(len(urls) * 100, consumed, replace=False))
    else:
        chosen = np.arange(consumed)
    for shard_number, shard_url in enumerate(urls):
        ordinals = [int(n) - shard_number * 100 for n in chosen if shard_number * 100 <= n < (shard_number + 1) * 100]
        if ordinals:
            ledger.record({"__url__": [shard_url] * len(ordinals), "__ordinal__": ordinals}, epoch=0)
    first = wds.WebLoader(wds.WebDataset(urls, shardshuffle=False).batched(16), batch_size=None)
    saved = ledger.checkpoint(first)
    changed = wds.WebLoader(wds.WebDataset(urls, shardshuffle=10, seed=1).batched(32), batch_size=None)
    start = time.perf_counter()
    wds.Ledger(path, run="second").resume(changed, saved)
    batches = iter(changed)
    delivered = len(next(batches)["__key__"])
    to_first = time.perf_counter() - start
    delivered += sum(len(batch["__key__"]) for batch in batches)
    to_end = time.perf_counter() - start
    if delivered != len(urls) * 100 - consumed:
        raise SystemExit(f"elastic resume delivered {delivered} samples, not the {len(urls) * 100 - consumed} left")
    return to_first, to_end


def summary(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:.0f} ms ({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1_000_000, help="consumed samples for the size (default 1M)")
    parser.add_argument("--rank-files", type=int, default=1000, help="ranks merged (default 1000)")
    parser.add_argument("--commits", type=int, default=10, help="commits per rank (default 10)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds for the timings; medians (default 5)")
    parser.add_argument(
        "--workdir", type=Path, default=HERE / "output" / "ledger", help="scratch space, removed at the end"
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    print(
        f"corpus: none (synthetic ledgers: shards of {SHARD:,} samples, 40-character URLs; elastic start: 100 "
        f"shards of 100 samples of 200 bytes); one process; medians of {args.repeats} rounds (fastest-slowest)\n",
        flush=True,
    )

    directories = {p: write_merge(args.workdir, p, args.rank_files, args.commits) for p in PATTERNS}
    merges: dict[str, list[float]] = {p: [] for p in PATTERNS}
    names = list(PATTERNS)
    for round_number in range(args.repeats):
        shift = round_number % len(names)
        for pattern in names[shift:] + names[:shift]:
            merges[pattern].append(merge_time(directories[pattern], args.rank_files, args.commits))
    print(
        f"| consumed ordinals | bytes per consumed sample ({args.samples:,} samples, {args.commits} commits) "
        f"| merge of {args.rank_files:,} rank files (10,000 samples, {args.commits} commits each) |"
    )
    print("|---|---:|---:|")
    for pattern in PATTERNS:
        size = size_per_sample(args.workdir, pattern, args.samples, args.commits)
        print(f"| {pattern} | {size:.3f} | {summary(merges[pattern])} |", flush=True)

    urls = elastic_data(args.workdir)
    cases = [(fraction, scattered) for fraction in (0.1, 0.5, 0.9) for scattered in (False, True)]
    times: dict[tuple[float, bool], list[tuple[float, float]]] = {case: [] for case in cases}
    for round_number in range(args.repeats):
        shift = round_number % len(cases)
        for case in cases[shift:] + cases[:shift]:
            times[case].append(elastic_start(args.workdir, urls, *case, round_number))
    print("\n| epoch consumed | consumed where | elastic resume -> first batch | -> end of the epoch |")
    print("|---:|---|---:|---:|")
    for (fraction, scattered), pairs in times.items():
        where = "a random subset" if scattered else "the first shards, whole"
        print(
            f"| {fraction:.0%} | {where} | {summary([a for a, _ in pairs])} | {summary([b for _, b in pairs])} |",
            flush=True,
        )
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
