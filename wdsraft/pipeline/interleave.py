"""``interleave_datasets``: a weighted mixture of several pipelines, each repeated a number of passes
(or for ever), deterministic from a seed and exactly resumable.

Each item comes from a source drawn with probability proportional to its weight among the sources
still going. A source that runs out starts its next pass (up to ``repeats``); one whose passes are
all done is *exhausted*: with ``stop="first_exhausted"`` the mixture ends there, with
``"all_exhausted"`` the source leaves the draw and the others go on.

**State.** The mixer's draws are a counter-based generator (splitmix64 of a key and the draw's number,
computed 256 at a time with numpy): its state is two ints. The key comes from ``(seed, epoch, rank,
worker)``: each epoch, and each DataLoader worker (whose sources read their own share of the
shards), draws its own sequence. Per source the state holds its pass, how many items that pass
gave, and the source's own ``state_dict()`` (see ``nested.SnapshotSource`` for items that stages
after the mixture hold).

**Passes and the ledger.** Pass ``p`` of a source in epoch ``e`` runs the source's own epoch
``pass_epoch(e, p)`` (a pairing of the two, so that every pass shuffles its own way). Dict items get
``__source__`` (the source's index) and ``__pass__``; the ledger records a position of pass ``p > 0``
under the shard key ``URL#pass=p`` (``core.fields.pass_key``), so a sample served once per pass stays
unambiguous within one loader epoch. On an elastic resume the skip set of the loader's epoch reaches
each source, pass by pass, through :class:`PassSkip`.
"""

from __future__ import annotations

import itertools
import logging
import math
import weakref
from collections.abc import Container, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from wdsraft.core.errors import StateMismatchError
from wdsraft.core.fields import PASS_FIELD, SOURCE_FIELD, pass_key, split_pass_key
from wdsraft.core.state import describe, make_seed
from wdsraft.pipeline.datapipeline import DataPipeline
from wdsraft.pipeline.nested import END, SnapshotSource, adopt_seed_records, seed_records
from wdsraft.pipeline.passes import counted_items
from wdsraft.pipeline.source import SkipSet
from wdsraft.pipeline.stage import Context, SourceStage, unresumable_state

logger = logging.getLogger(__name__)

STOPS = ("first_exhausted", "all_exhausted")
_BLOCK = 256  # draws picked at once
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def uniform(key: int, number: int) -> float:
    """Draw ``number`` of the generator ``key``: splitmix64's output function, as a float in [0, 1)."""
    mask = (1 << 64) - 1
    z = (key + (number + 1) * _GOLDEN) & mask
    z = ((z ^ (z >> 30)) * _MIX1) & mask
    z = ((z ^ (z >> 27)) * _MIX2) & mask
    return ((z ^ (z >> 31)) >> 11) * (1.0 / (1 << 53))


