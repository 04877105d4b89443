"""A training loop that survives preemptions and configuration changes, with the ledger.

    RANK=0 WORLD_SIZE=2 python examples/train_ledger.py --shards 'data/*.tar' --workdir run42
    (or under SLURM: srun python examples/train_ledger.py ...; see examples/train_array.sbatch)

Each rank iterates its share of the shards through a ``WebLoader``; every
``--checkpoint-every`` steps every rank commits the ledger and writes its checkpoint
(``checkpoints/step-N/run-RUN/rank-R.pt``, then a ``rank-R.done`` marker). A checkpoint is
*committed* once all ranks of its run wrote theirs. On start, the newest committed
checkpoint is resumed: exactly, if the configuration (world size, workers, seed...) is the
same, else elastically: the epoch restarts and skips every sample the ledger says was
consumed, so nothing is repeated or lost.

Ranks hold different numbers of batches (a short last shard): with more than one rank, they
join a gloo process group (``MASTER_ADDR``/``MASTER_PORT``; ``train_array.sbatch`` sets
them) and ``wds.until_all_ranks_end`` gives the ranks that run out empty steps until every
rank has, as a lockstep training loop needs; so every rank ends the epoch on the same step and
its final checkpoint is committed. Training goes on, epoch after epoch, until ``--epochs``
epochs are done (across runs); ``--step-seconds`` stands in for the model's step.

Each delivered sample is also logged (``delivered/RUN-rank-R.log``: step and position) so
that tests can check the promise sample by sample. ``--kill-at-step`` makes the run kill
itself with SIGKILL there (after the batch, or after the ledger commit of that step).
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import wdsraft as wds


def committed_checkpoints(workdir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of checkpoints every rank of their run finished, oldest first."""
    found = []
    for directory in sorted((workdir / "checkpoints").glob("step-*")):
        for run_dir in directory.glob("run-*"):
            meta = run_dir / "world_size"
            if meta.exists() and len(list(run_dir.glob("rank-*.done"))) == int(meta.read_text()):
                found.append((int(directory.name.split("-")[1]), run_dir))
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="shard pattern (glob)")
    parser.add_argument("--workdir", type=Path, required=True, help="shared directory: ledger, checkpoints, logs")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1, help="epochs to train in all (across runs)")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (the model's step)")
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--kill-after", choices=["batch", "commit"], default="batch")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)

    rank, world_size = wds.distributed.rank_and_world_size()
    urls = sorted(glob.glob(args.shards))
    if not urls:
        parser.error(f"no shards match {args.shards}")
    if world_size > 1:  # a process group, as the model's training step would have
        if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
            parser.error("several ranks need MASTER_ADDR and MASTER_PORT (train_array.sbatch sets them)")
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=10))
    dataset = (
        wds.WebDataset(urls, shardshuffle=100, seed=args.seed, nodesplitter=wds.split_by_node)
        .shuffle(20, seed=args.seed)
        .batched(args.batch)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=args.workers)
    ledger = wds.Ledger(str(args.workdir / "ledger"), run=os.environ.get("WDSRAFT_RUN"))

    step, saved = 0, None
    checkpoints = committed_checkpoints(args.workdir)
    if checkpoints:
        step, run_dir = checkpoints[-1]
        mine = run_dir / f"rank-{rank:05d}.pt"
        saved = torch.load(mine if mine.exists() else run_dir / "rank-00000.pt", weights_only=True)
        if saved.get("final") and saved["data"]["ledger"]["epoch"] + 1 >= args.epochs:
            print(f"rank {rank}/{world_size}: all {args.epochs} epochs done at step {step}", flush=True)
            return
    mode = ledger.resume(loader, saved["data"] if saved else None)
    print(f"rank {rank}/{world_size} run {ledger.run}: {mode} start at step {step}", flush=True)

    log_dir = args.workdir / "delivered"
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{ledger.run}-rank-{rank}.log", "a") as log:
        while True:
            for batch in wds.until_all_ranks_end(ledger.track(loader)):
                step += 1
                if batch is not None:  # (None: this rank's share ran out, others still train)
                    for url, ordinal in zip(batch["__url__"], batch["__ordinal__"], strict=True):
                        log.write(f"{step} {os.path.basename(url)} {int(ordinal)}\n")
                    log.flush()
                    os.fsync(log.fileno())
                time.sleep(args.step_seconds)
                if step == args.kill_at_step and args.kill_after == "batch":
                    os.kill(os.getpid(), signal.SIGKILL)
                if step % args.checkpoint_every == 0:
                    save(args.workdir, step, ledger, loader, rank, world_size, args)
            # The epoch's end, on the same step on every rank: its checkpoint is committed.
            data = save(args.workdir, step, ledger, loader, rank, world_size, args, final=True)
            epoch = data["ledger"]["epoch"]
            print(f"rank {rank}/{world_size} run {ledger.run}: epoch {epoch} done at step {step}", flush=True)
            if epoch + 1 >= args.epochs:
                break


def save(workdir: Path, step: int, ledger, loader, rank: int, world_size: int, args, final: bool = False) -> dict:
    data = ledger.checkpoint(loader, step)  # commits the ledger: every rank does it
    if step == args.kill_at_step and args.kill_after == "commit":
        os.kill(os.getpid(), signal.SIGKILL)  # the ledger has the commit, the checkpoint does not
    run_dir = workdir / "checkpoints" / f"step-{step:08d}" / f"run-{ledger.run}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "world_size").write_text(str(world_size))
    temp = run_dir / f".rank-{rank:05d}.pt.tmp"
    torch.save({"step": step, "final": final, "data": data}, temp)
    os.replace(temp, run_dir / f"rank-{rank:05d}.pt")
    (run_dir / f"rank-{rank:05d}.done").touch()
    return data


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():  # (a gloo group's threads still running as the interpreter exits can abort it)
            dist.destroy_process_group()
