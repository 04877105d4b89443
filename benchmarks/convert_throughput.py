"""Conversion throughput and memory: ``wdsraft convert`` (global shuffle) vs webdataset's ``ShardWriter``,
with the same number of processes on both sides.

    python benchmarks/convert_throughput.py [--corpus PATH] [--copies 200] [--processes 1 2]
                                            [--memory 256M] [--repeats 3]

The corpus (``benchmarks/corpus.py``; default the bundled sample) is copied ``--copies`` times
under distinct names (the default 200 copies are 86,800 documents, about 500 MB of JSONL). Each
converter turns all copies into shards of ``--samples-per-shard`` samples (``.txt`` text +
``.json`` other fields), once per process count in ``--processes``:

- **webdataset**: webdataset 1.0.2's ``ShardWriter``, sequential and unshuffled (read a file,
  ``json.loads`` each line, write the sample). With one process, as its documentation does it;
  with N, the input files dealt out to N forked processes, each with a ``ShardWriter`` of its
  own (what a user parallelising it by hand would do);
- **wdsraft**: ``wdsraft convert`` with a global shuffle, ``--workers N`` (1: all in the main
  process; N > 1: a pool of N worker processes, the main process waiting) and a memory budget of
  ``--memory``.

Every run is a fresh process; in each of ``--repeats`` rounds every (converter, processes) pair
runs once, the order rotating from round to round. Reported per pair: the median time (from the
first input byte to the last shard closed, interpreter start-up and imports excluded) with the
slowest and fastest run, MB/s of JSONL at the median, and the ratio to webdataset with the same
number of processes: the median over rounds of the two times in the same round. Memory: the peak
RSS of the main process and of the largest child process, and the peak PSS of the whole process
tree (physical memory, shared pages counted once, sampled every 20 ms), the highest of the
rounds. The same figures for a wdsraft conversion of one record per worker (same options, same
processes) give the fixed overhead, so that the memory the data took can be compared with the
budget. Both converters' sample counts are checked against the input.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from corpus import add_arguments, describe, documents, jsonl_bytes

HERE = Path(__file__).resolve().parent


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
    """Peak RSS of this process and of its largest (finished, waited-for) child, in bytes."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return own * 1024, children * 1024


# ---------------------------------------------------------------------------------------------
# the two converters (each measured run is a fresh process: --run NAME)


def webdataset_files(inputs: list[str], pattern: str, samples_per_shard: int) -> int:
    import webdataset
    import zstandard

    written = 0
    with webdataset.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0) as sink:
        for url in inputs:
            stem = Path(url).name.split(".")[0]
            with open(url, "rb") as raw:
                lines = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), 1 << 20)
                for number, line in enumerate(lines, start=1):
                    record = json.loads(line)
                    text = record.pop("text")
                    sink.write({"__key__": f"{stem}-{number:09d}", "txt": text, "json": record})
                    written += 1
    return written


def _webdataset_part(inputs: list[str], pattern: str, samples_per_shard: int, written) -> None:
    count = webdataset_files(inputs, pattern, samples_per_shard)
    with written.get_lock():
        written.value += count


def run_webdataset(inputs: list[str], output: str, samples_per_shard: int, processes: int) -> int:
    """Samples written: in this process, or the inputs dealt out to ``processes`` forked processes."""
    os.makedirs(output, exist_ok=True)
    if processes == 1:
        return webdataset_files(inputs, f"{output}/wds-%06d.tar", samples_per_shard)
    context = multiprocessing.get_context("fork")
    written = context.Value("q", 0)
    parts = [
        context.Process(
            target=_webdataset_part,
            args=(inputs[p::processes], f"{output}/wds-{p}-%06d.tar", samples_per_shard, written),
        )
        for p in range(processes)
    ]
    for part in parts:
        part.start()
    for part in parts:
        part.join()
        if part.exitcode != 0:
            raise SystemExit(f"a webdataset process failed (exit code {part.exitcode})")
    return written.value


def run_wdsraft(
    inputs: list[str], output: str, samples_per_shard: int, workers: int, memory: str, buckets: int | None
) -> int:
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
    return json.loads((Path(output) / "manifest.json").read_text())["num_samples"]


def child(args: argparse.Namespace) -> None:
    """One measured conversion; prints a JSON line with seconds, samples and memory."""
    import webdataset  # noqa: F401

    import wdsraft.convert  # noqa: F401 - import (torch and all) before the clock starts

    inputs = sorted(str(p) for p in Path(args.inputs).glob("*.jsonl.zst"))
    (processes,) = args.processes
    with TreeMemory() as tree:
        start = time.perf_counter()
        if args.run == "webdataset":
            samples = run_webdataset(inputs, args.output, args.samples_per_shard, processes)
        else:
            samples = run_wdsraft(inputs, args.output, args.samples_per_shard, processes, args.memory, args.buckets)
        seconds = time.perf_counter() - start
    main_rss, child_rss = _peak_rss()
    print(
        json.dumps(
            {
                "seconds": seconds,
                "samples": samples,
                "main_rss": main_rss,
                "child_rss": child_rss,
                "tree_pss": tree.peak,
            }
        )
    )


# ---------------------------------------------------------------------------------------------
# the benchmark


