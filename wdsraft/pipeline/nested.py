"""Sources whose position is a state of their own: a checkpointable dataset used as a pipeline's first
stage (``DataPipeline(wds.RandomMix(...), wds.shuffle(100))``), and the mixes.

Their items are addressed by their number in the pass. To save items that stages after them hold (a
shuffle buffer, a partial batch), they keep their whole state from just before every few items, and
save the newest one at or before the oldest item still held, plus how many items to fetch again: a
restore goes back there and re-fetches them (bounded by what the buffers hold plus ``snapshot_every``,
not by how far into the epoch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from wdsraft.core.errors import StateMismatchError
from wdsraft.pipeline.addresses import Address
from wdsraft.pipeline.stage import Context, SourceStage, Stage, quiet_states

#: What ``fetch`` returns when there is nothing more.
END = object()


class SnapshotSource(SourceStage):
    """A source that can give its whole state before any item, and restart from such a state."""

    needs_live_addresses = True

    #: A whole state is kept before every ``snapshot_every``-th item only: a restore goes back to the newest
    #: one at or before the oldest item still held and fetches again from there (at most this many items
    #: more). A whole state per item cost more than the item for the mixes, whose state is several pipelines'.
    snapshot_every = 16

    def __init__(self) -> None:
        self._snapshots: dict[int, dict[str, Any]] = {}
        self._replayed: dict[int, Any] = {}
        self._fetched = 0
        self._prune_at = 64

    # -- what a kind of source decides -----------------------------------------------------------------

    def start(self, ctx: Context, state: dict[str, Any] | None) -> None:
        """Begin a pass: from scratch (None) or from a state ``whole_state`` gave."""
        raise NotImplementedError

    def fetch(self) -> Any:
        """The next item, or ``END``."""
        raise NotImplementedError

    def whole_state(self) -> dict[str, Any]:
        """The state that restarts right before the next item (marked unresumable where it cannot)."""
        raise NotImplementedError

    # -- the stage -------------------------------------------------------------------------------------

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        self._snapshots, self._replayed, self._fetched = {}, {}, 0
        replay = 0
        if state is not None:
            state, self._fetched, replay = state["resume"], state["base"], state["replay"]
        self.start(ctx, state)
        # Re-fetch now the items the restored stages after this one hold: they ask for them first.
        for _ in range(replay):
            self._snapshots[self._fetched] = self._quiet_state()
            item = self.fetch()
            if item is END:
                break
            self._replayed[self._fetched] = item
            self._fetched += 1
        return self._items(ctx)

    def _items(self, ctx: Context) -> Iterator[Any]:
        next_snapshot = self._first_snapshot(ctx)
        fetch, serials = self.fetch, ctx.serials
        while True:
            fetched = self._fetched
            if fetched == next_snapshot:
                next_snapshot = self._snapshot(ctx)
            item = fetch()
            if item is END:
                return
            self._fetched = fetched + 1
            ctx.provenance, ctx.serial = (fetched, 0), next(serials)  # (ctx.stamp, inline)
            yield item

    def _first_snapshot(self, ctx: Context) -> int:
        """Where ``_items`` keeps its first snapshot: before the next item, or never (-1) where no stage after
        this one holds items (snapshots are needed only to re-read items that stages after this one hold)."""
        self._prune_at = 64  # (doubled past what a pruning keeps: a buffer spanning many snapshots is walked rarely)
        keep = any(isinstance(stage, Stage) and stage.holds_items for stage in ctx.stages[self.index + 1 :])
        return self._fetched if keep else -1

    def _snapshot(self, ctx: Context) -> int:
        """Keep the whole state before the next item (pruning the old ones now and then); returns where the
        next snapshot is due."""
        if len(self._snapshots) >= self._prune_at:
            self._prune(ctx)
            self._prune_at = max(64, 2 * len(self._snapshots))
        self._snapshots[self._fetched] = self._quiet_state()
        return self._fetched + self.snapshot_every

    def _prune(self, ctx: Context) -> None:
        """Drop the snapshots (and re-fetched items) older than the newest one a restore could still need."""
        live = [address[0] for address in ctx.live_addresses()]
        floor = _newest_at_or_before(self._snapshots, min(live) if live else self._fetched)
        for old in [s for s in self._snapshots if floor is not None and s < floor]:
            del self._snapshots[old]
        for old in [s for s in self._replayed if floor is None or s < floor]:
            del self._replayed[old]

    def _quiet_state(self) -> dict[str, Any]:
        with quiet_states():  # (what cannot be restored is marked; the pipeline raises if the user asked)
            return self.whole_state()

    def state_dict(self) -> dict[str, Any]:
        return self.source_state([])

    def source_state(self, live_addresses: list[Address]) -> dict[str, Any]:
        oldest = min((address[0] for address in live_addresses), default=self._fetched)
        base = _newest_at_or_before(self._snapshots, oldest) if oldest < self._fetched else None
        if base is None:  # nothing held (or nothing kept, without stateful stages after it): the state now
            return {"resume": self._quiet_state(), "base": self._fetched, "replay": 0}
        return {"resume": self._snapshots[base], "base": base, "replay": self._fetched - base}

    def rematerialize(self, addresses: list[Address]) -> list[Any]:
        return [self._replayed[address[0]] for address in addresses]


def pass_skip_on(dataset: Any, ctx: Context, what: str) -> None:
    """Hand an elastic resume's skip set on to a nested dataset (it runs the same epoch as the pass):
    its own source leaves the consumed positions out. One that cannot skip is refused, not read whole."""
    if ctx.skip is None:
        return
    skip_consumed = getattr(dataset, "skip_consumed", None)
    if skip_consumed is None:
        raise StateMismatchError(
            f"{what} ({type(dataset).__name__}) cannot skip the samples a ledger says were consumed (an elastic "
            "resume): use wdsraft pipelines (WebDataset, DataPipeline) there"
        )
    skip_consumed(ctx.skip, ctx.epoch)


def _newest_at_or_before(snapshots: dict[int, Any], serial: int) -> int | None:
    return max((s for s in snapshots if s <= serial), default=None)


def is_stateful_dataset(stage: Any) -> bool:
    """A dataset with the state protocol (``state_dict``/``load_state_dict``), not a stage: it can be a
    pipeline's source through :class:`PipelineSource`."""
    return (
        not isinstance(stage, Stage)
        and callable(getattr(stage, "state_dict", None))
        and callable(getattr(stage, "load_state_dict", None))
        and hasattr(stage, "__iter__")
    )


