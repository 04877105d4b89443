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
``all_reduce`` of the lengths when the epoch starts, nothing per step, and one at its end that
checks them. Without it, by a one-int
``all_reduce`` per step ("I still have a batch"); on a default process group whose backend is not
gloo (NCCL), that flag goes over a gloo group of the same ranks, created once, so that it never
waits for the GPU (a CUDA tensor's ``.item()`` would make the host wait for the step's kernels every
step). Without an initialised process group of more than one rank, batches pass through untouched.

A rank whose loader raises says so in the next exchange (the flag carries "failed" beside "have a
batch", the lengths a "failed" beside the length): every rank then raises with it, the others a
``RankFailedError`` naming it, instead of waiting in the ``all_reduce`` until the group's timeout.
With ``length``, the ranks exchange once more at the epoch's end, so that a length found wrong
there (understated, or overstated in "shortest") stops every rank together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from wdsraft.core.errors import RankFailedError
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


def _exchange(value: int, failure: BaseException | None, group: Any, device: torch.device | None) -> tuple[int, int]:
    """The largest ``value`` of the ranks, and the lowest rank that failed (-1: none), in one ``all_reduce``.

    (One MAX over [value, failed rank]: a rank that failed sends ``world - rank``, so the largest names the
    lowest failed rank. "shortest" negates what it sends to take a minimum.)"""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tensor = torch.tensor([value, 0 if failure is None else world - rank], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    largest, failed = (int(x) for x in tensor.tolist())
    return largest, (world - failed if failed else -1)


def _raise_if_failed(failed: int, failure: BaseException | None, what: str) -> None:
    """Every rank raises together: the one that failed its own error, the others one naming it."""
    if failure is not None:
        raise failure
    if failed >= 0:
        raise RankFailedError(f"even ends: rank {failed} of the group failed {what}; this rank stops with it")


def _pulled(batches: Iterator[T]) -> tuple[Any, BaseException | None]:
    """The next batch (or ``_END``), or the error pulling it raised (told to the other ranks first)."""
    try:
        return next(batches, _END), None
    except Exception as error:  # (a KeyboardInterrupt is not reported: the process ends anyway)
        return _END, error


def _agree(length: Callable[[], int], mode: str, group: Any, device: torch.device | None = None) -> int:
    """The longest ("pad") or shortest ("shortest") of the ranks' lengths; a rank whose length raised makes
    every rank raise."""
    failure: BaseException | None = None
    try:
        value = length()
    except Exception as error:
        value, failure = 0, error
    sign = 1 if mode == "pad" else -1
    agreed, failed = _exchange(sign * value, failure, group, device)
    _raise_if_failed(failed, failure, "to give its length")
    return sign * agreed


def _by_flags(batches: Iterator[T], mode: str, group: Any) -> Iterator[T | None]:
    """One exchange per step: pad while any rank has a batch, or stop once any rank has none."""
    flag_group, device = _flag_group(group)
    while True:
        batch, failure = _pulled(batches)
        have = batch is not _END
        # "pad": go on while any rank has one (MAX of have); "shortest": stop once any has none (MAX of not have).
        flag, failed = _exchange(int(have if mode == "pad" else not have), failure, flag_group, device)
        _raise_if_failed(failed, failure, "to read its next batch")
        if flag != (1 if mode == "pad" else 0):
            return  # ("shortest": a batch pulled here is not delivered)
        yield None if batch is _END else batch


def _by_count(
    batches: Iterator[T], mode: str, steps: int, target: int, length: int, group: Any, device: torch.device | None
) -> Iterator[T | None]:
    """``target - steps`` more steps (the ranks agreed on ``target`` when the epoch started; this rank said
    ``length``), then one exchange, on every rank at the same step, that checks every rank's length held.

    An error while the steps go on is raised at once (the other ranks are in the training step's
    collectives, not in an exchange of this stage's)."""
    for step in range(steps, target):
        batch = next(batches, _END)
        if batch is _END and step < length:
            if mode == "shortest":  # it cannot stop alone, and "shortest" hands out batches, never None
                raise ValueError(
                    f"even ends: this rank ran out after {step} batches, before the {target} steps the shortest "
                    f"length said (it gave {length}): the length it gave is wrong"
                )
            logger.warning("even ends: this rank ran out after %d batches, not the %d it said: padding", step, length)
            length = step  # (warned once)
        yield None if batch is _END else batch  # type: ignore[misc]
    failure: BaseException | None = None
    if mode == "pad" or length == target:
        # It said it had ``length``: nothing may be left ("shortest": only a rank that gave the shortest).
        extra, failure = _pulled(batches)
        if failure is None and extra is not _END:
            failure = ValueError(
                f"even ends: this rank has more than the {length} batches it said (the ranks agreed on {target} "
                "steps): the length it gave is wrong"
            )
    _, failed = _exchange(0, failure, group, device)
    _raise_if_failed(failed, failure, "its check at the epoch's end (a wrong length, or an error reading batches)")


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
        flag_group, device = _flag_group(group)
        target = _agree(lambda: length, mode, flag_group, device)
        yield from _by_count(iter(batches), mode, 0, target, length, flag_group, device)


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
            flag_group, device = _flag_group(self.group)
            given = self.length
            length = (lambda: given(ctx.epoch)) if callable(given) else (lambda: given)
            if self._target is None:
                self._target = _agree(length, self.mode, flag_group, device)
            steps = _by_count(src, self.mode, self._steps, self._target, length(), flag_group, device)
        for item in steps:
            self._steps += 1
            yield item
