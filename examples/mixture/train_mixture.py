"""A three-source mixture whose weights change between runs, resumed through the ledger.

    python examples/mixture/train_mixture.py --demo-shards run/demo --workdir run \\
        --source web=5 --source code=3 --source books=2:3 --stop-at-step 12
    python examples/mixture/train_mixture.py --demo-shards run/demo --workdir run \\
        --source web=2 --source code=3 --source books=5:3            # other weights: elastic resume

Each ``--source NAME=WEIGHT[:PASSES]`` reads ``SHARDS_ROOT/NAME/*.tar`` (``--shards-root``; ``--demo-shards
DIR`` writes three small sources there first and uses them) and serves it ``PASSES`` times (1; ``0``: for
ever) within an epoch, drawn with probability proportional to ``WEIGHT``. The loop is
``examples/train_ledger.py``'s: every ``--checkpoint-every`` steps every rank commits the ledger and writes
its checkpoint; a new run resumes the newest committed one, exactly when the configuration is the same,
else elastically (changed weights, an added source, another world size or worker count): every source
goes on where the committed steps left it, pass by pass, and nothing is served twice within a pass.

Each delivered sample is logged (``delivered/RUN-rank-R.log``: step, source, pass, shard, ordinal) so that
``--check`` can verify, after the last run, that the samples delivered up to committed checkpoints are
each source's samples exactly once per pass. ``--stop-at-step`` ends the run there abruptly (as a
preemption would: what was delivered after the last checkpoint is not committed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import wdsraft as wds

DEMO = {"web": (6, 40), "code": (4, 25), "books": (2, 15)}  # source -> (shards, samples per shard)


def write_demo_shards(root: Path) -> None:
    """Three small sources under ``root``; each written aside and renamed into place, so that ranks started
    together (each writes them) never read a half-written one."""
    for name, (shards, per_shard) in DEMO.items():
        directory = root / name
        if directory.exists():
            continue
        aside = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root if root.exists() else _made(root)))
        with wds.ShardWriter(str(aside / f"{name}-%03d.tar"), maxcount=per_shard, verbose=0) as sink:
            for number in range(shards * per_shard):
                sink.write({"__key__": f"{number:06d}", "txt": f"{name} document {number}"})
        try:
            aside.rename(directory)
        except OSError:  # another rank's copy got there first: the same bytes
            shutil.rmtree(aside)


def _made(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    return root


def parse_source(text: str) -> tuple[str, float, int | None]:
    name, _, spec = text.partition("=")
    weight, _, passes = spec.partition(":")
    count = int(passes or 1)
    return name, float(weight), (None if count == 0 else count)


def committed_checkpoints(workdir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of the checkpoints every rank of their run finished, oldest first."""
    found = []
    for directory in sorted((workdir / "checkpoints").glob("step-*")):
        for run_dir in directory.glob("run-*"):
            meta = run_dir / "world_size"
            if meta.exists() and len(list(run_dir.glob("rank-*.done"))) == int(meta.read_text()):
                found.append((int(directory.name.split("-")[1]), run_dir))
    return sorted(found)


def make_loader(args: argparse.Namespace, sources: list[tuple[str, float, int | None]]) -> wds.WebLoader:
    datasets = []
    for name, _, _ in sources:
        urls = sorted(str(p) for p in (args.shards_root / name).glob("*.tar"))
        if not urls:
            sys.exit(f"no shards in {args.shards_root / name}")
        source = wds.WebDataset(urls, shardshuffle=100, seed=args.seed, nodesplitter=wds.split_by_node)
        datasets.append(source.shuffle(20, seed=args.seed))
    mixture = wds.interleave_datasets(
        datasets,
        [weight for _, weight, _ in sources],
        seed=args.seed,
        stop="all_exhausted",
        repeats=[passes for _, _, passes in sources],
    )
    return wds.WebLoader(wds.DataPipeline(mixture, wds.batched(args.batch)), batch_size=None, num_workers=args.workers)


def save(args: argparse.Namespace, step: int, ledger: wds.Ledger, loader, rank: int, world: int, final=False) -> dict:
    data = ledger.checkpoint(loader, step)  # commits the ledger: every rank does it
    run_dir = args.workdir / "checkpoints" / f"step-{step:08d}" / f"run-{ledger.run}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "world_size").write_text(str(world))
    temp = run_dir / f".rank-{rank:05d}.pt.tmp"
    torch.save({"step": step, "final": final, "data": data}, temp)
    os.replace(temp, run_dir / f"rank-{rank:05d}.pt")
    (run_dir / f"rank-{rank:05d}.done").touch()
    return data


