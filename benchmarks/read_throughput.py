"""Shard read throughput: wdsraft vs webdataset 1.0.2, on shards written by each library.

    python benchmarks/read_throughput.py [--corpus PATH] [--copies 20] [--repeats 5]

Two cases, each written twice, once by each library's ``ShardWriter``:

- **small text**: the corpus (see ``benchmarks/corpus.py``; default the bundled sample x20,
  8,680 documents) as ``.txt`` + ``.json`` per document, 1,000 samples per shard (the layout
  the converter produces);
- **large samples**: 96 samples of 4 MiB (``.bin``), 16 per shard.

wdsraft's writer writes plain ustar headers. webdataset's ``TarWriter`` gives every member a
float mtime, so Python's ``tarfile`` (PAX format by default) puts a PAX extended header before
each member: 1 KiB more per member, and a second header for a reader to parse.

Each shard set is read by both libraries' ``tarfile_samples`` and by a raw ``read()`` of the
same files, in one process, warm page cache. Before timing, both libraries' samples are
checked equal (keys and bytes). Then ``--repeats`` rounds; in each round every shard set is
read by every reader, the readers' order rotating from round to round. Reported: the median
of the rounds (samples/s, MB/s of shard files), the spread ((slowest - fastest round) /
median), and per shard set the ratio wdsraft/webdataset: the median over rounds of the two
readers' times in the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import webdataset
from corpus import add_arguments, describe, replicated

import wdsraft

HERE = Path(__file__).resolve().parent
WRITERS = {"wdsraft": wdsraft.ShardWriter, "webdataset": webdataset.ShardWriter}
READERS = ("wdsraft", "webdataset", "raw read()")


def write_text_shards(corpus: Path, directory: Path, copies: int, writer: str = "wdsraft") -> list[str]:
    """The corpus ``copies`` times as ``.txt`` + ``.json`` samples, 1,000 per shard, by ``writer``'s ShardWriter."""
    directory.mkdir(parents=True, exist_ok=True)
    with WRITERS[writer](str(directory / "kd-%05d.tar"), maxcount=1000, verbose=0) as sink:
        for key, record in replicated(corpus, copies):
            sink.write({"__key__": key, "txt": record["text"], "json": {"id": record["id"]}})
    return sorted(str(p) for p in directory.glob("kd-*.tar"))


def write_large_shards(directory: Path, writer: str, samples: int = 96, size: int = 4 << 20) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    payload = bytes(range(256)) * (size // 256)  # (the same bytes on every machine)
    with WRITERS[writer](str(directory / "big-%05d.tar"), maxcount=16, verbose=0) as sink:
        for number in range(samples):
            sink.write({"__key__": f"{number:06d}", "bin": payload})
    return sorted(str(p) for p in directory.glob("big-*.tar"))


def wdsraft_samples(urls: list[str]) -> Iterable[dict]:
    return wdsraft.tarfile_samples({"url": url} for url in urls)


def webdataset_samples(urls: list[str]) -> Iterable[dict]:
    return webdataset.tarfile_samples([{"url": url} for url in urls])


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


def check_equal(urls: list[str]) -> int:
    """Both libraries yield the same samples (keys, extensions, bytes); returns their number."""
    count = 0
    ours, theirs = iter(wdsraft_samples(urls)), iter(webdataset_samples(urls))
    for a in ours:
        b = next(theirs)
        fields = {k for k in b if not k.startswith("__")}
        if a["__key__"] != b["__key__"] or fields != {k for k in a if not k.startswith("__")}:
            raise SystemExit(f"the readers differ at sample {count}: {a['__key__']} vs {b['__key__']}")
        if any(bytes(a[k]) != bytes(b[k]) for k in fields):
            raise SystemExit(f"the readers differ in the bytes of sample {a['__key__']}")
        count += 1
    if next(theirs, None) is not None:
        raise SystemExit(f"webdataset yields more than wdsraft's {count} samples")
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, copies=20)
    parser.add_argument("--repeats", type=int, default=5, help="rounds; medians are reported (default 5)")
    parser.add_argument(
        "--workdir", type=Path, default=HERE / "output" / "read", help="scratch space, removed at the end"
    )
    args = parser.parse_args()
    print(describe(args.corpus, args.copies))
    print(f"one process, warm page cache; medians of {args.repeats} rounds, readers' order rotating\n", flush=True)

    shutil.rmtree(args.workdir, ignore_errors=True)
    sets: dict[tuple[str, str], list[str]] = {}
    for writer in WRITERS:
        sets[("small text", writer)] = write_text_shards(
            args.corpus, args.workdir / f"text-{writer}", args.copies, writer
        )
    for writer in WRITERS:
        sets[("large samples (4 MiB)", writer)] = write_large_shards(args.workdir / f"large-{writer}", writer)
    os.sync()

    runners: dict[str, Callable[[list[str]], int]] = {
        "wdsraft": lambda urls: consume(wdsraft_samples(urls)),
        "webdataset": lambda urls: consume(webdataset_samples(urls)),
        "raw read()": raw_read,
    }
    counts = {}
    for key, urls in sets.items():
        counts[key] = check_equal(urls)
        raw_read(urls)  # (and the page cache is warm)
    times: dict[tuple[str, str, str], list[float]] = {(*key, r): [] for key in sets for r in READERS}
    for round_number in range(args.repeats):
        order = READERS[round_number % 3 :] + READERS[: round_number % 3]
        for key, urls in sets.items():
            for reader in order:
                start = time.perf_counter()
                runners[reader](urls)
                times[(*key, reader)].append(time.perf_counter() - start)

    rows = []
    print(
        "| case | shards written by | reader | samples | MB of shards | samples/s (median) | MB/s (median) "
        "| spread (slowest - fastest) / median | wdsraft / webdataset (median of rounds, range) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for key, urls in sets.items():
        megabytes = sum(os.path.getsize(url) for url in urls) / 1e6
        ratios = [b / a for a, b in zip(times[(*key, "wdsraft")], times[(*key, "webdataset")], strict=True)]
        for reader in READERS:
            series = times[(*key, reader)]
            median = statistics.median(series)
            ratio = (
                f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f})"
                if reader == "wdsraft"
                else ("1.00x" if reader == "webdataset" else "")
            )
            row = {
                "case": key[0],
                "written_by": key[1],
                "reader": reader,
                "samples": counts[key],
                "MB": megabytes,
                "median_s": median,
                "times_s": series,
                "samples_per_s": counts[key] / median,
                "MB_per_s": megabytes / median,
                "spread_pct": (max(series) - min(series)) / median * 100,
                "ratios": ratios if reader == "wdsraft" else None,
            }
            rows.append(row)
            samples_per_s = f"{row['samples_per_s']:,.0f}" if reader != "raw read()" else "-"
            print(
                f"| {key[0]} | {key[1]} | {reader} | {counts[key]:,} | {megabytes:.0f} | {samples_per_s} | "
                f"{row['MB_per_s']:,.0f} | {row['spread_pct']:.0f}% | {ratio} |"
            )
    (args.workdir.parent / "read_throughput.json").write_text(json.dumps(rows, indent=1))
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
