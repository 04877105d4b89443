"""Even ends across ranks: every rank takes the same number of steps per epoch.

Ranks rarely hold the same number of batches (a short last shard, shards that do not divide by
the world size). In a lockstep training loop the rank that runs out first stops calling the
collectives of the training step, and the others wait for it for ever: the classic hang at the
end of an epoch on multi-node jobs. Two ways out, per epoch:

- ``"pad"``: every rank takes as many steps as the longest rank; a rank that has run out gets
  ``None`` for its remaining steps (a step with no data: no loss, or a zero-weight batch, still
  joining the collectives). Nothing is left out.
- ``"shortest"``: every rank stops at the step where the first rank runs out. The batches the other
  ranks had left are not delivered this epoch (see ``EvenEnds`` for where they go).

How the ranks agree: with ``length`` (this rank's number of batches in the epoch), by one
``all_reduce`` of the lengths when the epoch starts, and nothing per step. Without it, by a one-int
``all_reduce`` per step ("I still have a batch"); on a default process group whose backend is not
gloo (NCCL), that flag goes over a gloo group of the same ranks, created once, so that it never
waits for the GPU (a CUDA tensor's ``.item()`` would make the host wait for the step's kernels every
step). Without an initialised process group of more than one rank, batches pass through untouched.
A rank that raises leaves the others waiting in the ``all_reduce`` until the group's timeout, as
with any collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from wdsraft.core.state import describe
from wdsraft.pipeline.stage import Context, Stage

__all__ = ["MODES", "EvenEnds", "even_ends", "until_all_ranks_end"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_END = object()
#: The ways to even the ends: pad the short ranks, or stop every rank with the shortest.
MODES = ("pad", "shortest")

Length = int | Callable[[int], int] | None


def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


_side_groups: dict[int, tuple[Any, Any]] = {}  # id(default group) -> (default group, its gloo twin)


def _flag_group(group: Any) -> tuple[Any, torch.device | None]:
    """Where the flag travels: a CPU tensor over gloo where possible, else on the group's device."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend:  # (gloo, or a "cpu:gloo,cuda:nccl" group)
        return group, None
    if group is None:
        world = dist.distributed_c10d._get_default_group()
        known = _side_groups.get(id(world))
        if known is None or known[0] is not world:
            # Every rank reaches here together: at its first step of even ends.
            known = (world, dist.new_group(backend="gloo"))
            _side_groups[id(world)] = known
            logger.info("even ends: the per-step flag goes over a gloo group (the default group is %s)", backend)
        return known[1], None
    if backend == "nccl":  # a group the caller made: its own device, one host wait per step
        return group, torch.device("cuda", torch.cuda.current_device())
    return group, None


def _agree(value: int, mode: str, group: Any, device: torch.device | None = None) -> int:
    """The longest ("pad") or shortest ("shortest") of the ranks' values."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if mode == "pad" else dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


def _by_flags(batches: Iterator[T], mode: str, group: Any) -> Iterator[T | None]:
    """One exchange per step: pad while any rank has a batch, or stop once any rank has none."""
    flag_group, device = _flag_group(group)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    op = dist.ReduceOp.MAX if mode == "pad" else dist.ReduceOp.MIN
    while True:
        batch = next(batches, _END)
        flag.fill_(0 if batch is _END else 1)
        dist.all_reduce(flag, op=op, group=flag_group)
        if not flag.item():
            return  # ("shortest": a batch pulled here is not delivered)
        yield None if batch is _END else batch  # type: ignore[misc]


def _by_count(batches: Iterator[T], mode: str, steps: int, target: int) -> Iterator[T | None]:
    """``target - steps`` more steps (the ranks agreed on ``target`` when the epoch started)."""
    short = False
    for _ in range(steps, target):
        batch = next(batches, _END)
        if batch is _END and not short:
            short = True
            if mode == "shortest":
                logger.warning("even ends: this rank ran out before the %d steps its length promised: padding", target)
        yield None if batch is _END else batch  # type: ignore[misc]
    if mode == "pad" and next(batches, _END) is not _END:
        raise ValueError(
            f"even ends: this rank has more than the {target} batches the longest length said: the length it "
            "gave is wrong (the other ranks have ended the epoch)"
        )


def even_ends(
    batches: Iterable[T], mode: str = "pad", group: Any = None, length: int | None = None
) -> Iterator[T | None]:
    """This rank's ``batches``, evened across the ranks of ``group`` (see the module): ``"pad"`` gives
    ``None`` for each step another rank still has a batch for, ``"shortest"`` stops all ranks with the
    shortest. ``length`` (this rank's batch count) replaces the per-step exchange by one at the start.

    A plain iterator holds no state: to resume mid-epoch, start it again over the restored loader at
    the same step on every rank (the per-step exchange then comes out right; a ``length`` would have
    to be what is left). ``WebLoader(..., even_ends=...)`` saves its steps with the loader's state."""
    _check_mode(mode)
    if not _distributed(group):
        yield from batches
        return
    if length is None:
        yield from _by_flags(iter(batches), mode, group)
    else:
        yield from _by_count(iter(batches), mode, 0, _agree(length, mode, *_flag_group(group)))


def until_all_ranks_end(batches: Iterable[T], group: Any = None) -> Iterator[T | None]:
    """This rank's ``batches``, then ``None`` for each step another rank still has a batch for
    (``even_ends(batches, "pad")``)."""
    return even_ends(batches, "pad", group)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"even ends: mode must be one of {MODES}, not {mode!r}")


class EvenEnds(Stage):
    """Even ends as the last stage of a pipeline (``WebLoader(..., even_ends="pad"|"shortest")`` puts it
    there): checkpointed with the pipeline, so a state taken during the padding steps resumes into the
    same step count.

    Its state is the steps taken this epoch and, with ``length``, the step count the ranks agreed on
    (no new exchange on resume). ``length`` is an int or a function of the epoch giving this rank's
    batch count. Without it the ranks agree step by step, and a state needs nothing more: restored on
    every rank at the same step, the flags give the same remaining step count.

    With ``"shortest"``, what the longer ranks had left is not delivered this epoch: the batch each
    pulled at the final step is dropped, the rest never read. Exact resume goes on with the next
    epoch, which reads everything again. A ledger records only what this stage hands out, so it
    counts none of those samples as consumed: an elastic resume into the same epoch serves them.
    """

    holds_items = False  # (it counts steps; what it takes in it hands out at once)

    def __init__(self, mode: str = "pad", group: Any = None, length: Length = None):
        _check_mode(mode)
        self.mode = mode
        self.group = group
        self.length = length
        self._steps = 0
        self._target: int | None = None

    def config(self) -> dict[str, Any]:
        return {"mode": self.mode, "length": describe(self.length)}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self._steps, "target": self._target}

    def replay(self, src: Iterator[Any]) -> Iterator[Any]:
        return src  # (it holds nothing)

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        if src is None:
            raise ValueError("even ends needs batches before it")
        self._steps = state["steps"] if state else 0
        self._target = state["target"] if state else None
        return self._counted(ctx, src)

    def _counted(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        if not _distributed(self.group):
            steps: Iterator[Any] = src
        elif self.length is None:
            steps = _by_flags(src, self.mode, self.group)
        else:
            if self._target is None:
                length = self.length(ctx.epoch) if callable(self.length) else self.length
                self._target = _agree(length, self.mode, *_flag_group(self.group))
            steps = _by_count(src, self.mode, self._steps, self._target)
        for item in steps:
            self._steps += 1
            yield item
