"""Read rate of a local shard set with and without the index checks (not a test; run by hand).

    python benchmarks/integrity_read_rate.py [--samples 20000] [--shards 4] [--repeat 3]

Writes small-sample shards (the reader's hardest case: per-sample work dominates) to a temporary
directory, then reads them all with ShardSampleReader three ways: index=None (no checks, as before
indexes were checked), the default (the index beside each shard: offset/end/count checks) and
verify=True (CRC-32 of every sample too). Prints the best of --repeat runs of each, in CPU time
(the files are in the page cache: reading is CPU-bound). With an older
wdsraft on PYTHONPATH (no ``index``/``verify`` arguments) it reads the plain way only.
"""

from __future__ import annotations

import argparse
import inspect
import os
import tempfile
import time

import wdsraft as wds


def write(directory: str, shards: int, samples: int) -> list[str]:
    urls = []
    for n in range(shards):
        url = os.path.join(directory, f"rate-{n:03d}.tar")
        with wds.TarWriter(url, fsync=False) as sink:
            for i in range(samples):
                sink.write({"__key__": f"{n:03d}-{i:07d}", "txt": f"sample {i} " * 8, "cls": str(i % 10)})
        urls.append(url)
    return urls


def rate(urls: list[str], repeat: int, **kw: object) -> tuple[float, float]:
    best = float("inf")
    count = size = 0
    for _ in range(repeat):
        start = time.process_time()  # CPU time: steadier than wall time on a shared machine
        count = sum(1 for url in urls for _ in wds.ShardSampleReader(url, **kw))  # type: ignore[arg-type]
        best = min(best, time.process_time() - start)
    size = sum(os.path.getsize(url) for url in urls)
    return count / best, size / best / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000, help="samples per shard")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    checks = "index" in inspect.signature(wds.ShardSampleReader).parameters
    with tempfile.TemporaryDirectory() as directory:
        urls = write(directory, args.shards, args.samples)
        modes: dict[str, dict[str, object]] = {"no checks": {"index": None} if checks else {}}
        if checks:
            modes["index checks (default)"] = {}
            modes["verify=True"] = {"verify": True}
        for name, kw in modes.items():
            samples, mb = rate(urls, args.repeat, **kw)
            print(f"{name:24s} {samples:12,.0f} samples/s {mb:8.1f} MB/s")


if __name__ == "__main__":
    main()
