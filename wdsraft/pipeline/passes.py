"""One pass over a pipeline's stages, restored from a state: re-read the items buffered stages held
(by address) through the stateless stages between the source and them, then go on.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable, Iterator
from itertools import chain, islice
from typing import TYPE_CHECKING, Any

from wdsraft.core.distributed import WorkerInfo
from wdsraft.core.errors import StateMismatchError
from wdsraft.core.state import STATE_FORMAT, STATE_VERSION, config_text, text_fingerprint
from wdsraft.pipeline.addresses import Address
from wdsraft.pipeline.batch import _Splitter
from wdsraft.pipeline.client import ClientReader, client_reader_span, composed, passed_through
from wdsraft.pipeline.nested import is_stateful_dataset, source_stage_of
from wdsraft.pipeline.partial import PartialTracker, counted, handed_out, rest_of_item
from wdsraft.pipeline.splitwatch import (
    Lookahead,
    SplitWatch,
    at_most_one_per_item,
    dropping_stages,
    may_split,
    plain_runs,
    states_before,
)
from wdsraft.pipeline.stage import (
    Context,
    SourceStage,
    Stage,
    invoke_stage,
    set_active_context,
    unresumable_state,
)

if TYPE_CHECKING:  # (the pipeline imports this module to run its passes)
    from wdsraft.pipeline.datapipeline import DataPipeline

logger = logging.getLogger(__name__)


class _Pass:
    """One pass over a pipeline's stages: builds the chain of iterators, restoring stages if asked."""

    def __init__(self, pipeline: DataPipeline, ctx: Context, states: dict[str, Any] | None):
        self.pipeline = pipeline
        self.ctx = ctx
        self.states = states or {}
        self.stages = pipeline.pipeline
        self.source_index = next((i for i, s in enumerate(self.stages) if isinstance(s, SourceStage)), None)
        if self.source_index is None and self.stages and is_stateful_dataset(self.stages[0]):
            # A checkpointable dataset (a pipeline, a mix) as the first stage: a source, for this pass.
            self.stages = [source_stage_of(self.stages[0]), *self.stages[1:]]
            self.source_index = 0
        if self.source_index is None:
            # A reader the client built from webdataset's pieces (url_opener + tar_file_expander + a grouper):
            # wrapped, for this pass, in a source stage that finds its samples' positions.
            span = client_reader_span(self.stages)
            if span is not None:
                first, last = span
                stages = self.stages = list(self.stages)
                function = stages[first] if first == last else composed(stages[first : last + 1], pipeline.invoke)
                stages[first : last + 1] = [ClientReader(function, pipeline.invoke)] + [passed_through] * (last - first)
                self.source_index = first
        # Plain functions right after the source may yield several items per raw item: the first stage after
        # them (or the output) counts what went past of the current raw item (see wdsraft.pipeline.partial).
        self.boundary = len(self.stages)
        self.plain: list[Any] = []
        self.tracker: PartialTracker | None = None
        #: Where the source cannot re-read: what a state pulls out of those plain functions (see ``_peek``).
        self.source_ahead: Lookahead | None = None
        if self.source_index is not None:
            after = range(self.source_index + 1, len(self.stages))
            self.boundary = next((i for i in after if isinstance(self.stages[i], Stage)), len(self.stages))
            self.plain = [s for s in self.stages[self.source_index + 1 : self.boundary] if s is not passed_through]
            if may_split(self.plain):  # (not for map, to_tuple...: they never split an item)
                self.tracker = PartialTracker(self._source_rereads())
                if self.tracker.rereads:
                    ctx.partial = self.tracker  # (the source keeps what re-reading its raw item needs)
                    saved = self.states.get("partial")
                    if saved:  # (before anything goes past, the state still says where the restore starts)
                        self.tracker.serial, self.tracker.base = -2, tuple(saved)
                else:
                    self.source_ahead = Lookahead(self.source_index + 1, ctx)
        # Plain functions after a later stage: watched where they may split items (see splitwatch).
        self.watches: dict[int, tuple[int, SplitWatch]] = {}
        if self.source_index is not None:
            stages = self.stages

            def far(first: int, end: int) -> bool:
                return any(map(_splits, stages[:first])) and any(map(_holds, stages[end:]))

            runs = plain_runs(stages, self.boundary + 1, _is_stage, _drops_matter, far)
            for first, (end, functions, drops) in runs.items():
                names = [
                    f"stage {first + k} ({_name_of(f)})"
                    for k, f in enumerate(functions)
                    if drops or not at_most_one_per_item(f)
                ]
                around = f"stage {first - 1} ({type(self.stages[first - 1]).__name__})"
                around += f" and stage {end} ({type(self.stages[end]).__name__})" if end < len(self.stages) else ""
                self.watches[first] = (end, SplitWatch(names, drops, around, first, may_split(functions), ctx))
        # Stages that drop items (parallel_filter_map) between a split and a buffer: refused once they drop.
        self.dropping: dict[int, tuple[int, bool]] = {}
        if self.source_index is not None:
            split_at = self.boundary if self.tracker is not None else -1
            self.dropping = dropping_stages(self.stages, _is_stage, _splits, _holds, split_at)

    def _source_rereads(self) -> bool:
        """Whether the source can re-read the raw item it read last: a seek (the tar reader), or a source that
        keeps snapshots anyway because a stage after it holds items (a WebLoader, a nested dataset: a
        snapshot per batch only for this would cost more than the batch's stages)."""
        assert self.source_index is not None
        source = self.stages[self.source_index]
        after = self.stages[self.source_index + 1 :]
        return not source.needs_live_addresses or any(isinstance(s, Stage) and s.holds_items for s in after)

    def resumes_mid_pass(self) -> bool:
        """Whether a state taken inside this pass can seek back there: the pipeline has a source stage
        (the tar reader, a WebLoader), or starts with a stateful stage that restores its own output
        (not a shard list, whose state only replays the epoch from its start)."""
        if self.source_index is not None:
            return True
        first = self.stages[0] if self.stages else None
        return isinstance(first, Stage) and first.epoch_start_state() is None

    def iterator(self) -> Iterator[Any]:
        previous = set_active_context(self.ctx)  # (stages whose call already runs something: see note_plain_run)
        try:
            return self._chain()
        finally:
            set_active_context(previous)

    def _chain(self) -> Iterator[Any]:
        ctx, stages = self.ctx, self.stages
        ctx.stages = stages
        source: Any = None
        ends = {end - 1: watch for end, watch in self.watches.values()}
        for index, stage in enumerate(stages):
            if index == self.boundary and self.tracker is not None:
                source = self._tracked(source)
            if index in self.watches:
                source = self.watches[index][1].pulled(source)
            if isinstance(stage, Stage):
                stage.index = index
                state = self.states.get(str(index))
                if isinstance(stage, SourceStage):
                    ctx.source = stage
                elif self.source_index is not None and index > self.source_index:
                    ctx.rematerializers[index] = self._rematerializer(index)
                source = stage.run(ctx, source, state)
            elif index == 0:
                source = self.pipeline.invoke(stage)
            else:
                source = self.pipeline.invoke(stage, source)
            if index in ends:
                source = ends[index].given(source)
        if self.boundary == len(stages) and self.tracker is not None:
            source = self._tracked(source)  # (counted by the iteration, as items go out)
        return source

    def _tracked(self, items: Iterator[Any]) -> Iterator[Any]:
        """The items out of the plain functions after the source: first, on a restore, the rest of the raw
        item they were part-way through; counted where a stage takes them (the output counts its own)."""
        assert self.tracker is not None and isinstance(self.ctx.source, SourceStage)
        saved = self.states.get("partial")
        if saved and self.tracker.rereads:
            items = chain(rest_of_item(self.ctx, self.ctx.source, self.plain, saved), items)
        if self.boundary < len(self.stages):
            items = counted(self.ctx, items, self.tracker)
        return items if self.source_ahead is None else handed_out(self.source_ahead, items)

    def _rematerializer(self, index: int) -> Callable[[list[Address]], list[Any]]:
        """Re-create the items a stage held: re-read raw items, replay the stateless stages in between."""
        assert self.source_index is not None
        between = self.stages[self.source_index + 1 : index]
        source = self.ctx.source  # (no reference to the pass itself: it would make a cycle through ctx)

        def invoke(stage: Any, stream: Iterator[Any], at: Address) -> Iterator[Any]:
            return stage.replay_at(stream, at) if isinstance(stage, Stage) else invoke_stage(stage, stream)

        def rematerialize(addresses: list[Address]) -> list[Any]:
            assert source is not None
            raws = source.rematerialize([(*address[:-1], 0) for address in addresses])
            items = []
            for raw, address in zip(raws, addresses, strict=False):
                stream: Any = iter([raw])
                for stage in between:
                    stream = invoke(stage, stream, (*address[:-1], 0))
                produced = list(islice(stream, address[-1] + 1))
                if len(produced) <= address[-1]:
                    raise StateMismatchError(f"re-reading item {address} gave nothing: are the stages deterministic?")
                items.append(produced[address[-1]])
            return items

        return rematerialize

    def state(self, peek: bool = True) -> dict[str, Any]:
        """The pass's state; ``peek``: pull ahead where a plain run may be part-way through an item (not when the
        pass ends right after this state, as at a full ``with_epoch`` window: it would never hand the item out;
        nor when the state is refused anyway)."""
        states = self._stage_states()
        # An item a state pulled out of a run is still held: the stages before the run stand where they were
        # before the pull (the upstream-most run's pull last: it came first).
        for ahead in self._held():
            states.update(copy.deepcopy(ahead.state))  # (the state handed out must not share what is held)
        # (read before a pull: a drop while pulling comes after this state, whose restore would drop again)
        refusals = self._drop_refusals()
        if peek and not refusals and not self._split_refusals():
            self._peek(states)
        states.update(refusals)
        states.update(self._split_refusals())
        return states

    def _split_refusals(self) -> dict[str, Any]:
        """Refusals for plain functions seen giving several items for one, where no restore can give the rest."""
        refusals: dict[str, Any] = {}
        tracker = self.tracker
        if tracker is not None and not tracker.rereads and (tracker.split or tracker.count > 1):
            refusals["split"] = self._source_split_refusal()
        split = next((watch for _, watch in self.watches.values() if watch.refused), None)
        if split is not None:
            refusals["split_after"] = unresumable_state(split.refusal())
        return refusals

    def _drop_refusals(self) -> dict[str, Any]:
        """Refusals for items dropped between a split and a buffer, and for stages run as plain functions."""
        refusals: dict[str, Any] = {}
        # (after plain functions that split the source's items only: once they were seen giving several)
        split_seen = self.tracker is not None and (self.tracker.split or self.tracker.count > 1)
        dropped = next(
            (i for i, (_, by_stage) in self.dropping.items() if self.stages[i].dropped and (by_stage or split_seen)),
            None,
        )
        if dropped is not None:
            refusals["dropped"] = unresumable_state(self._drop_refusal(dropped))
        if self.ctx.unsaved:
            refusals["unsaved"] = unresumable_state(
                f"cannot save this pipeline: {', '.join(self.ctx.unsaved)} runs as a plain function inside it "
                "(wds.filters._shuffle(src), stage(src)...), so what it holds is saved nowhere; put the stage "
                "itself in the pipeline (wds.shuffle(...))"
            )
        return refusals

    def _peek(self, states: dict[str, Any]) -> None:
        """A state taken right after the first item out of a plain run for an item (and where the run's next one
        would come from is unknown) pulls that next item (``splitwatch.Lookahead``): one from the same item marks
        the run as splitting (the state is refused), and so does an error before the next item; else the state
        is exact, and the stages before the run keep ``states`` until the item pulled goes out. Costs nothing
        per item: only states taken there pull."""
        tracker, ahead = self.tracker, self.source_ahead
        if tracker is not None and ahead is not None and tracker.count == 1 and not tracker.split:
            serial = tracker.serial
            ahead.seeds = self._seeds_before(ahead.first)
            came = ahead.pull(states_before(states, ahead.first))
            if (came or ahead.raised) and ahead.stamp[1] == serial:
                tracker.split = True  # (a second item of the same raw item, or an error before the next one)
        for first, (_, watch) in sorted(self.watches.items()):
            if watch.unsure():
                watch.ahead.seeds = self._seeds_before(first)
                watch.peek(states_before(states, first))

    def _seeds_before(self, first: int) -> dict[str, Any]:
        """The seeds and live RNGs the stages before index ``first`` have drawn (``DataPipeline``'s record of
        what carries over from one pass to the next)."""
        return {index: seed for index, seed in self.pipeline._drawn_seeds().items() if int(index) < first}

    def _held(self) -> list[Lookahead]:
        """The runs holding an item a state pulled ahead, the upstream-most last (its pull came first)."""
        held = [self.source_ahead] if self.source_ahead is not None and self.source_ahead.held else []
        held += [watch.ahead for _, watch in self.watches.values() if watch.ahead.held]
        return sorted(held, key=lambda ahead: ahead.first, reverse=True)

    def abandon(self) -> None:
        """The pass ends with items a state pulled ahead still held: they never go out. What the stages before
        their run draw on from one pass to the next (a ``shuffle(rng=...)``'s live RNG, a ``RandomMix``'s) goes
        back to where it was before the pull, as if the pull never happened (else the next pass would draw
        otherwise than without that state)."""
        for ahead in self._held():
            self.pipeline.adopt_seeds({"seeds": ahead.seeds})

    def _stage_states(self) -> dict[str, Any]:
        """Each stage's state, the source's and the partial-item tracker's, as they stand."""
        states: dict[str, Any] = {}
        live: list[Address] = []
        for index, stage in enumerate(self.stages):
            if not isinstance(stage, Stage):
                continue
            if self.source_index is not None and index < self.source_index:
                states[str(index)] = stage.epoch_start_state()
            elif isinstance(stage, SourceStage):
                states[str(index)] = None  # saved last (it needs the addresses the stages after it hold), in order
            else:
                states[str(index)] = stage.state_dict()
        if self.source_index is not None:
            source = self.stages[self.source_index]
            if source.needs_live_addresses:
                live = self.ctx.live_addresses()
            states[str(self.source_index)] = source.source_state(live)
        if self.tracker is not None and self.tracker.rereads:
            states["partial"] = self.tracker.next_address()
        return states

    def _drop_refusal(self, index: int) -> str:
        holder = self.dropping[index][0]
        return (
            f"cannot save this pipeline: stage {index} ({type(self.stages[index]).__name__}) dropped an item of a "
            f"split group before stage {holder} ({type(self.stages[holder]).__name__}), which numbers the items it "
            "holds where a restore re-reads them all (and drops again), so it would restore other items; filter "
            "before the split or after the buffering stage"
        )

    def _source_split_refusal(self) -> dict[str, Any]:
        assert self.source_index is not None
        after_source = enumerate(self.stages[self.source_index + 1 : self.boundary], self.source_index + 1)
        names = ", ".join(
            f"stage {i} ({_name_of(s)})"
            for i, s in after_source
            if s is not passed_through and not at_most_one_per_item(s)
        )
        return unresumable_state(
            f"cannot save this pipeline: a plain function after its source ({names}) yields several items "
            "per item, and the source cannot re-read the item it is part-way through, so a restore would "
            "lose the rest of it; make the split a stage: wds.map(to_list) then wds.unlisted()"
        )


