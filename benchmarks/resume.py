"""Resume cost: time to the first batch after a restore (warm and cold page cache), state size,
``state_dict()`` cost; and a check that the resumed stream is the uninterrupted one, to the end.

    python benchmarks/resume.py [--corpus PATH] [--copies 200] [--depths 1000 10000 80000]
                                [--buffers 1000 10000] [--repeats 3]

The corpus (``benchmarks/corpus.py``; default the bundled sample x200, 86,800 documents) is
written into shards of 1,000 samples. For each buffer, the pipeline
``WebDataset(shardshuffle=100).shuffle(buffer).decode().to_tuple("__key__", "txt").batched(16)``
runs once uninterrupted to the end of the epoch, recording every sample (key and a digest of
the text) and saving its state at each depth (in samples, rounded down to whole batches).

For each depth, ``--repeats`` rounds, the order of the four measurements rotating:

- **wdsraft restore**: a fresh pipeline, ``load_state_dict`` -> first batch (the figure); then
  the rest of the epoch is read and compared sample by sample with the uninterrupted run's
  tail. Any difference (a sample, its order, or the tail's length) stops the benchmark.
- **webdataset replay**: webdataset has no resume: the time to replay the stream to the same
  depth and deliver the next batch.

each **warm** (every shard file read just before, so it is in the page cache) and **cold** (every
file of the shard directory dropped from the page cache just before, with
``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` after an ``os.sync()``; the share of the
shards' pages still cached after the drop is measured with ``mincore`` and printed; on a virtual
machine the host may still hold the disk's blocks, so cold means not in this kernel's cache, not
read from a physical disk). Medians of the rounds, with the fastest and slowest. Also: the
state's size (msgpack) per buffered sample, and the cost of ``state_dict()`` (the median of 5
blocks of 40 calls).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import hashlib
import mmap
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import msgpack
import webdataset
from corpus import add_arguments, describe
from read_throughput import raw_read, write_text_shards

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


def fingerprints(batch) -> list[tuple[str, bytes]]:
    """Each sample of a batch as (key, digest of its text)."""
    return [(key, hashlib.blake2b(text.encode(), digest_size=16).digest()) for key, text in zip(*batch, strict=True)]


# ---------------------------------------------------------------------------------------------
# the page cache


def drop_from_page_cache(paths: list[str]) -> None:
    os.sync()  # (dirty pages are not dropped)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_share(paths: list[str]) -> float:
    """The share of the files' pages in the page cache (``mincore``; mapping a file reads nothing)."""
    page = mmap.PAGESIZE
    total = cached = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        pages = (size + page - 1) // page
        fd = os.open(path, os.O_RDONLY)
        try:
            address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            vector = ctypes.create_string_buffer(pages)
            try:
                if _libc.mincore(address, size, vector) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
            finally:
                _libc.munmap(address, size)
        finally:
            os.close(fd)
        total += pages
        cached += sum(byte & 1 for byte in vector.raw)
    return cached / total


# ---------------------------------------------------------------------------------------------
# the measurements