def measure(command: list[str]) -> dict:
    os.sync()  # start each run with no dirty pages of the previous one
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, copies=200)
    parser.add_argument(
        "--processes",
        type=int,
        nargs="+",
        default=[1, 2],
        help="process counts, each run by both converters (wdsraft: --workers N) (default: 1 2)",
    )
    parser.add_argument("--memory", default="256M", help="wdsraft's --memory budget (default 256M)")
    parser.add_argument("--samples-per-shard", type=int, default=10_000, help="(default 10000)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument(
        "--workdir", type=Path, default=HERE / "output" / "convert", help="scratch space, removed at the end"
    )
    parser.add_argument("--run", choices=("webdataset", "wdsraft"), help=argparse.SUPPRESS)
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--buckets", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        child(args)
        return

    import zstandard

    print(describe(args.corpus, args.copies), flush=True)
    shutil.rmtree(args.workdir, ignore_errors=True)
    inputs = args.workdir / "inputs"
    inputs.mkdir(parents=True)
    for copy in range(args.copies):
        shutil.copyfile(args.corpus, inputs / f"kernel-docs-{copy:04d}.jsonl.zst")
    megabytes = jsonl_bytes(args.corpus) * args.copies / 1e6
    expected = sum(1 for _ in documents(args.corpus)) * args.copies

    base = [sys.executable, __file__, "--inputs", str(inputs), "--samples-per-shard", str(args.samples_per_shard)]
    pairs = [(name, n) for n in args.processes for name in ("webdataset", "wdsraft")]
    runs: dict[tuple[str, int], list[dict]] = {pair: [] for pair in pairs}
    for round_number in range(args.repeats):
        shift = round_number % len(pairs)
        for name, processes in pairs[shift:] + pairs[:shift]:
            output = args.workdir / f"out-{name}-{processes}"
            shutil.rmtree(output, ignore_errors=True)
            extra = ["--processes", str(processes), "--memory", args.memory]
            result = measure([*base, "--run", name, "--output", str(output), *extra])
            if result["samples"] != expected:
                raise SystemExit(f"{name} with {processes} processes wrote {result['samples']} of {expected} samples")
            runs[(name, processes)].append(result)
            shutil.rmtree(output, ignore_errors=True)
            plural = "es" if processes > 1 else ""
            print(
                f"  round {round_number + 1}: {name}, {processes} process{plural}: {result['seconds']:.2f} s",
                flush=True,
            )

    # The fixed overhead: one record per worker, as many buckets as workers (so the same processes run).
    overheads = {}
    for processes in args.processes:
        tiny = args.workdir / f"tiny-{processes}"
        tiny.mkdir()
        for worker in range(processes):
            (tiny / f"one-{worker}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "x"}\n'))
        tiny_args = ["--inputs", str(tiny), "--output", str(tiny / "out"), "--buckets", str(processes)]
        options = ["--samples-per-shard", "1", "--processes", str(processes), "--memory", args.memory]
        overheads[processes] = measure([*base[:2], *tiny_args, "--run", "wdsraft", *options])

    print(
        f"\n{megabytes:.0f} MB of JSONL in {args.copies} files; wdsraft --memory {args.memory}; "
        f"medians of {args.repeats} rounds, each run a fresh process, order rotating\n"
    )
    print(
        "| converter | shuffle | processes | s (median) | s (fastest-slowest) | MB/s | vs webdataset, same processes "
        "(median of rounds, range) | RSS main | RSS largest child | PSS all |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name, processes in pairs:
        results = runs[(name, processes)]
        seconds = [r["seconds"] for r in results]
        median = statistics.median(seconds)
        theirs = [r["seconds"] for r in runs[("webdataset", processes)]]
        ratios = [t / s for t, s in zip(theirs, seconds, strict=True)]
        row = {
            "converter": name,
            "shuffle": "global" if name == "wdsraft" else "none",
            "processes": processes,
            "MB": megabytes,
            "seconds": seconds,
            "median_s": median,
            "MB_per_s": megabytes / median,
            "vs_webdataset": statistics.median(ratios),
            "ratios": ratios,
            "main_rss_MiB": max(r["main_rss"] for r in results) / 2**20,
            "child_rss_MiB": max(r["child_rss"] for r in results) / 2**20,
            "tree_pss_MiB": max(r["tree_pss"] for r in results) / 2**20,
        }
        rows.append(row)
        label = "webdataset `ShardWriter`" if name == "webdataset" else "**wdsraft convert**"
        ratio = "1.00x" if name == "webdataset" else f"**{row['vs_webdataset']:.2f}x** ({spread(ratios)})"
        child_rss = f"{row['child_rss_MiB']:.0f} MiB" if processes > 1 else "-"
        print(
            f"| {label} | {row['shuffle']} | {processes} | {median:.2f} | {spread(seconds)} | {row['MB_per_s']:.1f} "
            f"| {ratio} | {row['main_rss_MiB']:.0f} MiB | {child_rss} | {row['tree_pss_MiB']:.0f} MiB |"
        )
    print()
    for processes, overhead in overheads.items():
        ours = next(r for r in rows if r["converter"] == "wdsraft" and r["processes"] == processes)
        field, where = ("child_rss", "largest worker") if processes > 1 else ("main_rss", "main process")
        print(
            f"wdsraft --workers {processes}: fixed overhead (one record per worker, same processes): "
            f"{where} RSS {overhead[field] / 2**20:.0f} MiB, PSS all {overhead['tree_pss'] / 2**20:.0f} MiB; "
            f"taken by the data: {where} {ours[f'{field}_MiB'] - overhead[field] / 2**20:.0f} MiB, PSS all "
            f"{ours['tree_pss_MiB'] - overhead['tree_pss'] / 2**20:.0f} MiB (budget: --memory {args.memory} for all "
            "workers together)"
        )
    summary = {
        "rows": rows,
        "overheads": overheads,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.workdir.parent / "convert_throughput.json").write_text(json.dumps(summary, indent=1))
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
