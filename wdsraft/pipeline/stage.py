"""The stage contract: :class:`Stage` (a webdataset-compatible stage that can save and restore what it
holds), :class:`SourceStage` (one that stamps items with addresses), the :class:`Context` a pass
shares between stages, and :class:`AddressTracker` for stages that buffer items.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, IterableDataset
from webdataset.utils import PipelineStage

from wdsraft.core.distributed import WorkerInfo, worker_info
from wdsraft.core.errors import StateMismatchError
from wdsraft.pipeline.addresses import Address

if TYPE_CHECKING:  # (the source imports this module)
    from wdsraft.pipeline.source import SkipSet

logger = logging.getLogger(__name__)


class Context:
    """What the stages of one pipeline iteration share.

    ``provenance`` is the address of the item handed out last (the raw item the source read, sub-index 0,
    or the address a stage that reorders or splits items gave it); ``serial`` changes with every stamp,
    to a value never used before in the pass, so a stage that receives several items from one stamp
    (after ``unbatched``, say) can number them. A stage that stamps the items it hands out puts back,
    when it is resumed, what the stages before it had stamped (``hand_out`` / ``resume``): a stamp
    applies downstream only, and an upstream stage still splitting one item goes on numbering it.
    """

    def __init__(self, epoch: int, info: WorkerInfo):
        self.epoch = epoch
        self.info = info
        self.provenance: Address | None = None
        self.serial = 0
        #: Where new serials come from (the source reads it inline: ``ctx.serial = next(ctx.serials)``).
        self.serials = itertools.count(1)
        self.source: SourceStage | None = None
        self.rematerializers: dict[int, Callable[[list[Address]], list[Any]]] = {}
        self.stages: list[Any] = []
        #: A ``SkipSet`` for this epoch (a ledger's consumed set, on an elastic resume): what the source leaves out.
        self.skip: SkipSet | None = None
        #: Stages run as plain functions inside this pass (``wds.filters._shuffle``): what they hold is saved nowhere.
        self.unsaved: list[str] = []
        #: The pass's ``PartialTracker`` where plain functions follow the source (the raw item they are in).
        self.partial: Any = None

    def stamp(self, address: Address) -> None:
        self.provenance = address
        self.serial = next(self.serials)

    def hand_out(self, address: Address | None) -> tuple[Address | None, int]:
        """Stamp the item a stage is about to yield (None: it has no position); returns what the stages
        before it had stamped, for ``resume`` right after the yield."""
        saved = (self.provenance, self.serial)
        self.provenance = address
        self.serial = next(self.serials)
        return saved

    def resume(self, saved: tuple[Address | None, int]) -> None:
        """Put back what ``hand_out`` returned: the stage pulls from upstream again, whose stamps go on."""
        self.provenance, self.serial = saved

    def live_addresses(self) -> list[Address]:
        """Addresses of every item the stages after the source hold right now (and of the raw item plain
        functions after the source are part-way through)."""
        live = [
            address
            for stage in self.stages
            if isinstance(stage, Stage) and not isinstance(stage, SourceStage)
            for address in stage.addresses()
        ]
        base = self.partial.base if self.partial is not None else None
        if base is not None:
            live.append((*base[:-1], 0))
        return live


class AddressTracker:
    """Gives each item a stage receives its address (raw item address + sub-index)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._serial = -1
        self._next_sub = 0

    def address(self) -> Address | None:
        ctx = self.ctx
        if ctx.provenance is None:
            return None
        if ctx.serial != self._serial:
            self._serial, self._next_sub = ctx.serial, 0
        base = ctx.provenance
        sub = base[-1] + self._next_sub
        self._next_sub += 1
        return (*base[:-1], sub)


class Stage:
    """A pipeline stage that holds something between items and can save it.

    Subclasses implement ``run(ctx, src, state)`` (a generator; ``state`` is what their
    ``state_dict`` returned, or None for a fresh start), ``state_dict()`` and ``config()``.
    Called as a plain function on an iterator (``stage(src)``, the way webdataset calls
    stages), a stage runs without state, so it also works inside webdataset's own pipelines.
    Which hooks a buffering, splitting, seeded or source stage must override: docs/stages.md.
    """

    def replay(self, src: Iterator[Any]) -> Iterator[Any]:
        """What this stage does to items, without state, for re-creating saved items downstream of it.

        Stages that only reorder or hold items return ``src``; stages that split items split them;
        stages that merge items (batching) cannot be replayed.
        """
        raise StateMismatchError(
            f"stage {self.index} ({type(self).__name__}) merges items, so items after it cannot be re-created "
            "from their sources; move buffering stages (shuffle) before it"
        )

    def replay_at(self, src: Iterator[Any], address: Address) -> Iterator[Any]:
        """``replay`` for the items made from the one raw item at ``address`` (sub-index 0): for stages
        whose output depends on where an item was, not only on what it is (``enumerate``'s count)."""
        return self.replay(src)

    #: Index of this stage in its pipeline (set by the pipeline at the start of an iteration).
    index = -1
    #: Whether it can hold items between outputs (False: a ``WebLoader`` keeps no snapshots for re-reading them).
    holds_items = True

    def config(self) -> dict[str, Any]:
        return {}

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def epoch_start_state(self) -> dict[str, Any] | None:
        """The state that replays this stage from the start of the epoch (for stages upstream of the source)."""
        return None

    def addresses(self) -> list[Address]:
        """Addresses of the items this stage holds (so the source keeps what re-reading them needs)."""
        return []

    def drawn_seed(self) -> Any:
        """A seed this stage drew itself (no seed was given); carried in every state so a fresh
        pipeline built the same way adopts it."""
        return None

    def adopt_seed(self, seed: Any) -> None:
        pass

    def __call__(self, src: Iterator[Any] | None = None) -> Iterator[Any]:
        note_plain_run(type(self).__name__)
        return self.run(Context(0, worker_info()), src, None)


