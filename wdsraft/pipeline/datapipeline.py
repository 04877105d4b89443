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
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset
from webdataset.utils import PipelineStage

from wdsraft.core.distributed import WorkerInfo, worker_info
from wdsraft.core.errors import StateMismatchError
from wdsraft.core.state import STATE_FORMAT, STATE_VERSION, config_text, describe, differences, fingerprint
from wdsraft.pipeline.nested import is_stateful_dataset
from wdsraft.pipeline.passes import _Iteration, _Pass
from wdsraft.pipeline.stage import (
    Context,
    Stage,
    find_unresumable,
    in_dataloader_worker,
    invoke_stage,
    states_must_be_whole,
)

logger = logging.getLogger(__name__)


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
        return add_length_method(self)

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
        return self.iterator()

    def iterator(self) -> Iterator[Any]:
        """The iterator over the pipeline (webdataset's name, which its ``__iter__`` calls and subclasses
        call or override): the repetitions of ``repeat``/``with_epoch`` and the ``with_epoch`` window, and the
        state ``state_dict`` takes. webdataset leaves the window to ``__iter__``; here ``iterator()`` is
        exactly what ``iter()`` gives, so a subclass whose ``__iter__`` calls it gets the same stream."""
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
            elif is_stateful_dataset(stage) and callable(getattr(stage, "config", None)):
                stages.append({"dataset": stage.config()})  # (a pipeline or a mix as the source)
            else:
                stages.append(describe(stage))  # a curried webdataset stage: its function and arguments
        return {"stages": stages, "repetitions": self.repetitions, "nsamples": self.nsamples}

    def fingerprint(self, info: WorkerInfo | None = None) -> str:
        return fingerprint({**self.config(), "worker": list(info or worker_info())})

    def state_dict(self) -> dict[str, Any]:
        """The state of the current iteration (a fresh plain-data dict): loading it resumes right after
        the last item this pipeline handed out.

        A stage that cannot save what it holds raises ``StateMismatchError`` here, naming itself, when you
        ask; a DataLoader taking states on its own (worker snapshots) gets a state marked unresumable
        instead, so training that never resumes goes on, and loading that state raises."""
        state = self._state()
        if states_must_be_whole():
            reason = find_unresumable(state)
            if reason is not None:
                raise StateMismatchError(reason)
        return state

    def _state(self) -> dict[str, Any]:
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
        reason = find_unresumable(state)
        if reason is not None:
            raise StateMismatchError(f"this state cannot be resumed: {reason}")
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
            elif stage is not None and callable(getattr(stage, "adopt_seeds", None)):
                stage.adopt_seeds(seed)  # (a pipeline or a mix as the source)

    def _drawn_seeds(self) -> dict[str, Any]:
        seeds = {}
        for index, stage in enumerate(self.pipeline):
            if isinstance(stage, Stage):
                seed = stage.drawn_seed()
            elif is_stateful_dataset(stage) and callable(getattr(stage, "seed_record", None)):
                seed = stage.seed_record()
            else:
                continue
            if seed is not None:
                seeds[str(index)] = seed
        return seeds

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


def add_length_method(obj: Any) -> Any:
    def length(self: Any) -> int:
        return self.size

    combined = type(obj.__class__.__name__ + "_Length", (obj.__class__, IterableDataset), {"__len__": length})
    obj.__class__ = combined
    return obj