def source_stage_of(dataset: Any) -> SourceStage:
    """The source stage that runs a checkpointable dataset as a pipeline's first stage: its own, where it
    offers one (``source_stage()``: a mixture that is nothing more, one level of states less), else a
    :class:`PipelineSource` around it."""
    own = getattr(dataset, "source_stage", None)
    stage = own() if callable(own) else None
    return stage if isinstance(stage, SourceStage) else PipelineSource(dataset)


class PipelineSource(SnapshotSource):
    """A checkpointable dataset (a ``DataPipeline``, a mix) as the first stage of another pipeline."""

    def __init__(self, dataset: Any):
        super().__init__()
        self.dataset = dataset
        self._iterator: Iterator[Any] | None = None
        # A dataset whose whole state costs more (a mix: several pipelines' and an RNG) says how rarely to keep it.
        self.snapshot_every = getattr(dataset, "nested_snapshot_every", type(self).snapshot_every)

    def start(self, ctx: Context, state: dict[str, Any] | None) -> None:
        pass_skip_on(self.dataset, ctx, "the pipeline's first stage")
        if state is None:
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(ctx.epoch)
        else:
            self.dataset.load_state_dict(state)
        self._iterator = iter(self.dataset)

    def fetch(self) -> Any:
        assert self._iterator is not None
        return next(self._iterator, END)

    def whole_state(self) -> dict[str, Any]:
        return self.dataset.state_dict()


def seed_records(datasets: list[Any]) -> list[Any]:
    """The seeds each dataset drew itself (a shuffle without a seed) and its live RNGs, for a state: a source
    over several datasets carries them, so that a fresh one built the same way draws what they would have."""
    records = [getattr(dataset, "seed_record", None) for dataset in datasets]
    return [record() if callable(record) else None for record in records]


def adopt_seed_records(datasets: list[Any], records: Any) -> None:
    """Give each dataset back what :func:`seed_records` took."""
    for dataset, record in zip(datasets, records or [], strict=False):
        adopt = getattr(dataset, "adopt_seeds", None)
        if record is not None and callable(adopt):
            adopt(record)
