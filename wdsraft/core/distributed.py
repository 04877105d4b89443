"""Who am I in the job: rank and world size, DataLoader worker and worker count.

Ranks come from torch.distributed when it is initialised, else from ``RANK``/``WORLD_SIZE``,
else from SLURM (``SLURM_PROCID``/``SLURM_NTASKS``), else 0 of 1. Workers come from
``torch.utils.data.get_worker_info()`` (or webdataset's ``WORKER``/``NUM_WORKERS``).
"""

from __future__ import annotations

import os
from typing import NamedTuple


class WorkerInfo(NamedTuple):
    rank: int
    world_size: int
    worker: int
    num_workers: int


def rank_and_world_size(group: object = None) -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(group=group), dist.get_world_size(group=group)  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def worker_and_count() -> tuple[int, int]:
    if "WORKER" in os.environ and "NUM_WORKERS" in os.environ:
        return int(os.environ["WORKER"]), int(os.environ["NUM_WORKERS"])
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def worker_info(group: object = None) -> WorkerInfo:
    """Rank, world size, DataLoader worker id and worker count of the calling process."""
    return WorkerInfo(*rank_and_world_size(group), *worker_and_count())


def pytorch_worker_seed(group: object = None) -> int:
    """webdataset's per-worker seed: ``rank * 1000 + worker``."""
    info = worker_info(group)
    return info.rank * 1000 + info.worker
