"""Resume cost: time to first batch after a restore, state size, and state_dict() cost.

    python benchmarks/resume.py [--copies 10] [--depths 1000 10000 80000] [--buffers 1000 10000]

Writes the kernel-docs corpus ``--copies`` times into shards of 1,000 documents, then runs
the pipeline ``WebDataset(shardshuffle=100).shuffle(buffer).decode().to_tuple().batched(16)``
to each depth (in samples), saves the state, and measures in a fresh pipeline the time to
the first batch after ``load_state_dict``. webdataset has no resume: its figure is the time
to replay the stream to the same depth and deliver the next batch, measured in the same run.
Also reports the state's size (msgpack) per buffered sample and the cost of ``state_dict()``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
import warnings
from pathlib import Path

import msgpack
import webdataset
from read_throughput import DEFAULT_CORPUS, FALLBACK_CORPUS, write_text_shards

import wdsraft

HERE = Path(__file__).resolve().parent
BATCH = 16


def pipeline(lib, urls: list[str], buffer: int):
    return (
        lib.WebDataset(urls, shardshuffle=100, seed=1)
        .shuffle(buffer, seed=2)
        .decode()
        .to_tuple("__key__", "txt")
        .batched(BATCH)
    )


def advance(iterator, samples: int) -> None:
    for _ in range(samples // BATCH):
        next(iterator)


def measure_wdsraft(urls: list[str], buffer: int, depth: int) -> dict:
    source = pipeline(wdsraft, urls, buffer)
    iterator = iter(source)
    advance(iterator, depth)
    state = source.state_dict()
    calls = 200
    start = time.perf_counter()
    for _ in range(calls):
        source.state_dict()
    state_dict_ms = (time.perf_counter() - start) / calls * 1e3
    packed = msgpack.packb(state)
    buffered = sum(
        len(stage["buffer"]["columns"][0]) if stage["buffer"]["width"] else 0
        for stage in state["stages"].values()
        if stage and "buffer" in stage
    )
    expected = next(iterator)
    restores = []
    for _ in range(3):
        fresh = pipeline(wdsraft, urls, buffer)
        start = time.perf_counter()
        fresh.load_state_dict(msgpack.unpackb(packed, strict_map_key=False))
        first = next(iter(fresh))
        restores.append(time.perf_counter() - start)
        assert list(first[0]) == list(expected[0]), "restored stream differs"
    return {
        "restore_s": statistics.median(restores),
        "state_bytes": len(packed),
        "buffered": buffered,
        "state_dict_ms": state_dict_ms,
    }


def measure_webdataset_replay(urls: list[str], buffer: int, depth: int) -> float:
    start = time.perf_counter()
    iterator = iter(pipeline(webdataset, urls, buffer))
    advance(iterator, depth)
    next(iterator)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS if DEFAULT_CORPUS.exists() else FALLBACK_CORPUS)
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--depths", type=int, nargs="+", default=[1000, 10000, 80000])
    parser.add_argument("--buffers", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--workdir", type=Path, default=HERE / "output" / "resume")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)

    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    urls = write_text_shards(args.corpus, args.workdir, args.copies)
    total = len(urls) * 1000
    print(f"{len(urls)} shards, about {total} samples\n")
    print(
        "| buffer | depth (samples) | wdsraft restore -> first batch | webdataset replay -> first batch | "
        "speed-up | state (msgpack) | bytes / buffered sample | state_dict() |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for buffer in args.buffers:
        for depth in args.depths:
            if depth >= total:
                continue
            ours = measure_wdsraft(urls, buffer, depth)
            theirs = measure_webdataset_replay(urls, buffer, depth)
            rng_bytes = 2 * 3340  # two Mersenne Twister states (shard shuffle at epoch start, buffer now)
            per_sample = (ours["state_bytes"] - rng_bytes) / max(ours["buffered"], 1)
            print(
                f"| {buffer} | {depth} | {ours['restore_s'] * 1e3:.0f} ms | {theirs:.2f} s | "
                f"{theirs / ours['restore_s']:.0f}x | {ours['state_bytes'] / 1e3:.1f} KB | {per_sample:.1f} | "
                f"{ours['state_dict_ms']:.2f} ms |",
                flush=True,
            )
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
