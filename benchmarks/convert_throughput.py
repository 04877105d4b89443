"""Conversion throughput and memory: ``wdsraft convert`` (global shuffle) vs webdataset's ``ShardWriter``.

    python benchmarks/convert_throughput.py [--corpus PATH] [--copies 10] [--workers 2] [--memory 256M]
                                            [--repeats 3]

The kernel-docs corpus (``.jsonl.zst``) is copied ``--copies`` times under distinct names
(the default 10 copies are about 440 MB of JSONL). Both converters then turn all copies into
shards of ``--samples-per-shard`` samples (``.txt`` text + ``.json`` other fields), in
alternation, ``--repeats`` times, each run in a fresh process:

- **webdataset**: webdataset 1.0.2's ``ShardWriter``, sequential, unshuffled (read a file,
  ``json.loads`` each line, write the sample);
- **wdsraft**: ``wdsraft convert`` with a global shuffle, ``--workers`` processes and a memory
  budget of ``--memory``.

Reported per converter (best run; median in the JSON): MB/s of JSONL converted (time from the
first input byte to the finished manifest, interpreter start-up excluded), the peak RSS of its
main process and of its largest worker process, the peak PSS of its whole process tree
(physical memory, shared pages counted once), and ratios. The same figures for a conversion
of one record per worker (same options, same processes) give the fixed overhead, so that the
memory the data took can be compared with the budget.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CORPUS = HERE.parent.parent / "shared" / "corpora" / "kernel-docs.jsonl.zst"
FALLBACK_CORPUS = HERE.parent / "examples" / "data" / "kernel-docs-sample.jsonl.zst"


# ---------------------------------------------------------------------------------------------
# measuring memory of a process tree


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(p) for p in handle.read().split()]
    except OSError:
        return []


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeMemory:
    """Samples the PSS of this process and all its descendants (Linux), keeping the peak."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pids, todo = [], [os.getpid()]
            while todo:
                pid = todo.pop()
                pids.append(pid)
                todo.extend(_children(pid))
            self.peak = max(self.peak, sum(_pss(pid) for pid in pids))
            self._stop.wait(self.interval)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _peak_rss() -> tuple[int, int]:
    """Peak RSS of this process and of its largest (finished) child, in bytes."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return own * 1024, children * 1024


# ---------------------------------------------------------------------------------------------
# the two converters (each runs in a fresh process: --run NAME)


def run_webdataset(inputs: list[str], output: str, samples_per_shard: int) -> None:
    import webdataset
    import zstandard

    os.makedirs(output, exist_ok=True)
    with webdataset.ShardWriter(f"{output}/wds-%06d.tar", maxcount=samples_per_shard, verbose=0) as sink:
        for url in inputs:
            stem = Path(url).name.split(".")[0]
            with open(url, "rb") as raw:
                lines = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), 1 << 20)
                for number, line in enumerate(lines, start=1):
                    record = json.loads(line)
                    text = record.pop("text")
                    sink.write({"__key__": f"{stem}-{number:09d}", "txt": text, "json": record})


def run_wdsraft(
    inputs: list[str], output: str, samples_per_shard: int, workers: int, memory: str, buckets: int | None
) -> None:
    from wdsraft.convert import ConvertOptions, convert, parse_size

    convert(
        ConvertOptions(
            inputs=inputs,
            output=output,
            samples_per_shard=samples_per_shard,
            workers=workers,
            memory=parse_size(memory),
            name="kd",
            buckets=buckets,
        )
    )


def child(args: argparse.Namespace) -> None:
    """One measured conversion; prints a JSON line with seconds and memory."""
    import webdataset  # noqa: F401

    import wdsraft.convert  # noqa: F401 - import (torch and all) before the clock starts

    inputs = sorted(str(p) for p in Path(args.inputs).glob("*.jsonl.zst"))
    with TreeMemory() as tree:
        start = time.perf_counter()
        if args.run == "webdataset":
            run_webdataset(inputs, args.output, args.samples_per_shard)
        else:
            run_wdsraft(inputs, args.output, args.samples_per_shard, args.workers, args.memory, args.buckets)
        seconds = time.perf_counter() - start
    main_rss, worker_rss = _peak_rss()
    print(json.dumps({"seconds": seconds, "main_rss": main_rss, "worker_rss": worker_rss, "tree_pss": tree.peak}))


# ---------------------------------------------------------------------------------------------
# the benchmark


def measure(command: list[str]) -> dict:
    os.sync()  # start each run with no dirty pages of the previous one
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS if DEFAULT_CORPUS.exists() else FALLBACK_CORPUS)
    parser.add_argument("--copies", type=int, default=10, help="copies of the corpus (10: about 440 MB of JSONL)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory", default="256M", help="wdsraft's --memory budget")
    parser.add_argument("--samples-per-shard", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=HERE / "output" / "convert")
    parser.add_argument("--run", choices=("webdataset", "wdsraft"), help=argparse.SUPPRESS)
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--buckets", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        child(args)
        return

    import zstandard

    shutil.rmtree(args.workdir, ignore_errors=True)
    inputs = args.workdir / "inputs"
    inputs.mkdir(parents=True)
    for copy in range(args.copies):
        shutil.copyfile(args.corpus, inputs / f"kernel-docs-{copy:02d}.jsonl.zst")
    with open(args.corpus, "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        one_copy = sum(len(chunk) for chunk in iter(lambda: reader.read(1 << 20), b""))
    jsonl_bytes = one_copy * args.copies

    base = [sys.executable, __file__, "--inputs", str(inputs), "--samples-per-shard", str(args.samples_per_shard)]
    wdsraft_args = ["--workers", str(args.workers), "--memory", args.memory]
    runs: dict[str, list[dict]] = {"webdataset": [], "wdsraft": []}
    for _ in range(args.repeats):
        for name in runs:
            output = args.workdir / f"out-{name}"
            shutil.rmtree(output, ignore_errors=True)
            extra = wdsraft_args if name == "wdsraft" else []
            runs[name].append(measure([*base, "--run", name, "--output", str(output), *extra]))
            if name == "wdsraft":  # sanity: every record arrived
                manifest = json.loads((output / "manifest.json").read_text())
                assert manifest["num_samples"] == sum(i["records"] for i in manifest["inputs"]), manifest["inputs"]
            shutil.rmtree(output, ignore_errors=True)

    # The fixed overhead: one record per worker, as many buckets as workers (so the same processes run).
    tiny = args.workdir / "tiny"
    tiny.mkdir()
    for worker in range(args.workers):
        (tiny / f"one-{worker}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "x"}\n'))
    tiny_args = ["--inputs", str(tiny), "--output", str(tiny / "out"), "--buckets", str(args.workers)]
    overhead = measure([*base[:2], *tiny_args, "--run", "wdsraft", "--samples-per-shard", "1", *wdsraft_args])

    rows = []
    base_best = min(r["seconds"] for r in runs["webdataset"])
    for name, results in runs.items():
        best = min(r["seconds"] for r in results)
        rows.append(
            {
                "converter": name,
                "shuffle": "global" if name == "wdsraft" else "none",
                "workers": args.workers if name == "wdsraft" else 1,
                "MB": jsonl_bytes / 1e6,
                "best_s": best,
                "median_s": statistics.median(r["seconds"] for r in results),
                "MB_per_s": jsonl_bytes / 1e6 / best,
                "vs_webdataset": base_best / best,
                "main_rss_MiB": max(r["main_rss"] for r in results) / 2**20,
                "worker_rss_MiB": max(r["worker_rss"] for r in results) / 2**20,
                "tree_pss_MiB": max(r["tree_pss"] for r in results) / 2**20,
            }
        )
    print(
        f"corpus: {args.corpus.name} x{args.copies} = {jsonl_bytes / 1e6:.0f} MB of JSONL; "
        f"wdsraft --workers {args.workers} --memory {args.memory}; best of {args.repeats}"
    )
    print("| converter | shuffle | workers | best s | MB/s | vs webdataset | RSS main | RSS worker | PSS all |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        worker = f"{row['worker_rss_MiB']:.0f} MiB" if row["converter"] == "wdsraft" else "-"
        print(
            f"| {row['converter']} | {row['shuffle']} | {row['workers']} | {row['best_s']:.2f} | "
            f"{row['MB_per_s']:.1f} | {row['vs_webdataset']:.2f}x | {row['main_rss_MiB']:.0f} MiB | {worker} | "
            f"{row['tree_pss_MiB']:.0f} MiB |"
        )
    ours = next(row for row in rows if row["converter"] == "wdsraft")
    print(
        f"fixed overhead (one record per worker, same options and processes): RSS main "
        f"{overhead['main_rss'] / 2**20:.0f} MiB, worker {overhead['worker_rss'] / 2**20:.0f} MiB, "
        f"PSS all {overhead['tree_pss'] / 2**20:.0f} MiB"
    )
    print(
        f"memory taken by the data: PSS all {ours['tree_pss_MiB'] - overhead['tree_pss'] / 2**20:.0f} MiB, "
        f"largest worker {ours['worker_rss_MiB'] - overhead['worker_rss'] / 2**20:.0f} MiB "
        f"(budget: --memory {args.memory} for all workers together)"
    )
    summary = {"rows": rows, "runs": runs, "overhead": overhead, "args": {k: str(v) for k, v in vars(args).items()}}
    (args.workdir.parent / "convert_throughput.json").write_text(json.dumps(summary, indent=1))
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