def uniforms(key: int, first: int, count: int) -> np.ndarray:
    """Draws ``first`` to ``first + count - 1`` of the generator ``key``, as :func:`uniform` gives them
    (numpy's uint64 arithmetic wraps as the masks do)."""
    z = np.uint64(key) + np.arange(first + 1, first + 1 + count, dtype=np.uint64) * np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return ((z ^ (z >> np.uint64(31))) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def pass_epoch(epoch: int, pass_number: int) -> int:
    """The epoch a source runs for its pass ``pass_number`` of the mixture's ``epoch`` (Cantor's pairing:
    distinct for every pair, so no two passes of any epochs shuffle alike)."""
    total = epoch + pass_number
    return total * (total + 1) // 2 + pass_number


class PassSkip:
    """One source pass's view of an elastic resume's skip set: positions recorded for that pass only."""

    def __init__(self, skip: SkipSet, pass_number: int):
        self.skip = skip
        self.pass_number = pass_number

    def skipped_in(self, url: str) -> Container[int] | None:
        return self.skip.skipped_in(pass_key(url, self.pass_number))

    def marks_in(self, url: str) -> Mapping[int, Mapping[str, Any]] | None:
        return self.skip.marks_in(pass_key(url, self.pass_number))

    def records_anything(self) -> bool:
        """Whether the skip set holds positions of this pass (of any shard). A skip set that cannot tell
        (not a ledger's ``ConsumedSet``) is taken to hold some."""
        if not hasattr(self.skip, "samples"):
            return True
        keys = itertools.chain(self.skip.samples, getattr(self.skip, "tokens", ()))
        return any(split_pass_key(key)[1] == self.pass_number for key in keys)


class _Feed:
    """One source of the mixture: its passes, and where it is in the current one."""

    def __init__(self, index: int, dataset: Any, repeats: int | None):
        self.index = index
        self.dataset = dataset
        self.repeats = repeats
        self.pass_number = 0
        self.count = 0  # items the current pass gave
        self.done = False
        self.iterator: Iterator[Any] | None = None
        self._epoch = 0
        self._skip: SkipSet | None = None

    def begin(self, epoch: int, skip: SkipSet | None, saved: dict[str, Any] | None) -> None:
        self._epoch, self._skip, self.iterator = epoch, skip, None
        if saved is None:
            self.pass_number, self.count, self.done = 0, 0, False
            return
        self.pass_number, self.count, self.done = saved["pass"], saved["count"], saved["done"]
        if saved["state"] is not None:  # mid-pass: the source goes on from its own state
            self._prepare_pass()
            self.dataset.load_state_dict(saved["state"])
            self.iterator = self._open()

    def _prepare_pass(self) -> None:
        epoch = pass_epoch(self._epoch, self.pass_number)
        if self._skip is not None:
            skip_consumed = getattr(self.dataset, "skip_consumed", None)
            if skip_consumed is None:
                raise StateMismatchError(
                    f"interleave_datasets: source {self.index} ({type(self.dataset).__name__}) cannot skip the "
                    "samples a ledger says were consumed (an elastic resume): use wdsraft pipelines (WebDataset, "
                    "DataPipeline) as sources"
                )
            skip_consumed(PassSkip(self._skip, self.pass_number), epoch)
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def _open(self) -> Iterator[Any]:
        """Iterate the source's current pass: a wdsraft pipeline hands out its pass's own items, and its states
        count them from this feed's ``count`` (one generator less per item; ``passes.counted_items``)."""
        feed, base = weakref.ref(self), self.count  # (weak: the source's iteration must not keep its feed)
        return counted_items(self.dataset, lambda: feed().count - base)  # type: ignore[union-attr]

    def next(self) -> Any:
        """The next item of this source, starting passes as needed; ``END`` once its passes are done."""
        while not self.done:
            if self.iterator is None:
                if self.repeats is not None and self.pass_number >= self.repeats:
                    self.done = True
                    break
                self._prepare_pass()
                self.iterator = self._open()
            item = next(self.iterator, END)
            if item is not END:
                self.count += 1
                return item
            self.iterator = None
            if self.count == 0 and not self._skipped_some():
                # Nothing in this pass and nothing consumed of it before: the next would be as empty.
                if self.repeats is None or self.pass_number + 1 < self.repeats:
                    logger.warning(
                        "interleave_datasets: source %d gave nothing in pass %d (no shards for this worker?): "
                        "it is exhausted",
                        self.index,
                        self.pass_number,
                    )
                self.done = True
                break
            self.pass_number += 1
            self.count = 0
        return END

    def _skipped_some(self) -> bool:
        return self._skip is not None and PassSkip(self._skip, self.pass_number).records_anything()

    def state(self) -> dict[str, Any]:
        if self.iterator is None:
            state: Any = None  # (between two passes: the next starts afresh)
        elif callable(getattr(self.dataset, "state_dict", None)):
            state = self.dataset.state_dict()
        else:
            state = unresumable_state(
                f"cannot save interleave_datasets: source {self.index} ({type(self.dataset).__name__}) has no "
                "state_dict()"
            )
        return {"pass": self.pass_number, "count": self.count, "done": self.done, "state": state}


class InterleaveSource(SnapshotSource):
    """The mixture as a pipeline's source stage (what :func:`interleave_datasets` runs)."""

    # (its whole state is every source's, some 10-20 us for three: taken every 256 items, under 0.1 us per item;
    # a restore fetches again at most 255 items more than the stages after it hold)
    snapshot_every = 256

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], seed: int, stop: str, repeats: list[Any]):
        super().__init__()
        self.datasets = list(datasets)
        self.weights = [float(w) for w in weights]
        self.seed = seed
        self.stop = stop
        self.repeats = repeats
        self._feeds = [_Feed(i, d, r) for i, (d, r) in enumerate(zip(self.datasets, repeats, strict=True))]
        self._live: list[int] = []
        self._bounds: list[float] = []
        self._key = 0
        self._draws = 0
        self._ahead: list[_Feed] = []  # the sources of the draws from ``_ahead_first`` on (for ``fetch``)
        self._ahead_first = 0

    def config(self) -> dict[str, Any]:
        configs = []
        for dataset in self.datasets:
            config = getattr(dataset, "config", None)
            configs.append(describe(config() if callable(config) else type(dataset)))
        return {
            "datasets": configs,
            "weights": self.weights,
            "seed": self.seed,
            "stop": self.stop,
            "repeats": list(self.repeats),
        }

    def start(self, ctx: Context, state: dict[str, Any] | None) -> None:
        saved = state["sources"] if state is not None else [None] * len(self._feeds)
        for feed, feed_state in zip(self._feeds, saved, strict=True):
            feed.begin(ctx.epoch, ctx.skip, feed_state)
        if state is None:
            info = ctx.info
            self._key = make_seed("wdsraft.interleave", self.seed, ctx.epoch, info.rank, info.worker)
            self._draws = 0
            self._set_live([feed.index for feed in self._feeds if self.weights[feed.index] > 0])
        else:
            self._key, self._draws = state["key"], state["draws"]
            self._set_live(list(state["live"]))

    def _set_live(self, live: list[int]) -> None:
        self._live = live
        total, bounds = 0.0, []
        for index in live:
            total += self.weights[index]
            bounds.append(total)
        self._bounds = bounds
        self._ahead, self._ahead_first = [], self._draws  # (the draws ahead are picked anew among these)

    def _feeds_ahead(self, count: int) -> list[_Feed]:
        """The sources the next ``count`` draws pick among the live ones (drawn all at once: numpy)."""
        if not self._live:
            return []
        picks = np.searchsorted(self._bounds, uniforms(self._key, self._draws, count) * self._bounds[-1], "right")
        live = [self._feeds[index] for index in self._live]
        return [live[position] for position in np.minimum(picks, len(live) - 1).tolist()]

    def _after_pass_end(self, feed: _Feed) -> Any:
        """The item of ``feed`` after its pass ran out (the next pass's first), or ``END`` once its passes are
        done: it leaves the draw then (or, with ``first_exhausted``, the mixture ends)."""
        item = feed.next()
        if item is END:
            if self.stop == "first_exhausted":
                self._set_live([])
            else:
                self._set_live([index for index in self._live if index != feed.index])
        return item

    def fetch(self) -> Any:
        while self._live:
            ahead = self._draws - self._ahead_first
            if ahead >= len(self._ahead):
                self._ahead, self._ahead_first, ahead = self._feeds_ahead(_BLOCK), self._draws, 0
            feed = self._ahead[ahead]
            self._draws += 1
            # (the common case inline: the source's current pass goes on)
            item = next(feed.iterator, END) if feed.iterator is not None else END
            if item is not END:
                feed.count += 1
            else:
                item = self._after_pass_end(feed)
                if item is END:
                    continue
            if isinstance(item, dict):
                item[SOURCE_FIELD] = feed.index
                item[PASS_FIELD] = feed.pass_number
            return item
        return END

    def _items(self, ctx: Context) -> Iterator[Any]:
        # ``SnapshotSource._items`` with ``fetch`` written in: the draws of a block in one loop, one generator
        # per item (what a mixture adds per item is what this loop does).
        next_snapshot = self._first_snapshot(ctx)
        serials = ctx.serials
        while self._live:
            for feed in self._feeds_ahead(_BLOCK):  # (the draws from ``_draws`` on)
                fetched = self._fetched
                if fetched == next_snapshot:
                    next_snapshot = self._snapshot(ctx)
                iterator = feed.iterator
                item = next(iterator, END) if iterator is not None else END
                self._draws += 1
                if item is not END:
                    feed.count += 1
                else:
                    item = self._after_pass_end(feed)
                    if item is END:
                        break  # (the draws after it are picked anew, among the sources still live)
                if isinstance(item, dict):
                    item[SOURCE_FIELD] = feed.index
                    item[PASS_FIELD] = feed.pass_number
                self._fetched = fetched + 1
                ctx.provenance, ctx.serial = (fetched, 0), next(serials)  # (ctx.stamp, inline)
                yield item

    def drawn_seed(self) -> Any:
        # The seeds the sources drew themselves (a shuffle without a seed): a fresh mixture adopts them, so
        # the passes it begins after a restore shuffle as the first one's would have.
        return {"sources": seed_records(self.datasets)}

    def adopt_seed(self, seed: Any) -> None:
        adopt_seed_records(self.datasets, seed.get("sources") if isinstance(seed, dict) else None)

    def whole_state(self) -> dict[str, Any]:
        return {
            "key": self._key,
            "draws": self._draws,
            "live": list(self._live),
            "sources": [feed.state() for feed in self._feeds],
        }