class _Iteration:
    """A whole ``iter()`` of a pipeline: its passes (one per epoch) and the ``with_epoch`` window."""

    def __init__(
        self,
        pipeline: DataPipeline,
        info: WorkerInfo,
        first_epoch: int,
        pending: dict[str, Any] | None,
        continued: dict[str, int] | None = None,
    ):
        self.pipeline = pipeline
        self.info = info
        self.first_epoch = first_epoch
        counters = pending or continued
        self.repetition = counters["repetition"] if counters else 0
        self.yielded = counters["yielded"] if counters else 0  # items handed out in this iter() (with_epoch)
        # A continued iteration's first pass may come out empty (all of it consumed) without ending it;
        # a state taken before that pass ends says so ("continued").
        self.may_start_empty = continued is not None or bool(pending and pending.get("continued"))
        self.pass_count = pending["pass_count"] if pending else 0  # items handed out in the current pass
        self.stage_states = pending["stages"] if pending else None
        self.finished = False
        self.current: _Pass | None = None
        self.window_closed = False  # restored right after the last item of a with_epoch window
        # The configuration cannot change during an iteration: describe it once, not at every state_dict().
        self.config = config_text({**pipeline.config(), "worker": list(info)})
        self.fingerprint = _fingerprint(pipeline, info, self.config)
        # Counted by the consumer of the pass's own items (``counted_by``): items it took, and the counters then.
        self._taken: Callable[[], int] | None = None
        self._taken_base = (0, 0)

    @property
    def epoch(self) -> int:
        return self.first_epoch + self.repetition

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self._run()
        finally:  # finished or dropped: leave the state behind for state_dict() calls after the loop
            try:
                self.pipeline._last_state = self.state_dict()
            except Exception:  # a state that cannot be taken now will fail loudly when asked for directly
                self.pipeline._last_state = None
            if self.current is not None:  # (a full with_epoch window, or dropped mid-pass)
                self.current.abandon()

    def _run(self) -> Iterator[Any]:
        pipeline = self.pipeline
        limit = pipeline.nsamples if pipeline.repetitions != 1 and pipeline.nsamples > 0 else None
        if limit is not None and self.yielded >= limit:
            # Saved just after the window's last item: nothing more in this iter(), and the next one starts
            # the epoch after this one, as it would have without the restore.
            pipeline.epoch = self.epoch
            self.window_closed = True
        while self.repetition < pipeline.repetitions and not (limit is not None and self.yielded >= limit):
            current = self._next_pass()
            ctx = self._begin_pass(current)
            window_full = False
            # Plain functions right before the output: count what goes out of the current raw item
            # (``PartialTracker.seen`` written inline: a method call per item is the cost the read path avoids).
            tracker = current.tracker if current.boundary == len(current.stages) else None
            for item in _pulled_as(ctx, current.iterator()):
                self.yielded += 1
                self.pass_count += 1
                if tracker is not None:
                    if ctx.serial != tracker.serial:
                        if tracker.count > 1:
                            tracker.split = True
                        tracker.serial, tracker.base, tracker.count = ctx.serial, ctx.provenance, 1
                    else:
                        tracker.count += 1
                yield item
                if limit is not None and self.yielded >= limit:
                    window_full = True
                    break
            if window_full:
                break
            if self._end_pass():
                break
        self.finished = True

    def _next_pass(self) -> _Pass:
        """The pass that comes next (built, not begun: no stage has run)."""
        self.pipeline.epoch = self.epoch
        ctx = Context(self.epoch, self.info)
        if self.pipeline._skip is not None and self.pipeline._skip[0] == self.epoch:
            ctx.skip = self.pipeline._skip[1]
        return _Pass(self.pipeline, ctx, self.stage_states)

    def _begin_pass(self, current: _Pass) -> Context:
        if self.stage_states is not None and self.pass_count > 0 and not current.resumes_mid_pass():
            raise StateMismatchError(
                f"cannot resume this pipeline {self.pass_count} items into epoch {self.epoch}: it has no "
                "wdsraft source stage (tarfile_to_samples, as in WebDataset) to seek back to where it was, so "
                "it would start the epoch again and deliver those items twice; read shards with "
                "wds.tarfile_to_samples(), or resume from a state taken at an epoch's end"
            )
        self.current = current
        self.stage_states = None
        return current.ctx

    def _window_full(self) -> bool:
        """Whether the ``with_epoch`` window is full: this iteration hands out nothing more."""
        pipeline = self.pipeline
        return pipeline.repetitions != 1 and 0 < pipeline.nsamples <= self.yielded

    def _end_pass(self) -> bool:
        """Count the pass that ended; whether it ends the repetitions too (as webdataset: a pass without
        data does, but not a continued pass whose data was all consumed before)."""
        empty = self.pass_count == 0 and not self.may_start_empty
        if self.current is not None:  # (it ended before the runs gave out what states pulled: a take, say)
            self.current.abandon()
        self.may_start_empty = False
        self.repetition += 1
        self.pass_count = 0
        self.current = None
        return empty

    def counted_by(self, taken: Callable[[], int]) -> Iterator[Any] | None:
        """The items of this (not yet begun) iteration for a consumer that counts what it takes (``taken()``:
        how many items it took from the iterator returned): the pass's own iterator, with no generator of this
        iteration between (a mixture's sources: a microsecond per item less). The counters of the iteration's
        states come from ``taken()`` when a state is taken. None where the iteration must see every item (more
        than one pass, a ``with_epoch`` window, plain functions right before the output): iterate it as usual."""
        if self.pipeline.repetitions != 1 or self.repetition != 0 or self.current is not None or self.finished:
            return None
        current = self._next_pass()
        if current.tracker is not None and current.boundary == len(current.stages):
            return None  # (its count of what goes out of the current raw item runs at every item)
        self._taken, self._taken_base = taken, (self.yielded, self.pass_count)
        return chain.from_iterable(self._counted_parts(current))

    def _counted_parts(self, current: _Pass) -> Iterator[Iterator[Any]]:
        """The parts of ``counted_by``'s items, the pass begun at the first pull (as ``_run`` begins it): until
        then a state holds the loaded stage states, which stages adopt only as they start (a sequence stage's
        held pieces: a mixture restores its sources long before it draws from some of them again)."""
        ctx = self._begin_pass(current)
        items = current.iterator()
        yield chain(_first_pulled(ctx, items), items, self._counted_end())

    def _sync(self) -> None:
        """The counters, from what the consumer of ``counted_by`` took."""
        if self._taken is not None:
            taken = self._taken()
            self.yielded, self.pass_count = self._taken_base[0] + taken, self._taken_base[1] + taken

    def _counted_end(self) -> Iterator[Any]:
        """Run once the pass's items of ``counted_by`` ran out: the end of the iteration, as ``__iter__`` has it."""
        self._sync()
        self._taken = None
        self._end_pass()
        self.finished = True
        try:
            self.pipeline._last_state = self.state_dict()
        except Exception:  # (as __iter__: a state that cannot be taken now fails loudly when asked for)
            self.pipeline._last_state = None
        yield from ()

    def state_dict(self) -> dict[str, Any]:
        pipeline = self.pipeline
        self._sync()
        if self.finished:
            next_epoch = self.epoch + (1 if self.current is not None or self.window_closed else 0)
            return {**pipeline._initial_state(), "epoch": next_epoch, "finished": True}
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "config": self.config,
            "epoch": self.first_epoch,
            "repetition": self.repetition,
            "yielded": self.yielded,
            "continued": self.may_start_empty,
            "pass_count": self.pass_count,
            # Before the first item of a restored pass, the stages still hold the loaded states.
            "stages": self.current.state(not self._window_full())
            if self.current is not None
            else copy.deepcopy(self.stage_states),
            **pipeline.seed_record(),
        }


