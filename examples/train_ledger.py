"""A training loop that survives preemptions and configuration changes, with the ledger.

    RANK=0 WORLD_SIZE=2 python examples/train_ledger.py --shards 'data/*.tar' --workdir run42
    (or under SLURM: srun python examples/train_ledger.py ...; see examples/train_array.sbatch)

Each rank iterates its share of the shards through a ``WebLoader``; every
``--checkpoint-every`` steps every rank commits the ledger and writes its checkpoint
(``checkpoints/step-N/rank-R.pt``, then a ``rank-R.done`` marker). A checkpoint is
*committed* once all ranks of its run wrote theirs. On start, the newest committed
checkpoint is resumed: exactly, if the configuration (world size, workers, seed...) is the
same, else elastically: the epoch restarts and skips every sample the ledger says was
consumed, so nothing is repeated or lost.

Each delivered sample is also logged (``delivered/RUN-rank-R.log``: step and position) so
that tests can check the promise sample by sample. ``--kill-at-step`` makes the run kill
itself with SIGKILL there (after the batch, or after the ledger commit of that step).
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import warnings
from pathlib import Path

import torch

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
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--kill-after", choices=["batch", "commit"], default="batch")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)

    rank, world_size = wds.distributed.rank_and_world_size()
    urls = sorted(glob.glob(args.shards))
    if not urls:
        parser.error(f"no shards match {args.shards}")
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
    mode = ledger.resume(loader, saved["data"] if saved else None)
    print(f"rank {rank}/{world_size} run {ledger.run}: {mode} start at step {step}", flush=True)

    log_dir = args.workdir / "delivered"
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{ledger.run}-rank-{rank}.log", "a") as log:
        for batch in ledger.track(loader):
            step += 1
            for url, ordinal in zip(batch["__url__"], batch["__ordinal__"], strict=True):
                log.write(f"{step} {os.path.basename(url)} {int(ordinal)}\n")
            log.flush()
            os.fsync(log.fileno())
            if step == args.kill_at_step and args.kill_after == "batch":
                os.kill(os.getpid(), signal.SIGKILL)
            if step % args.checkpoint_every == 0:
                save(args.workdir, step, ledger, loader, rank, world_size, args)
        save(args.workdir, step, ledger, loader, rank, world_size, args, final=True)


def save(workdir: Path, step: int, ledger, loader, rank: int, world_size: int, args, final: bool = False) -> None:
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


if __name__ == "__main__":
    main()