class Interleave(DataPipeline):
    """What :func:`interleave_datasets` returns: a checkpointable pipeline over the mixture."""

    def __init__(self, source: InterleaveSource):
        super().__init__(source)
        self.datasets = source.datasets
        self.weights = source.weights

    def source_stage(self) -> SourceStage | None:
        """The mixer itself, to run as the source of a pipeline this is the first stage of (one level of
        states less than a ``PipelineSource`` around this pipeline); None once stages or repeats were added."""
        if len(self.pipeline) == 1 and self.repetitions == 1:
            return self.pipeline[0]
        return None


def _mixture_in(dataset: Any) -> InterleaveSource | None:
    """The mixer of a source that is (or starts with) an ``interleave_datasets`` mixture."""
    stages = getattr(dataset, "pipeline", None)
    first = stages[0] if isinstance(stages, list) and stages else None
    if isinstance(first, InterleaveSource):
        return first
    return _mixture_in(first) if isinstance(first, DataPipeline) else None


def interleave_datasets(
    datasets: Sequence[Any],
    weights: Sequence[float] | None = None,
    *,
    seed: int = 0,
    stop: str = "first_exhausted",
    repeats: int | Sequence[int | None] | None = 1,
) -> Interleave:
    """A weighted, resumable mixture of ``datasets`` (wdsraft pipelines: ``WebDataset``, ``DataPipeline``...).

    ``weights``: relative, one per dataset (equal by default); each item's source is drawn among the sources
    still going. ``repeats``: passes over each source (one number for all, or one per source; ``None``:
    for ever), each pass a new epoch of the source. ``stop``: ``"first_exhausted"`` ends the mixture when
    the first source has done all its passes (the mixture keeps its proportions), ``"all_exhausted"`` goes
    on with the others until every source has. ``seed``: the draws, per epoch, rank and DataLoader worker.
    """
    datasets = list(datasets)
    if not datasets:
        raise ValueError("interleave_datasets needs at least one dataset")
    weights = [1.0] * len(datasets) if weights is None else [float(w) for w in weights]
    if len(weights) != len(datasets):
        raise ValueError(f"interleave_datasets: {len(weights)} weights for {len(datasets)} datasets")
    if any(not (0 <= w < math.inf) for w in weights) or not sum(weights) > 0:
        raise ValueError(f"interleave_datasets: weights must be finite, >= 0, with a positive sum, not {weights}")
    if stop not in STOPS:
        raise ValueError(f"interleave_datasets: stop must be one of {STOPS}, not {stop!r}")
    per_source = list(repeats) if isinstance(repeats, (list, tuple)) else [repeats] * len(datasets)
    if len(per_source) != len(datasets):
        raise ValueError(f"interleave_datasets: {len(per_source)} repeats for {len(datasets)} datasets")
    if len({id(dataset) for dataset in datasets}) != len(datasets):
        raise ValueError("interleave_datasets: the same dataset object twice (build one per source)")
    for index, (dataset, repeat) in enumerate(zip(datasets, per_source, strict=True)):
        if repeat is not None and (not isinstance(repeat, int) or repeat < 1):
            raise ValueError(f"interleave_datasets: repeats of source {index} must be an int >= 1 or None")
        inner = _mixture_in(dataset)
        if inner is not None and (repeat != 1 or any(r != 1 for r in inner.repeats)):
            # Each level would number its passes in the same __pass__ field: the ledger could not tell them apart.
            raise ValueError(
                f"interleave_datasets: source {index} is a mixture, and passes on both levels cannot be recorded "
                "apart: give the inner mixture's sources to this one (or repeat neither)"
            )
        if getattr(dataset, "repetitions", 1) != 1:
            # Its own epochs would advance inside one pass of the mixture: passes could not name positions.
            raise ValueError(
                f"interleave_datasets: source {index} repeats itself (repeat/with_epoch): give its passes to "
                "interleave_datasets(repeats=...) instead"
            )
    return Interleave(InterleaveSource(datasets, weights, seed, stop, per_source))