def _fingerprint(pipeline: DataPipeline, info: WorkerInfo, text: str) -> str:
    """``pipeline.fingerprint(info)``: the hash of ``text``, its configuration described (``core.state.fingerprint``
    hashes that very text), rather than describing it again (a mixture's describes all its sources')."""
    from wdsraft.pipeline.datapipeline import DataPipeline  # (that module imports this one)

    if type(pipeline).fingerprint is not DataPipeline.fingerprint:
        return pipeline.fingerprint(info)
    return text_fingerprint(text)


def counted_items(dataset: Any, taken: Callable[[], int]) -> Iterator[Any]:
    """``iter(dataset)``; for a wdsraft pipeline iterated as ``DataPipeline`` does, its pass's own items
    (``_Iteration.counted_by``), whose states count what ``taken()`` says the caller took."""
    iterator = iter(dataset)
    live = getattr(dataset, "_live", None)
    iteration = live() if isinstance(live, weakref.ref) else None
    if isinstance(iteration, _Iteration) and iteration.pipeline is dataset and _iterates_plainly(type(dataset)):
        return iteration.counted_by(taken) or iterator  # (the generator iter() made, never started, goes)
    return iterator


def _iterates_plainly(kind: Any) -> bool:
    """Whether ``iter()`` of a pipeline of this class is its ``_Iteration`` as it is (no subclass wraps it)."""
    from wdsraft.pipeline.datapipeline import DataPipeline  # (that module imports this one)

    return kind.__iter__ is DataPipeline.__iter__ and kind.iterator is DataPipeline.iterator


