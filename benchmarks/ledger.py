"""Ledger costs: bytes per consumed sample, merge time for many rank files, elastic start vs depth.

    python benchmarks/ledger.py [--samples 10000000] [--rank-files 1000]

1. Size: a ledger recording ``--samples`` consumed samples (10,000 shards of 1,000), committed
   in 10 commits; reported as bytes per sample on disk.
2. Merge: ``--rank-files`` rank files (1,000 ranks of one run, 10,000 samples each) merged into one
   consumed set under a watermark.
3. Elastic start: time from ``Ledger.resume`` to the first batch after a configuration change,
   with 10 %, 50 % and 90 % of a 100-shard epoch consumed (skipping goes through the index, so
   it should not grow with how much was consumed).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time
import warnings
from pathlib import Path

import wdsraft as wds

HERE = Path(__file__).resolve().parent


def size_per_sample(workdir: Path, samples: int, scattered: bool = False) -> float:
    """Shards consumed whole (what sequential shard reading leaves), or a random half of each shard."""
    ledger = wds.Ledger(str(workdir / f"size-{scattered}"), run="size", rank=0, world_size=1)
    rng = random.Random(0)
    per_shard = 1000 if not scattered else 2000
    shards = samples // 1000
    for commit in range(10):
        for shard in range(commit * shards // 10, (commit + 1) * shards // 10):
            url = f"s3://bucket/dataset/train-{shard:06d}.tar"
            ordinals = sorted(rng.sample(range(per_shard), 1000)) if scattered else range(1000)
            ledger.record({"__url__": [url] * 1000, "__ordinal__": ordinals}, epoch=0)
        ledger.commit(step=commit)
    return sum(os.path.getsize(path) for path in ledger.files()) / samples


def merge_time(workdir: Path, rank_files: int) -> float:
    for rank in range(rank_files):
        ledger = wds.Ledger(str(workdir / "merge"), run="big", rank=rank, world_size=rank_files)
        url = f"s3://bucket/dataset/train-{rank:06d}.tar"
        ledger.record({"__url__": [url] * 10_000, "__ordinal__": range(10_000)}, epoch=0)
        ledger.commit()
    reader = wds.Ledger(str(workdir / "merge"), run="reader")
    start = time.perf_counter()
    merged = reader.consumed(0, {"big": 1})
    elapsed = time.perf_counter() - start
    assert merged.count() == rank_files * 10_000
    return elapsed


def elastic_start(workdir: Path, fraction: float) -> float:
    directory = workdir / "data"
    if not directory.exists():
        with wds.ShardWriter(str(directory / "e-%04d.tar"), maxcount=100, verbose=0) as sink:
            for number in range(100 * 100):
                sink.write({"__key__": f"{number:07d}", "txt": "x" * 200})
    urls = sorted(str(p) for p in directory.glob("e-*.tar"))
    ledger = wds.Ledger(str(workdir / f"elastic-{fraction}"), run="first", rank=0, world_size=1)
    consumed = int(len(urls) * 100 * fraction)
    for shard_number, url in enumerate(urls):
        taken = min(100, max(0, consumed - shard_number * 100))
        if taken:
            ledger.record({"__url__": [url] * taken, "__ordinal__": range(taken)}, epoch=0)
    first = wds.WebLoader(wds.WebDataset(urls, shardshuffle=False).batched(16), batch_size=None)
    saved = ledger.checkpoint(first)
    changed = wds.WebLoader(wds.WebDataset(urls, shardshuffle=10, seed=1).batched(32), batch_size=None)
    start = time.perf_counter()
    wds.Ledger(str(workdir / f"elastic-{fraction}"), run="second").resume(changed, saved)
    next(iter(changed))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--rank-files", type=int, default=1000)
    parser.add_argument("--workdir", type=Path, default=HERE / "output" / "ledger")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)

    print(
        f"size, whole shards: {size_per_sample(args.workdir, args.samples):.3f} bytes per consumed sample "
        f"({args.samples:,} samples, 10 commits)"
    )
    print(
        f"size, a random half of each shard: {size_per_sample(args.workdir, args.samples, True):.3f} bytes per "
        "consumed sample (worst case: no runs to compress)"
    )
    print(f"merge: {merge_time(args.workdir, args.rank_files) * 1e3:.0f} ms for {args.rank_files} rank files")
    for fraction in (0.1, 0.5, 0.9):
        print(
            f"elastic start with {fraction:.0%} of the epoch consumed: "
            f"{elastic_start(args.workdir, fraction) * 1e3:.0f} ms to the first batch",
            flush=True,
        )
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
