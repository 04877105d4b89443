"""Where one process's read time goes, part by part: the figures behind docs/benchmarks.md's "Where one
process's time goes" (against LitData).

    python benchmarks/read_parts.py --shards 'DIR/*.tar' [--rounds 15]

Over the shards given (warm page cache, one process), CPU microseconds per sample of:

- ``readinto``: the shards' bytes read into one reused 1 MiB buffer, as the reader reads them;
- ``mmap``: the same bytes mapped (``MADV_SEQUENTIAL``) and sliced a sample at a time, as LitData reads
  its chunks (its own figure is estimated from this one, per byte: its chunks carry no tar headers);
- ``tar checksums``: the member walk with its header checksums, minus the same walk without them;
- ``UTF-8 of .txt`` and ``JSON of .json``: ``decode()``'s own functions over the samples' bytes;
- ``WebDataset.decode()``: the whole read, for the total.

Each part is the median of ``--rounds`` timings. LitData's total comes from ``vs_litdata.py --sections read``,
run beside this one.
"""

from __future__ import annotations

import argparse
import glob
import mmap
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import wdsraft as wds
import wdsraft.tar.members as members
from wdsraft.pipeline.decode import _UTF8, _json_loads
from wdsraft.tar.reader import _members


def timed(run: Callable[[], Any], rounds: int) -> float:
    """The median CPU seconds of ``run()``, after one warm-up call."""
    run()
    times = []
    for _ in range(rounds):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="a glob of local shards with .txt and .json samples")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    urls = sorted(glob.glob(args.shards))
    raw = list(wds.WebDataset(urls, shardshuffle=False))
    count = len(raw)
    sizes = [os.path.getsize(url) for url in urls]
    load = os.getloadavg()[0]
    print(f"{count:,} samples in {len(urls)} shards, {sum(sizes) / count:,.0f} bytes a sample; load {load:.1f}")

    window = mmap.mmap(-1, (1 << 20) + 512)

    def read_into() -> None:
        for url in urls:
            with open(url, "rb", buffering=0) as stream:
                while stream.readinto(window):
                    pass

    per_sample = sum(sizes) // count

    def mapped() -> None:
        for url in urls:
            with open(url, "rb") as stream, mmap.mmap(stream.fileno(), 0, prot=mmap.PROT_READ) as view:
                view.madvise(mmap.MADV_SEQUENTIAL)
                for start in range(0, len(view), per_sample):
                    view[start : start + per_sample]

    def walk() -> None:
        for url in urls:
            with open(url, "rb") as stream:
                for _ in _members(members.TarMemberReader(stream, url, 0)):
                    pass

    real_check = members._first_bad_header

    def walk_unchecked() -> None:
        members._first_bad_header = lambda *_: None
        try:
            walk()
        finally:
            members._first_bad_header = real_check

    def utf8() -> None:
        for sample in raw:
            _UTF8(sample["txt"])

    def json_field() -> None:
        for sample in raw:
            _json_loads(sample["json"])

    def whole() -> None:
        for _ in wds.WebDataset(urls, shardshuffle=False).decode():
            pass

    parts = {
        name: timed(run, args.rounds)
        for name, run in [
            ("readinto", read_into),
            ("mmap", mapped),
            ("walk", walk),
            ("walk without checksums", walk_unchecked),
            ("UTF-8 of .txt", utf8),
            ("JSON of .json", json_field),
            ("WebDataset.decode()", whole),
        ]
    }
    checksums = parts.pop("walk") - parts.pop("walk without checksums")
    parts = {"readinto": parts.pop("readinto"), "mmap": parts.pop("mmap"), "tar checksums": checksums, **parts}
    print("\n| part | µs a sample |\n|---|---:|")
    for name, seconds in parts.items():
        print(f"| {name} | {seconds / count * 1e6:.2f} |")


if __name__ == "__main__":
    main()