def train(args: argparse.Namespace) -> None:
    rank, world = wds.distributed.rank_and_world_size()
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    sources = [parse_source(text) for text in args.source]
    loader = make_loader(args, sources)
    ledger = wds.Ledger(str(args.workdir / "ledger"), run=os.environ.get("WDSRAFT_RUN"))
    step, saved = 0, None
    checkpoints = committed_checkpoints(args.workdir)
    if checkpoints:
        step, run_dir = checkpoints[-1]
        mine = run_dir / f"rank-{rank:05d}.pt"
        saved = torch.load(mine if mine.exists() else run_dir / "rank-00000.pt", weights_only=True)
        if saved.get("final"):
            print(f"rank {rank}/{world}: the epoch was done at step {step}", flush=True)
            return
    mode = ledger.resume(loader, saved["data"] if saved else None)
    weights = ", ".join(f"{name} {weight:g}" for name, weight, _ in sources)
    print(f"rank {rank}/{world} run {ledger.run}: {mode} start at step {step}, weights {weights}", flush=True)
    names = [name for name, _, _ in sources]
    (args.workdir / "delivered").mkdir(parents=True, exist_ok=True)
    with open(args.workdir / "delivered" / f"{ledger.run}-rank-{rank}.log", "a") as log:
        for batch in wds.until_all_ranks_end(ledger.track(loader)):
            step += 1
            if batch is not None:  # (None: this rank's share ran out while others still train)
                fields = zip(
                    batch["__source__"], batch["__pass__"], batch["__url__"], batch["__ordinal__"], strict=True
                )
                for source, pass_number, url, ordinal in fields:
                    log.write(f"{step} {names[int(source)]} {int(pass_number)} {Path(url).name} {int(ordinal)}\n")
                log.flush()
            if step == args.stop_at_step:
                os._exit(0)  # a preemption: what was delivered since the last checkpoint is not committed
            if step % args.checkpoint_every == 0:
                save(args, step, ledger, loader, rank, world)
        save(args, step, ledger, loader, rank, world, final=True)
    print(f"rank {rank}/{world} run {ledger.run}: the epoch is done at step {step}", flush=True)


def check(args: argparse.Namespace) -> None:
    """Every sample of every source delivered exactly once per pass, counting each run up to its last
    committed checkpoint (the last run to its end)."""
    last_commit: dict[str, int] = {}
    for step, run_dir in committed_checkpoints(args.workdir):
        run = run_dir.name.removeprefix("run-")
        last_commit[run] = max(step, last_commit.get(run, 0))
    served: Counter = Counter()
    for log in (args.workdir / "delivered").glob("*.log"):
        run = log.name.rsplit("-rank-", 1)[0]
        for line in log.read_text().splitlines():
            step, source, pass_number, shard, ordinal = line.split()
            if int(step) <= last_commit.get(run, -1):
                served[source, int(pass_number), shard, int(ordinal)] += 1
    expected: Counter = Counter()
    for name, _, passes in (parse_source(text) for text in args.source):
        for url in sorted((args.shards_root / name).glob("*.tar")):
            samples = sum(1 for _ in wds.WebDataset(str(url), shardshuffle=False))
            for pass_number in range(passes or 1):
                expected.update((name, pass_number, url.name, ordinal) for ordinal in range(samples))
    twice = sorted(key for key, count in served.items() if count > 1)
    missing, extra = sorted(expected - served), sorted(set(served) - set(expected))
    if twice or missing or extra:
        sys.exit(
            f"FAILED: {len(twice)} served twice {twice[:3]}, {len(missing)} missing {missing[:3]}, extra {extra[:3]}"
        )
    print(f"OK: {sum(served.values())} samples, every one once per pass of its source")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", action="append", required=True, help="NAME=WEIGHT[:PASSES] (0 passes: for ever)")
    parser.add_argument("--shards-root", type=Path, help="directory with one folder of shards per source")
    parser.add_argument("--demo-shards", type=Path, help="write three small demo sources there and read them")
    parser.add_argument("--workdir", type=Path, required=True, help="shared directory: ledger, checkpoints, logs")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--stop-at-step", type=int, default=-1, help="end abruptly after this step (a preemption)")
    parser.add_argument("--check", action="store_true", help="verify the delivered logs instead of training")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    if args.demo_shards is not None:
        write_demo_shards(args.demo_shards)
        args.shards_root = args.demo_shards
    if args.shards_root is None:
        parser.error("give --shards-root or --demo-shards")
    check(args) if args.check else train(args)


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():  # (a gloo group's threads still running as the interpreter exits can abort it)
            dist.destroy_process_group()