def _first_pulled(ctx: Context, items: Iterator[Any]) -> Iterator[Any]:
    """The first of ``items``, pulled with ``ctx`` the active pass (as ``_pulled_as`` does), and no more."""
    previous = set_active_context(ctx)
    try:
        first = next(items, _NOTHING)
    finally:
        set_active_context(previous)
    if first is not _NOTHING:
        yield first


def _pulled_as(ctx: Context, items: Iterator[Any]) -> Iterator[Any]:
    """``items``, with ``ctx`` the active pass on this thread while the first is pulled: stages that run as
    plain functions (``wds.filters._shuffle``) start then, and report themselves to it. (Only the first:
    setting it around every item cost about a microsecond per item.)"""
    return chain(_first_pulled(ctx, items), items)


_NOTHING = object()


def _is_stage(stage: Any) -> bool:
    return isinstance(stage, Stage) or stage is passed_through


def _splits(stage: Any) -> bool:
    return isinstance(stage, _Splitter)


def _holds(stage: Any) -> bool:
    return isinstance(stage, Stage) and stage.holds_items


def _drops_matter(before: Any, after: Any) -> bool:
    """A stage that splits items (unbatched, unlisted) then one that holds them: the holder numbers the items of
    a split group it receives, a restore re-reads the whole group, so a function between them must not drop any."""
    return isinstance(before, _Splitter) and isinstance(after, Stage) and after.holds_items


def _name_of(function: Any) -> str:
    """A plain function's name for a message (a webdataset filter by its generator's: ``_select``)."""
    return (
        getattr(function, "__name__", None)
        or getattr(getattr(function, "f", None), "__name__", None)
        or type(function).__name__
    )
