"""Check a training run of the SLURM end-to-end test (scripts/slurm-e2e.sh) from its own records.

    python scripts/slurm_e2e_check.py --workdir RUN --shards 'shards/train/train-*.tar' --epochs 3 \\
        [--logs DIR] [--expect RUN=MODE ...]

It reads what examples/train_ledger.py writes besides the ledger, and never the ledger itself:
the delivery logs (``WORKDIR/delivered/RUN-rank-R.log``, one ``step shard ordinal`` line per
sample handed to the training loop) and the committed checkpoints
(``WORKDIR/checkpoints/step-N/run-RUN/rank-R.pt``; committed once every rank of the run wrote
its ``rank-R.done``). What counts as consumed is what the resumed training built on:

- the lineage: the newest committed checkpoint's watermark names every run the training went
  through and the step up to which each one counts (the step of the checkpoint the next run
  resumed from);
- a delivery counts when its run is in the lineage and its step is at most that run's counted
  step; it belongs to the epoch of its run's first committed checkpoint at or after its step
  (every epoch ends with a committed checkpoint, on a step all ranks share);
- deliveries after a run's counted step (a cancelled or requeued task's last steps) do not count:
  the next run served those samples again.

Checks: each epoch 0..EPOCHS-1 counted every sample of the shards exactly once; no later epoch
counted any; the newest committed checkpoint is the final one of the last epoch; every run in the
lineage counts up to one of its committed checkpoints; with --logs, each run started the way
--expect says (fresh, exact or elastic, from its ``rank 0/W run RUN: MODE start at step S`` line).
Prints a table of the runs and a summary; exit status 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import tarfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Checkpoint:
    step: int
    run: str
    world_size: int
    final: bool
    epoch: int
    lineage: dict[str, int]
    steps: dict[str, int | None]


@dataclass
class Run:
    name: str
    checkpoints: list[Checkpoint] = field(default_factory=list)  # committed, by step
    mode: str = "?"
    start: int | None = None
    world_size: int | None = None
    delivered: int = 0
    counted: int = 0
    epochs: Counter = field(default_factory=Counter)  # epoch -> counted deliveries


def samples_of(shards: list[str]) -> dict[str, int]:
    """Samples per shard (by base name), from the tar files: consecutive members with one key are one sample."""
    counts = {}
    for url in shards:
        keys = []
        with tarfile.open(url) as tar:
            for member in tar:
                if member.isfile():
                    key = os.path.basename(member.name).split(".", 1)[0]
                    if not keys or keys[-1] != key:
                        keys.append(key)
        counts[os.path.basename(url)] = len(keys)
    return counts


def committed_checkpoints(workdir: Path) -> list[Checkpoint]:
    found = []
    for run_dir in sorted(workdir.glob("checkpoints/step-*/run-*")):
        meta = run_dir / "world_size"
        if not meta.exists():
            continue
        world_size = int(meta.read_text())
        if len(list(run_dir.glob("rank-*.done"))) != world_size:
            continue
        saved = [torch.load(run_dir / f"rank-{r:05d}.pt", weights_only=True) for r in range(world_size)]
        marks = {(s["step"], bool(s.get("final")), s["data"]["ledger"]["epoch"]) for s in saved}
        if len(marks) != 1:
            raise SystemExit(f"{run_dir}: the ranks' checkpoints disagree on (step, final, epoch): {sorted(marks)}")
        step, final, epoch = marks.pop()
        watermark = saved[0]["data"]["ledger"]
        found.append(
            Checkpoint(
                step,
                run_dir.name.removeprefix("run-"),
                world_size,
                final,
                epoch,
                dict(watermark["lineage"]),
                dict(watermark.get("steps") or {}),
            )
        )
    return sorted(found, key=lambda c: (c.step, len(c.lineage)))


def start_lines(logs: Path) -> dict[str, tuple[str, int, int]]:
    """run -> (mode, start step, world size), from rank 0's start line in the job logs."""
    pattern = re.compile(r"^rank 0/(\d+) run (\S+): (\w+) start at step (\d+)$")
    found = {}
    for path in sorted(logs.glob("*.out")):
        for line in path.read_text(errors="replace").splitlines():
            match = pattern.match(line)
            if match:
                found[match[2]] = (match[3], int(match[4]), int(match[1]))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="the training's WORKDIR")
    parser.add_argument("--shards", required=True, help="glob of the training shards")
    parser.add_argument("--epochs", type=int, required=True, help="the epochs the training had to run")
    parser.add_argument("--logs", type=Path, help="directory of the jobs' .out files (start lines)")
    parser.add_argument("--expect", action="append", default=[], metavar="RUN=MODE", help="how RUN must start")
    args = parser.parse_args()

    problems: list[str] = []
    shards = sorted(glob.glob(args.shards))
    if not shards:
        raise SystemExit(f"no shards match {args.shards}")
    per_shard = samples_of(shards)
    manifest = Path(shards[0]).parent / "manifest.json"
    if manifest.exists():
        listed = {Path(s["url"]).name: s["nsamples"] for s in json.loads(manifest.read_text())["shardlist"]}
        if listed != per_shard:
            problems.append(f"the manifest's sample counts {listed} are not the tar files' {per_shard}")
    everything = {(shard, ordinal) for shard, count in per_shard.items() for ordinal in range(count)}

    checkpoints = committed_checkpoints(args.workdir)
    if not checkpoints:
        print("FAIL: no committed checkpoint")
        return 1
    runs: dict[str, Run] = {}
    for checkpoint in checkpoints:
        runs.setdefault(checkpoint.run, Run(checkpoint.run)).checkpoints.append(checkpoint)
    logs = sorted((args.workdir / "delivered").glob("*-rank-*.log"))
    for log in logs:
        name = log.name.rsplit("-rank-", 1)[0]
        runs.setdefault(name, Run(name))
    if args.logs:
        for name, (mode, start, world_size) in start_lines(args.logs).items():
            run = runs.setdefault(name, Run(name))
            run.mode, run.start, run.world_size = mode, start, world_size

    last = checkpoints[-1]
    lineage = dict(last.steps)
    print(
        f"newest committed checkpoint: step {last.step}, run {last.run}, epoch {last.epoch}, "
        f"{'final' if last.final else 'not final'}; lineage of {len(lineage)} runs"
    )
    if not (last.final and last.epoch == args.epochs - 1):
        problems.append(
            f"the training did not reach the end of epoch {args.epochs - 1}: the newest committed checkpoint "
            f"(step {last.step}, run {last.run}) is {'the final one' if last.final else 'not the final one'} "
            f"of epoch {last.epoch}"
        )
    for name, step in lineage.items():
        run = runs.get(name)
        if step is None or run is None or step not in {c.step for c in run.checkpoints}:
            problems.append(f"run {name} counts up to step {step}, which is none of its committed checkpoints")

    # Deliveries, by epoch.
    counted: dict[int, Counter] = defaultdict(Counter)
    malformed = 0
    for log in logs:
        name = log.name.rsplit("-rank-", 1)[0]
        run = runs[name]
        limit = lineage.get(name)
        ends = [(c.step, c.epoch) for c in run.checkpoints]
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) != 3 or not parts[0].isdigit() or not parts[2].isdigit():
                malformed += 1  # (a line cut by a kill; it never counts)
                continue
            step, shard, ordinal = int(parts[0]), parts[1], int(parts[2])
            run.delivered += 1
            if limit is None or step > limit:
                continue
            epoch = next((e for s, e in ends if s >= step), None)
            if epoch is None:
                problems.append(f"{log.name}: step {step} is after every committed checkpoint of its run")
                break
            counted[epoch][(shard, ordinal)] += 1
            run.counted += 1
            run.epochs[epoch] += 1

    header = ("run", "world", "start", "counted to", "delivered", "counted")
    print("{:<34} {:>5} {:<16} {:>10} {:>9} {:>7}  epochs (counted)".format(*header))
    for run in sorted(runs.values(), key=lambda r: (r.start if r.start is not None else -1, r.name)):
        start = f"{run.mode} @{run.start}" if run.start is not None else "-"
        world = run.world_size or (run.checkpoints[0].world_size if run.checkpoints else "?")
        to = lineage.get(run.name, "outside")
        epochs = " ".join(f"{e}:{n}" for e, n in sorted(run.epochs.items())) or "-"
        print(f"{run.name:<34} {world!s:>5} {start:<16} {to!s:>10} {run.delivered:>9} {run.counted:>7}  {epochs}")
    lost = sum(r.delivered - r.counted for r in runs.values())
    print(f"{len(everything)} samples in {len(per_shard)} shards; {lost} deliveries after their run's counted step")
    print(f"(served again by a later run, not counted); {malformed} cut lines")

    for epoch in range(args.epochs):
        seen = counted.get(epoch, Counter())
        missing = everything - set(seen)
        extra = set(seen) - everything
        repeated = {key: n for key, n in seen.items() if n > 1}
        status = "ok" if not (missing or extra or repeated) else "FAIL"
        print(
            f"epoch {epoch}: {sum(seen.values())} counted deliveries, {len(set(seen) & everything)} of "
            f"{len(everything)} samples, {len(missing)} missing, {len(repeated)} repeated, {len(extra)} unknown: "
            f"{status}"
        )
        if status != "ok":
            problems.append(
                f"epoch {epoch}: missing {sorted(missing)[:5]}, repeated {sorted(repeated.items())[:5]}, "
                f"unknown {sorted(extra)[:5]}"
            )
    for epoch in sorted(set(counted) - set(range(args.epochs))):
        problems.append(f"epoch {epoch} (past the last): {sum(counted[epoch].values())} counted deliveries")

    for expectation in args.expect:
        name, _, mode = expectation.partition("=")
        got = runs[name].mode if name in runs else "never started"
        if got != mode:
            problems.append(f"run {name} started {got}, not {mode}")
    if args.expect:
        wrong = any(" started " in problem for problem in problems)
        print(f"start modes as expected for {len(args.expect)} runs: {'no' if wrong else 'yes'}")

    for problem in problems:
        print(f"FAIL: {problem}")
    print("every epoch consumed each sample exactly once, to the last epoch" if not problems else "CHECKS FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
