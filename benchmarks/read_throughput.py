"""Shard read throughput: wdsraft vs webdataset 1.0.2, side by side in one process.

    python benchmarks/read_throughput.py [--corpus PATH] [--copies N] [--repeats R]

Writes the kernel-docs corpus into shards of 1,000 samples (``.txt`` + ``.json`` per
document, the layout the converter produces), then reads all shards with both libraries'
``tarfile_samples`` in alternation, ``--repeats`` times, with a warm page cache. A second
case reads large samples (4 MiB) to compare with the raw ``read()`` bandwidth of the same
files. Reports the best run of each as samples/s and MB/s, and wdsraft/webdataset ratios.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import webdataset
import zstandard

import wdsraft

HERE = Path(__file__).resolve().parent
DEFAULT_CORPUS = HERE.parent.parent / "shared" / "corpora" / "kernel-docs.jsonl.zst"
FALLBACK_CORPUS = HERE.parent / "examples" / "data" / "kernel-docs-sample.jsonl.zst"


def documents(path: Path) -> Iterator[dict]:
    with open(path, "rb") as raw:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8"):
            yield json.loads(line)


def write_text_shards(corpus: Path, directory: Path, copies: int) -> list[str]:
    records = list(documents(corpus))
    with wdsraft.ShardWriter(str(directory / "kd-%05d.tar"), maxcount=1000, verbose=0) as sink:
        for copy in range(copies):
            for number, record in enumerate(records):
                sink.write({"__key__": f"{copy:02d}-{number:08d}", "txt": record["text"], "json": {"id": record["id"]}})
    return sorted(str(p) for p in directory.glob("kd-*.tar"))


def write_large_shards(directory: Path, samples: int = 96, size: int = 4 << 20) -> list[str]:
    payload = os.urandom(size)
    with wdsraft.ShardWriter(str(directory / "big-%05d.tar"), maxcount=16, verbose=0) as sink:
        for number in range(samples):
            sink.write({"__key__": f"{number:06d}", "bin": payload})
    return sorted(str(p) for p in directory.glob("big-*.tar"))


def consume(samples: Iterable[dict]) -> int:
    count = 0
    for _ in samples:
        count += 1
    return count


def raw_read(urls: list[str]) -> int:
    for url in urls:
        with open(url, "rb", buffering=0) as stream:
            while stream.read(1 << 20):
                pass
    return 0


def timed(run: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    count = run()
    return time.perf_counter() - start, count


def compare(name: str, urls: list[str], repeats: int, with_raw: bool = False) -> list[dict]:
    total_bytes = sum(os.path.getsize(url) for url in urls)
    runners: dict[str, Callable[[], int]] = {
        "wdsraft": lambda: consume(wdsraft.tarfile_samples({"url": url} for url in urls)),
        "webdataset": lambda: consume(webdataset.tarfile_samples([{"url": url} for url in urls])),
    }
    if with_raw:
        runners["raw read()"] = lambda: raw_read(urls)
    raw_read(urls)  # warm the page cache
    times: dict[str, list[float]] = {key: [] for key in runners}
    counts: dict[str, int] = {}
    for _ in range(repeats):
        for key, run in runners.items():
            elapsed, count = timed(run)
            times[key].append(elapsed)
            counts[key] = count
    samples = counts["wdsraft"]
    assert counts["webdataset"] == samples, counts
    rows = []
    for key in runners:
        best = min(times[key])
        rows.append(
            {
                "case": name,
                "reader": key,
                "samples": samples,
                "MB": total_bytes / 1e6,
                "best_s": best,
                "median_s": statistics.median(times[key]),
                "samples_per_s": samples / best,
                "MB_per_s": total_bytes / 1e6 / best,
            }
        )
    base = min(times["webdataset"])
    for row in rows:
        row["vs_webdataset"] = base / row["best_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS if DEFAULT_CORPUS.exists() else FALLBACK_CORPUS)
    parser.add_argument("--copies", type=int, default=1, help="write the corpus this many times (x10: ~430 MB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=HERE / "output" / "read")
    args = parser.parse_args()

    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    text_urls = write_text_shards(args.corpus, args.workdir, args.copies)
    large_urls = write_large_shards(args.workdir)
    rows = compare(f"small text ({args.corpus.name} x{args.copies})", text_urls, args.repeats)
    rows += compare("large samples (4 MiB)", large_urls, args.repeats, with_raw=True)

    print("| case | reader | samples | MB | best s | samples/s | MB/s | vs webdataset |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['case']} | {row['reader']} | {row['samples']} | {row['MB']:.0f} | {row['best_s']:.3f} | "
            f"{row['samples_per_s']:,.0f} | {row['MB_per_s']:,.0f} | {row['vs_webdataset']:.2f}x |"
        )
    (args.workdir.parent / "read_throughput.json").write_text(json.dumps(rows, indent=1))
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
