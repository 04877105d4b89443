"""Even ends across ranks: every rank takes the same number of steps per epoch.

Ranks rarely hold the same number of batches (a short last shard, shards that do not divide by
the world size). In a lockstep training loop the rank that runs out first stops calling the
collectives of the training step, and the others wait for it for ever: the classic hang at the
end of an epoch on multi-node jobs. ``until_all_ranks_end`` hands out this rank's batches, then
``None`` until every rank has run out, so that all ranks leave the epoch at the same step (and a
checkpoint taken there is taken by every rank). The training step treats ``None`` as a step with
no data (no loss, or a zero-weight batch), still joining the collectives.

Each step costs one small ``all_reduce`` of an int; without an initialised process group of more
than one rank, the batches pass through untouched. With NCCL the int lives on the current CUDA
device: call ``torch.cuda.set_device(local_rank)`` first, as NCCL needs anyway. A rank that raises
leaves the others waiting in the ``all_reduce`` until the group's timeout, as with any collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["until_all_ranks_end"]

T = TypeVar("T")
_END = object()


def until_all_ranks_end(batches: Iterable[T], group: Any = None) -> Iterator[T | None]:
    """This rank's ``batches``, then ``None`` for each step another rank still has a batch for."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        yield from batches
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    iterator = iter(batches)
    while True:
        batch = next(iterator, _END)
        flag.fill_(0 if batch is _END else 1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not flag.item():
            return
        yield None if batch is _END else batch  # type: ignore[misc]