def uninterrupted(urls: list[str], buffer: int, depths: list[int]) -> tuple[list, dict[int, dict]]:
    """The whole epoch's samples, and at each depth: the state (msgpack), its buffered samples, state_dict() ms."""
    source = pipeline(wdsraft, urls, buffer)
    stream, saved = [], {}
    stops = {depth // BATCH: depth for depth in depths}
    for number, batch in enumerate(source, start=1):
        stream += fingerprints(batch)
        if number in stops:
            state = source.state_dict()
            blocks = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(40):
                    source.state_dict()
                blocks.append((time.perf_counter() - start) / 40)
            buffered = sum(
                len(stage["buffer"]["columns"][0]) if stage["buffer"]["width"] else 0
                for stage in state["stages"].values()
                if stage and "buffer" in stage
            )
            saved[stops[number]] = {
                "packed": msgpack.packb(state),
                "at": number * BATCH,
                "buffered": buffered,
                "state_dict_ms": statistics.median(blocks) * 1e3,
            }
    return stream, saved


def restore(urls: list[str], buffer: int, saved: dict, stream: list) -> float:
    """Seconds from load_state_dict to the first batch; then the tail is checked against ``stream``."""
    fresh = pipeline(wdsraft, urls, buffer)
    start = time.perf_counter()
    fresh.load_state_dict(msgpack.unpackb(saved["packed"], strict_map_key=False))
    batches = iter(fresh)
    first = next(batches)
    elapsed = time.perf_counter() - start
    tail = fingerprints(first)
    for batch in batches:
        tail += fingerprints(batch)
    expected = stream[saved["at"] :]
    if tail != expected:
        where = next(
            (i for i, (a, b) in enumerate(zip(tail, expected, strict=False)) if a != b), min(len(tail), len(expected))
        )
        raise SystemExit(
            f"RESUMED STREAM DIFFERS (buffer {buffer}, resumed after {saved['at']} samples): "
            f"{len(tail)} samples vs {len(expected)} uninterrupted; first difference at tail sample {where}"
        )
    return elapsed


def replay(urls: list[str], buffer: int, depth: int) -> float:
    start = time.perf_counter()
    batches = iter(pipeline(webdataset, urls, buffer))
    for _ in range(depth // BATCH + 1):
        next(batches)
    return time.perf_counter() - start


def summary(times: list[float], unit: str) -> str:
    scale = 1e3 if unit == "ms" else 1.0
    low, mid, high = min(times) * scale, statistics.median(times) * scale, max(times) * scale
    digits = 0 if unit == "ms" else 2
    return f"{mid:.{digits}f} {unit} ({low:.{digits}f}-{high:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, copies=200)
    parser.add_argument("--depths", type=int, nargs="+", default=[1000, 10000, 80000], help="in samples")
    parser.add_argument("--buffers", type=int, nargs="+", default=[1000, 10000], help="shuffle buffer sizes")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per depth; medians are reported (default 3)")
    parser.add_argument(
        "--workdir", type=Path, default=HERE / "output" / "resume", help="scratch space, removed at the end"
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    print(describe(args.corpus, args.copies), flush=True)

    shutil.rmtree(args.workdir, ignore_errors=True)
    urls = write_text_shards(args.corpus, args.workdir, args.copies)

    def files() -> list[str]:
        return [str(p) for p in args.workdir.iterdir() if p.is_file()]  # (shards, and indexes if any were written)

    drop_from_page_cache(files())
    dropped = cached_share(urls)
    raw_read(urls)
    print(
        f"{len(urls)} shards, {sum(os.path.getsize(u) for u in urls) / 1e6:.0f} MB; one process; medians of "
        f"{args.repeats} rounds (fastest-slowest); cold: shard pages still cached after the drop: {dropped:.1%}; "
        "every resumed tail checked against the uninterrupted run, sample by sample\n",
        flush=True,
    )
    print(
        "| buffer | depth (samples) | wdsraft restore -> first batch, warm | cold "
        "| webdataset replay -> first batch, warm | cold | state (msgpack) | bytes / buffered sample | state_dict() |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for buffer in args.buffers:
        stream, saved = uninterrupted(urls, buffer, args.depths)  # (depths past the end are left out)
        for depth, state in saved.items():
            keys = [("wdsraft", "warm"), ("wdsraft", "cold"), ("webdataset", "warm"), ("webdataset", "cold")]
            times: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
            for round_number in range(args.repeats):
                for library, cache in keys[round_number % 4 :] + keys[: round_number % 4]:
                    if cache == "cold":
                        drop_from_page_cache(files())
                    else:
                        raw_read(urls)
                    if library == "wdsraft":
                        elapsed = restore(urls, buffer, state, stream)
                    else:
                        elapsed = replay(urls, buffer, depth)
                    times[(library, cache)].append(elapsed)
            rng_bytes = 2 * 3340  # two Mersenne Twister states (shard shuffle at epoch start, buffer now)
            per_sample = (len(state["packed"]) - rng_bytes) / max(state["buffered"], 1)
            print(
                f"| {buffer:,} | {state['at']:,} | {summary(times[('wdsraft', 'warm')], 'ms')} "
                f"| {summary(times[('wdsraft', 'cold')], 'ms')} | {summary(times[('webdataset', 'warm')], 's')} "
                f"| {summary(times[('webdataset', 'cold')], 's')} | {len(state['packed']) / 1e3:.1f} KB "
                f"| {per_sample:.1f} | {state['state_dict_ms']:.2f} ms |",
                flush=True,
            )
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
