"""Checkpointable pipelines: webdataset's ``DataPipeline`` whose stages can save and restore what they hold.

A pipeline is a list of stages, as in webdataset: a source, then callables that take an
iterator and return one. Stages that hold nothing between two items (``map``,
``decode``, ``to_tuple``...) are webdataset's own. Stages that hold something subclass
:class:`Stage`: the tar reader (shard, next byte offset), ``shuffle`` (RNG + buffer),
``batched`` (partial batch), ``slice`` (count)...

**State.** ``state_dict()`` returns the state of the current iteration as plain data;
``load_state_dict(state)`` makes the *next* ``iter()`` resume exactly there (the protocol
torchdata's ``StatefulDataLoader`` uses for ``IterableDataset``s).

**Items are saved as addresses.** A stage that buffers items saves where they came from,
not their bytes: the *source* of the pipeline (the tar reader, or the DataLoader under a
``WebLoader``) stamps each raw item with an address on the shared :class:`Context`; a
buffering stage records the address of each item it takes in. On restore, the pipeline
re-reads the raw items at those addresses (a byte seek into the shard) and passes them
through the stateless stages that lie between the source and the buffering stage.
Those stages must therefore be deterministic functions of their input.

**Upstream of the source** (shard lists, node/worker splitting, shard shuffling) stages
are deterministic functions of (seed, epoch, rank, worker): on restore they are replayed
from the start of the epoch and the source skips the shards it had already begun.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from itertools import islice
from operator import itemgetter
from typing import Any

from torch.utils.data import DataLoader, IterableDataset
from webdataset.utils import PipelineStage

from wdsraft.core.distributed import WorkerInfo, worker_info
from wdsraft.core.errors import StateMismatchError
from wdsraft.core.state import STATE_FORMAT, STATE_VERSION, describe, differences, fingerprint

logger = logging.getLogger(__name__)

Address = tuple  # (source-specific fields..., sub-index)


def pack_addresses(addresses: list[Address]) -> dict[str, Any]:
    """Addresses as a compact plain-data record, column by column: string fields (shard URLs)
    become indexes into a table of the distinct strings, int fields stay lists of ints (about
    10 bytes per address in msgpack). Built with C-level transposes and maps: a few tenths of a
    millisecond for 10,000 addresses, so a state can be taken every step."""
    if not addresses:
        return {"width": 0, "strings": [], "string_fields": [], "columns": []}
    # One C-level pass per field (not zip(*addresses), whose per-row iterators wake the cycle
    # collector, which then walks every buffered sample).
    columns = [list(map(itemgetter(i), addresses)) for i in range(len(addresses[0]))]
    string_fields = [i for i, field in enumerate(addresses[0]) if isinstance(field, str)]
    strings: list[str] = []
    packed: list[list[Any]] = []
    for i, column in enumerate(columns):
        if i in string_fields:
            table = dict.fromkeys(column)
            base = len(strings)
            strings.extend(table)
            lookup = {value: base + n for n, value in enumerate(table)}
            packed.append(list(map(lookup.__getitem__, column)))
        else:
            packed.append(column)
    return {"width": len(columns), "strings": strings, "string_fields": string_fields, "columns": packed}


def unpack_addresses(record: dict[str, Any]) -> list[Address]:
    if record["width"] == 0:
        return []
    strings, string_fields = record["strings"], set(record["string_fields"])
    columns = [
        [strings[i] for i in column] if position in string_fields else column
        for position, column in enumerate(record["columns"])
    ]
    return list(zip(*columns, strict=True))


class Context:
    """What the stages of one pipeline iteration share.

    ``provenance`` is the address of the raw item the source handed out last (with a
    sub-index of 0); ``serial`` changes with every raw item, so a stage that receives
    several items from one raw item (after ``unbatched``, say) can number them.
    """

    def __init__(self, epoch: int, info: WorkerInfo):
        self.epoch = epoch
        self.info = info
        self.provenance: Address | None = None
        self.serial = 0
        self.source: SourceStage | None = None
        self.rematerializers: dict[int, Callable[[list[Address]], list[Any]]] = {}
        self.stages: list[Any] = []
        #: A ledger's consumed set for this epoch (elastic resume): the source skips these positions.
        self.skip: Any = None

    def stamp(self, address: Address) -> None:
        self.provenance = address
        self.serial += 1

    def live_addresses(self) -> list[Address]:
        """Addresses of every item the stages after the source hold right now."""
        return [
            address
            for stage in self.stages
            if isinstance(stage, Stage) and not isinstance(stage, SourceStage)
            for address in stage.addresses()
        ]


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

    #: Index of this stage in its pipeline (set by the pipeline at the start of an iteration).
    index = -1

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
        return self.run(Context(0, worker_info()), src, None)


class SourceStage(Stage):
    """A stage that produces raw items with addresses and can re-read items by address."""

    #: Whether ``source_state`` needs the addresses downstream stages hold (costly to gather every step).
    needs_live_addresses = False

    def rematerialize(self, addresses: list[Address]) -> list[Any]:
        raise NotImplementedError

    def source_state(self, live_addresses: list[Address]) -> dict[str, Any]:
        """The state, given the addresses that buffering stages downstream still hold."""
        return self.state_dict()


class DataPipeline(IterableDataset, PipelineStage):
    """webdataset's ``DataPipeline`` with ``state_dict()``/``load_state_dict()`` and ``set_epoch()``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()
        self.pipeline: list[Any] = []
        self.length = -1
        self.repetitions = 1
        self.nsamples = -1
        self.epoch = -1  # the epoch of the current (or last) iteration; set_epoch() sets the next one
        self._next_epoch: int | None = None
        self._continued: dict[str, int] | None = None
        self._pending: dict[str, Any] | None = None
        self._skip: tuple[int, Any] | None = None  # (epoch, consumed set) from a ledger
        # The iteration in progress, weakly: a strong reference would make a cycle through its generator,
        # and a DataLoader freed by the cycle collector rather than promptly stalls seconds in shutdown.
        self._live: weakref.ref[_Iteration] | None = None
        self._last_state: dict[str, Any] | None = None  # the state an iteration left when it ended
        for arg in args:
            if arg is None:
                continue
            if isinstance(arg, list):
                self.pipeline.extend(arg)
            else:
                self.pipeline.append(arg)

    # -- webdataset's API ------------------------------------------------------------------

    def close(self) -> None:
        for step in self.pipeline:
            if hasattr(step, "close"):
                step.close()
        del self.pipeline

    def invoke(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        return invoke_stage(f, *args, **kwargs)

    def stage(self, i: int) -> Any:
        return self.pipeline[i]

    def append(self, f: Any) -> None:
        self.pipeline.append(f)

    def compose(self, *args: Any) -> DataPipeline:
        result = copy.copy(self)
        result.pipeline = copy.copy(result.pipeline)
        for arg in args:
            result.append(arg)
        return result

    def with_length(self, n: int, silent: bool = False) -> DataPipeline:
        if not silent:
            warnings.warn(
                ".with_length() only sets the value of __len__ for compatibility with some training "
                "environments. It does not change the number of samples in an epoch.",
                stacklevel=2,
            )
        self.size = n
        return _add_length_method(self)

    def with_epoch(self, nsamples: int = -1, nbatches: int = -1) -> DataPipeline:
        self.repetitions = sys.maxsize
        self.nsamples = max(nsamples, nbatches)
        return self

    def repeat(self, nepochs: int = -1, nbatches: int = -1) -> DataPipeline:
        if nepochs > 0:
            self.repetitions = nepochs
            self.nsamples = nbatches
        else:
            self.repetitions = sys.maxsize
            self.nsamples = nbatches
        return self

    # -- epochs ----------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run epoch ``epoch`` (shard order and shuffles depend on it).

        Without it, each pass (each ``iter()``, each repetition) advances the epoch by one,
        counted by this object; in non-persistent DataLoader workers that counter restarts
        with every epoch, so call ``set_epoch`` as you would on a DistributedSampler.
        """
        self._next_epoch = epoch

    def continue_iteration(self, state: dict[str, Any]) -> None:
        """Make the next iteration go on with the ``repeat``/``with_epoch`` counters of a state taken
        mid-iteration (even under another configuration), on fresh stages: a ledger's elastic resume,
        where the epochs still count as they did. Its first pass may come out empty (everything in it
        consumed) without ending the repetitions. A finished state has nothing to continue."""
        if state.get("finished") or not isinstance(state.get("repetition"), int):
            return
        self._continued = {key: int(state.get(key, 0)) for key in ("epoch", "repetition", "yielded")}

    def skip_consumed(self, consumed: Any, epoch: int) -> None:
        """Skip the positions a ledger says were consumed in ``epoch`` (an elastic resume): before any
        shuffling, through the shard index, without reading them."""
        self._skip = (epoch, consumed)

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        info = worker_info()
        if pending is not None:
            self._check(pending, info)
            first_epoch = pending["epoch"]
            if pending.get("finished"):
                self.epoch = first_epoch - 1
                if in_dataloader_worker():
                    # Saved at the very end of the worker's epoch: it must report exhaustion now, as
                    # StatefulDataLoader expects; the next iter() starts the following epoch.
                    done = _Iteration(self, info, first_epoch, None)
                    done.finished = True
                    self._live = None
                    self._last_state = done.state_dict()
                    return iter(())
                pending = None  # in the training process, as StatefulDataLoader: the next epoch begins
        else:
            first_epoch = self._next_epoch if self._next_epoch is not None else self.epoch + 1
        self._next_epoch = None
        continued, self._continued = self._continued, None
        if pending is None and continued is not None:
            first_epoch = continued["epoch"]
        iteration = _Iteration(self, info, first_epoch, pending, continued)
        self._live = weakref.ref(iteration)
        # An iterator dropped before it ran leaves the loaded state in force.
        self._last_state = copy.deepcopy(pending) if pending is not None else None
        return iter(iteration)

    def __getstate__(self) -> dict[str, Any]:
        # A copy (a spawned DataLoader worker's, say) has no iteration in progress: the weak reference to
        # this process's would not pickle.
        return {**self.__dict__, "_live": None}

    def iterator1(self) -> Iterator[Any]:
        """One pass over the stages (webdataset's name), without repetition or state."""
        ctx = Context(self.epoch if self.epoch >= 0 else 0, worker_info())
        return _Pass(self, ctx, None).iterator()

    # -- state -----------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        stages = []
        for stage in self.pipeline:
            if isinstance(stage, Stage):
                stages.append({"stage": type(stage).__name__, **stage.config()})
            else:
                stages.append(describe(stage))  # a curried webdataset stage: its function and arguments
        return {"stages": stages, "repetitions": self.repetitions, "nsamples": self.nsamples}

    def fingerprint(self, info: WorkerInfo | None = None) -> str:
        return fingerprint({**self.config(), "worker": list(info or worker_info())})

    def state_dict(self) -> dict[str, Any]:
        """The state of the current iteration (a fresh plain-data dict): loading it resumes right after
        the last item this pipeline handed out."""
        live = self._live() if self._live is not None else None
        if live is not None:
            return live.state_dict()
        if self._pending is not None:
            return copy.deepcopy(self._pending)
        if self._last_state is not None:
            return copy.deepcopy(self._last_state)
        return self._initial_state()

    def matches(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` was saved by this configuration (exact resume is possible)."""
        return isinstance(state, dict) and state.get("fingerprint") == self.fingerprint(worker_info())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state`` at the next ``iter()``; fails loudly if the configuration changed."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise StateMismatchError("not a wdsraft pipeline state")
        if state.get("version") != STATE_VERSION:
            raise StateMismatchError(f"unsupported state version {state.get('version')!r}")
        self.adopt_seeds(state)
        self._pending = copy.deepcopy(state)
        self._live = None
        self._last_state = None

    def seed_record(self) -> dict[str, Any]:
        """The seeds this pipeline drew itself (no seed given): what a copy needs to draw the same."""
        return {"seeds": self._drawn_seeds()}

    def adopt_seeds(self, record: dict[str, Any]) -> None:
        """Take over the seeds another copy of this pipeline drew (from its state or seed record)."""
        for index, seed in (record.get("seeds") or {}).items():
            stage = self.pipeline[int(index)] if int(index) < len(self.pipeline) else None
            if isinstance(stage, Stage):
                stage.adopt_seed(seed)

    def _drawn_seeds(self) -> dict[str, Any]:
        return {
            str(index): stage.drawn_seed()
            for index, stage in enumerate(self.pipeline)
            if isinstance(stage, Stage) and stage.drawn_seed() is not None
        }

    def _initial_state(self) -> dict[str, Any]:
        info = worker_info()
        epoch = self._next_epoch if self._next_epoch is not None else self.epoch + 1
        # Before the first item of an iteration that continues another's counters: those counters.
        counters = self._continued or {"epoch": epoch, "repetition": 0, "yielded": 0}
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint(info),
            "config": config_text({**self.config(), "worker": list(info)}),
            **counters,
            "continued": self._continued is not None,
            "pass_count": 0,
            "stages": None,
            **self.seed_record(),
        }

    def _check(self, state: dict[str, Any], info: WorkerInfo) -> None:
        expected = self.fingerprint(info)
        if state.get("fingerprint") != expected:
            saved = state.get("config", {})
            saved = json.loads(saved) if isinstance(saved, str) else saved  # (a dict in states of earlier versions)
            changed = differences(saved, describe({**self.config(), "worker": list(info)}))
            detail = "; ".join(changed[:6]) or "configuration differs"
            raise StateMismatchError(
                f"this state was saved by a different pipeline configuration ({detail}). Exact resume needs the "
                "same shards, seeds, stages, rank/world size and worker count; to continue with a changed "
                "configuration, resume through the ledger instead."
            )


def state_epoch(state: Any) -> int | None:
    """The epoch a pipeline state was taken in (the one it finished, for a state taken at the end of
    an iteration), or None for what is not such a state."""
    epoch = state.get("epoch") if isinstance(state, dict) else None
    if not isinstance(epoch, int) or epoch < 0:
        return None
    if state.get("finished"):  # (a finished state names the epoch after it)
        return max(epoch - 1, 0)
    return epoch + int(state.get("repetition", 0))


def config_text(config: dict[str, Any]) -> str:
    """The configuration a state was saved with, for the message when it does not match: one JSON
    string, so that taking a state (every few steps, in every worker) does not copy a tree."""
    return json.dumps(describe(config), sort_keys=True, separators=(",", ":"))


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


def _add_length_method(obj: Any) -> Any:
    def length(self: Any) -> int:
        return self.size

    combined = type(obj.__class__.__name__ + "_Length", (obj.__class__, IterableDataset), {"__len__": length})
    obj.__class__ = combined
    return obj


class _Pass:
    """One pass over a pipeline's stages: builds the chain of iterators, restoring stages if asked."""

    def __init__(self, pipeline: DataPipeline, ctx: Context, states: dict[str, Any] | None):
        self.pipeline = pipeline
        self.ctx = ctx
        self.states = states or {}
        self.stages = pipeline.pipeline
        self.source_index = next((i for i, s in enumerate(self.stages) if isinstance(s, SourceStage)), None)

    def iterator(self) -> Iterator[Any]:
        ctx, stages = self.ctx, self.stages
        ctx.stages = stages
        source: Any = None
        for index, stage in enumerate(stages):
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
        return source

    def _rematerializer(self, index: int) -> Callable[[list[Address]], list[Any]]:
        """Re-create the items a stage held: re-read raw items, replay the stateless stages in between."""
        assert self.source_index is not None
        between = self.stages[self.source_index + 1 : index]
        source = self.ctx.source  # (no reference to the pass itself: it would make a cycle through ctx)

        def invoke(stage: Any, stream: Iterator[Any]) -> Iterator[Any]:
            return stage.replay(stream) if isinstance(stage, Stage) else invoke_stage(stage, stream)

        def rematerialize(addresses: list[Address]) -> list[Any]:
            assert source is not None
            raws = source.rematerialize([(*address[:-1], 0) for address in addresses])
            items = []
            for raw, address in zip(raws, addresses, strict=False):
                stream: Any = iter([raw])
                for stage in between:
                    stream = invoke(stage, stream)
                produced = list(islice(stream, address[-1] + 1))
                if len(produced) <= address[-1]:
                    raise StateMismatchError(f"re-reading item {address} gave nothing: are the stages deterministic?")
                items.append(produced[address[-1]])
            return items

        return rematerialize

    def state(self) -> dict[str, Any]:
        states: dict[str, Any] = {}
        live: list[Address] = []
        for index, stage in enumerate(self.stages):
            if not isinstance(stage, Stage):
                continue
            if self.source_index is not None and index < self.source_index:
                states[str(index)] = stage.epoch_start_state()
            elif isinstance(stage, SourceStage):
                continue  # saved last: it needs the addresses the stages after it hold
            else:
                states[str(index)] = stage.state_dict()
        if self.source_index is not None:
            source = self.stages[self.source_index]
            if source.needs_live_addresses:
                live = self.ctx.live_addresses()
            states[str(self.source_index)] = source.source_state(live)
        return states


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
        self.fingerprint = pipeline.fingerprint(info)

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

    def _run(self) -> Iterator[Any]:
        pipeline = self.pipeline
        limit = pipeline.nsamples if pipeline.repetitions != 1 and pipeline.nsamples > 0 else None
        if limit is not None and self.yielded >= limit:
            # Saved just after the window's last item: nothing more in this iter(), and the next one starts
            # the epoch after this one, as it would have without the restore.
            pipeline.epoch = self.epoch
            self.window_closed = True
        while self.repetition < pipeline.repetitions and not (limit is not None and self.yielded >= limit):
            pipeline.epoch = self.epoch
            ctx = Context(self.epoch, self.info)
            if pipeline._skip is not None and pipeline._skip[0] == self.epoch:
                ctx.skip = pipeline._skip[1]
            self.current = _Pass(pipeline, ctx, self.stage_states)
            self.stage_states = None
            window_full = False
            for item in self.current.iterator():
                self.yielded += 1
                self.pass_count += 1
                yield item
                if limit is not None and self.yielded >= limit:
                    window_full = True
                    break
            if window_full:
                break
            # As webdataset: a pass without data ends the repetitions (but not a continued pass whose data
            # was all consumed before).
            empty = self.pass_count == 0 and not self.may_start_empty
            self.may_start_empty = False
            self.repetition += 1
            self.pass_count = 0
            self.current = None
            if empty:
                break
        self.finished = True

    def state_dict(self) -> dict[str, Any]:
        pipeline = self.pipeline
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
            "stages": self.current.state() if self.current is not None else copy.deepcopy(self.stage_states),
            **pipeline.seed_record(),
        }