class Curried:
    """What webdataset's curried stages (``pipelinefilter(f)(*args, **kw)``) expose: ``.f``, the uncurried
    function (set by each class), and ``.args`` / ``.kw``, the arguments the stage was made with."""

    f: Any = None
    args: tuple[Any, ...]
    kw: dict[str, Any]

    def __new__(cls, *args: Any, **kw: Any) -> Any:
        stage = super().__new__(cls)
        stage.args, stage.kw = args, kw
        return stage


class SourceStage(Stage):
    """A stage that produces raw items with addresses and can re-read items by address."""

    #: Whether ``source_state`` needs the addresses downstream stages hold (costly to gather every step).
    needs_live_addresses = False

    def rematerialize(self, addresses: list[Address]) -> list[Any]:
        raise NotImplementedError

    def source_state(self, live_addresses: list[Address]) -> dict[str, Any]:
        """The state, given the addresses that buffering stages downstream still hold."""
        return self.state_dict()


def in_dataloader_worker() -> bool:
    import torch.utils.data

    return torch.utils.data.get_worker_info() is not None


def invoke_stage(f: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one stage the way webdataset's DataPipeline does."""
    if isinstance(f, (IterableDataset, DataLoader)) and len(args) == 0:
        return iter(f)
    if isinstance(f, PipelineStage):
        return f.run(*args, **kwargs)
    if isinstance(f, list):
        return iter(f)
    if callable(f):
        return f(*args, **kwargs)
    raise ValueError(f"{f}: not a valid pipeline stage")


# -- states that cannot be restored ------------------------------------------------------------------------

#: The key of a stage state that says the stage cannot be restored, and why (a message naming the stage).
UNRESUMABLE = "unresumable"


def unresumable_state(reason: str) -> dict[str, Any]:
    """The state of a stage that cannot save what it holds: taken without error (a DataLoader's snapshots
    must not stop training that never resumes), refused when loaded, or when the user asks for it."""
    return {UNRESUMABLE: reason}


def find_unresumable(state: Any) -> str | None:
    """The reasons of the unresumable stage states nested in ``state`` (dicts only), or None."""
    reasons: list[str] = []
    if isinstance(state, dict):
        _collect_unresumable(state, reasons)
    return "; ".join(dict.fromkeys(reasons)) if reasons else None


def _collect_unresumable(state: Any, reasons: list[str]) -> None:
    reason = state.get(UNRESUMABLE)
    if isinstance(reason, str):
        reasons.append(reason)
        return
    for value in state.values():
        if isinstance(value, dict):
            _collect_unresumable(value, reasons)


class _Local(threading.local):
    context: Context | None = None  # the pass whose items are being pulled on this thread
    quiet = 0  # > 0 while a DataLoader takes states on its own (snapshots): those must not raise


_local = _Local()


def set_active_context(ctx: Context | None) -> Context | None:
    """Make ``ctx`` the pass being pulled on this thread; returns the one before (to put back)."""
    previous, _local.context = _local.context, ctx
    return previous


def note_plain_run(name: str) -> None:
    """A stateful stage runs as a plain function (``stage(src)``): inside a pass, what it holds is saved
    nowhere, so that pass's states must refuse to resume."""
    ctx = _local.context
    if ctx is not None and name not in ctx.unsaved:
        ctx.unsaved.append(name)


@contextmanager
def quiet_states() -> Iterator[None]:
    """States taken inside this block (a DataLoader's snapshots) mark what cannot be restored instead of raising."""
    _local.quiet += 1
    try:
        yield
    finally:
        _local.quiet -= 1


def states_must_be_whole() -> bool:
    """Whether a state asked for now must raise on what cannot be restored: the user asked for it (not a
    DataLoader worker, not a loader's own snapshot)."""
    return _local.quiet == 0 and not in_dataloader_worker()
