"""A ``StatefulDataLoader`` as a pipeline source (``WebLoader``'s first stage), and the conversion of
batches the dataset already formed, with a hook for formats that cross from workers in a compact form.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, default_convert, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader import stateful_dataloader as torchdata_loader

from wdsraft.core.state import describe
from wdsraft.pipeline.addresses import Address
from wdsraft.pipeline.stage import Context, SourceStage, Stage, quiet_states

logger = logging.getLogger(__name__)


class _SnapshotFlags:
    """An index queue of a DataLoader worker that asks the worker for its state only with the batches
    that can be its last one before a snapshot step.

    torchdata asks for the state with every batch requested within ``num_workers * (prefetch_factor +
    1) + 1`` steps before a snapshot step, because a worker that runs out of data shifts the steps at
    which the batches requested after it are handed out. Without such a shift, request ``i`` is handed
    out ``i - rcvd_idx`` steps after the next one, so only the requests that land in the last
    ``num_workers`` steps before a snapshot step are flagged. A shift that makes a
    worker's last batch before a snapshot step one without a state is caught there, and that snapshot
    is skipped (``_CheapSnapshotIter._take_snapshot``): never a wrong state, at worst a longer re-run.
    """

    def __init__(self, queue: Any, iterator: _CheapSnapshotIter):
        self.queue = queue
        # (weak: an iterator dropped mid-epoch must still be freed at once, which shuts its workers down)
        self.iterator = weakref.ref(iterator)

    def put(self, item: Any, *args: Any, **kw: Any) -> None:
        if type(item) is tuple and len(item) == 2 and type(item[1]) is tuple and len(item[1]) == 2:
            idx, (index, snapshot) = item
            iterator = self.iterator()
            if snapshot and iterator is not None and not iterator.wants_state(idx):
                item = (idx, (index, False))
        self.queue.put(item, *args, **kw)

    def __getattr__(self, name: str) -> Any:  # (close, cancel_join_thread...: the queue's own)
        return getattr(self.queue, name)


class _CheapSnapshotIter(torchdata_loader._StatefulMultiProcessingDataLoaderIter):
    """torchdata's multi-worker iterator, with worker states shipped only around snapshot steps
    (``_SnapshotFlags``) and a snapshot skipped unless every worker's latest state is from the last
    batch it handed out (or from its end)."""

    _index_queues: list[Any]

    def _reset(self, loader: Any, first_iter: bool = False, prime_prefetch: bool = True) -> None:
        if not all(isinstance(queue, _SnapshotFlags) for queue in self._index_queues):
            self._index_queues = [_SnapshotFlags(queue, self) for queue in self._index_queues]
        self._state_current: dict[Any, bool] = {}  # worker key -> its state is from its last batch
        self._handing_out = False
        super()._reset(loader, first_iter, prime_prefetch)

    def wants_state(self, idx: int) -> bool:
        # The step request ``idx`` is handed out at, counted from 0, if no worker ends before then; the batch
        # at ``rcvd_idx - 1`` is being handed out at step ``_num_yielded`` while ``_process_data`` runs.
        step = idx - self._rcvd_idx + self._num_yielded + self._handing_out
        # Each worker's last batch before the snapshot taken after step s is among the last ``workers``
        # steps before it; ``(-s - 1) % interval`` is how many steps before it step s is.
        return (-step - 1) % self._snapshot_interval < self._num_workers

    def _update_worker_snapshot(self, worker_key: Any, state_dict: Any) -> None:
        self._state_current[worker_key] = True
        super()._update_worker_snapshot(worker_key, state_dict)

    def _process_data(self, data: Any, worker_id: int, state_dict: Any) -> Any:
        self._state_current[self._worker_key(worker_id)] = False  # (set again if a state came with it)
        self._handing_out = True  # (it requests the next batch first)
        try:
            return super()._process_data(data, worker_id, state_dict)
        finally:
            self._handing_out = False

    def _take_snapshot(self) -> None:
        if all(self._state_current.values()):
            super()._take_snapshot()
        else:
            logger.debug(
                "snapshot at step %d skipped: a worker's state is older than its last batch", self._num_yielded
            )


#: The torchdata methods ``_CheapSnapshotIter`` hooks into (torchdata 0.10-0.11). Where one is missing, a hook
#: would silently not run, so the loader keeps torchdata's own iterator.
_HOOKED = ("_reset", "_process_data", "_take_snapshot", "_update_worker_snapshot", "_try_put_index")
_HOOKS_FOUND = all(
    callable(getattr(torchdata_loader._StatefulMultiProcessingDataLoaderIter, name, None)) for name in _HOOKED
)


class CheapSnapshotLoader(StatefulDataLoader):
    """``StatefulDataLoader`` whose workers over an ``IterableDataset`` ship their state with a few
    batches around each snapshot step only, not with every batch within ``num_workers *
    (prefetch_factor + 1) + 1`` steps before one. That makes a short snapshot interval cheap, and a
    short interval bounds the re-run after restoring a state taken between two snapshots."""

    next_iter_state: Any

    def _get_iterator(self) -> Any:
        if self.num_workers > 0:
            _import_before_workers_start()
        if self.num_workers == 0 or not isinstance(self.dataset, IterableDataset) or not self.in_order:
            return super()._get_iterator()
        if not _HOOKS_FOUND:
            logger.warning("this torchdata lacks one of %s: worker states ship as torchdata decides", _HOOKED)
            return super()._get_iterator()
        self.check_worker_number_rationality()
        iterator = _CheapSnapshotIter(self, self.next_iter_state)
        self.next_iter_state = None
        return iterator


def _import_before_workers_start() -> None:
    """Import in the training process what every DataLoader worker imports as it starts, so that forked
    workers find it imported: the worker loop seeds ``numpy.random``, which numpy imports on first use
    (about 8 ms of CPU in each worker, every epoch unless the workers persist). Once per process."""
    import numpy.random  # noqa: F401


class LoaderSource(SourceStage):
    """A ``StatefulDataLoader`` as the source of a pipeline in the training process.

    Its items (batches) are addressed by their number in the epoch. To save items that
    stages after it hold (an ``unbatched().shuffle(n)`` buffer), it saves the loader's state
    from just before the oldest batch they came from, plus how many batches to re-fetch:
    a restore rolls the loader back that far and re-reads them (bounded by the buffer, not
    by how far into the epoch the checkpoint is).
    """

    needs_live_addresses = True

    def __init__(self, loader: StatefulDataLoader):
        self.loader = loader
        self._snapshots: dict[int, dict[str, Any]] = {}
        self._replayed: dict[int, Any] = {}
        self._fetched = 0

    def config(self) -> dict[str, Any]:
        loader = self.loader
        dataset_config = getattr(loader.dataset, "config", None)
        return {
            "dataset": describe(dataset_config() if callable(dataset_config) else type(loader.dataset)),
            "batch_size": loader.batch_size,
            "num_workers": loader.num_workers,
            "drop_last": loader.drop_last,
        }

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        self._snapshots = {}
        self._replayed = {}
        self._fetched = 0
        if state is not None and state["replay"] == 0 and state["loader"].get("_iterator_finished"):
            # Saved after the loader's last batch of the epoch, with nothing to re-fetch: this pass gets
            # nothing more from it. Loading that state would start persistent workers on their next
            # epoch now, and the next pass would start them once more (one epoch skipped).
            return iter(())
        if state is not None:
            self.loader.load_state_dict(state["loader"])
            self._fetched = state["base"]
        else:
            # Workers get a copy of the dataset for each epoch: hand them this epoch, or every epoch would
            # shuffle like the first (webdataset's non-persistent worker problem). Persistent workers get
            # their copy once, at the first epoch this loader runs (which after a restore between two
            # epochs is not epoch 0), and count the later epochs themselves.
            set_epoch = getattr(self.loader.dataset, "set_epoch", None)
            workers_alive = self.loader.persistent_workers and self.loader._iterator is not None
            if set_epoch is not None and not workers_alive:
                set_epoch(ctx.epoch)
        iterator = iter(self.loader)
        # Re-fetch now the batches whose items the restored stages downstream hold: they ask for them
        # before they pull anything from this stage.
        for _ in range(state["replay"] if state is not None else 0):
            self._snapshots[self._fetched] = self._loader_state()
            with quiet_states():
                self._replayed[self._fetched] = next(iterator)
            self._fetched += 1
        return self._batches(ctx, iterator)

    def _batches(self, ctx: Context, iterator: Iterator[Any]) -> Iterator[Any]:
        # Snapshots of the loader are only needed to re-read batches that stages after this one hold;
        # without such stages, skip them (each costs a state_dict() of the loader and its dataset).
        keep = any(isinstance(stage, Stage) and stage.holds_items for stage in ctx.stages[self.index + 1 :])
        while True:
            if keep:
                self._snapshots[self._fetched] = self._loader_state()
            try:
                with quiet_states():  # (the loader's own snapshots of its dataset's state)
                    batch = next(iterator)
            except StopIteration:
                self._snapshots.pop(self._fetched, None)
                return
            serial = self._fetched
            self._fetched += 1
            ctx.stamp((serial, 0))
            yield batch
            if len(self._snapshots) > 64:
                self._prune(ctx)

    def _prune(self, ctx: Context) -> None:
        live = [address[0] for address in ctx.live_addresses()]
        oldest = min(live) if live else self._fetched
        for serial in [s for s in self._snapshots if s < oldest]:
            del self._snapshots[serial]
            self._replayed.pop(serial, None)

    def source_state(self, live_addresses: list[Address]) -> dict[str, Any]:
        oldest = min((address[0] for address in live_addresses), default=self._fetched)
        snapshot = self._snapshots.get(oldest)
        if snapshot is None:  # nothing held: the loader's state now
            snapshot, oldest = self._loader_state(), self._fetched
        return {"loader": snapshot, "base": oldest, "replay": self._fetched - oldest}

    def rematerialize(self, addresses: list[Address]) -> list[Any]:
        return [self._replayed[address[0]] for address in addresses]

    def _loader_state(self) -> dict[str, Any]:
        # What cannot be restored is marked, not raised, here: the pipeline that holds this loader raises
        # when the user asks for its state.
        with quiet_states():
            return self.loader.state_dict()


#: In a DataLoader worker, a function ``(batch, dataset) -> object | None`` that may give a batch a
#: compact form for the crossing to the training process (unpickling there rebuilds the batch).
BatchTransport = Callable[[Any, Any], Any]

_batch_transports: list[BatchTransport] = []


def register_batch_transport(transport: BatchTransport) -> None:
    """Let batches of some kind cross from DataLoader workers in a compact form of their own."""
    if transport not in _batch_transports:
        _batch_transports.append(transport)


def convert_batch(batch: Any) -> Any:
    """``DataLoader``'s conversion of a batch the dataset already formed (``batch_size=None``),
    without walking metadata fields (``__key__``, ``__provenance__``...): they hold no arrays,
    and walking an LLM batch's provenance lists cost more than building the batch. In a worker,
    a registered transport may pack the batch for the crossing (``wdsraft.llm`` does, for token
    sequences)."""
    info = get_worker_info()
    if info is not None:
        for transport in _batch_transports:
            compact = transport(batch, info.dataset)
            if compact is not None:
                return compact
    if type(batch) is dict:
        return {k: v if isinstance(k, str) and k.startswith("__") else _convert(v) for k, v in batch.items()}
    return _convert(batch)


#: Types ``default_convert`` hands back as they are (no numpy type, no container it walks).
_LEAVES = frozenset({str, bytes, int, float, bool, complex, type(None)})
_DICTS = {dict}


def _convert(data: Any) -> Any:
    """``default_convert(data)``, the same value, with plain lists and dicts of plain leaves (a batch's
    texts, its decoded JSON) copied in C: ``default_convert`` walks them item by item (about 0.2 µs an
    item through its type checks, 2 µs a sample here). Anything else goes to ``default_convert``."""
    kind = type(data)
    if kind in _LEAVES:
        return data
    if kind is list:
        kinds = set(map(type, data))
        if kinds <= _LEAVES:
            return data.copy()  # (default_convert copies a list, then converts each item in place)
        if kinds == _DICTS:  # (a column of decoded JSON objects: each copied here, without a call)
            return [d.copy() if _LEAVES.issuperset(map(type, d.values())) else _convert(d) for d in data]
        return [_convert(item) for item in data]
    if kind is dict:
        if _LEAVES.issuperset(map(type, data.values())):
            return data.copy()
        return {key: _convert(value) for key, value in data.items()}
    return default_convert(data)


class DieWithParent:
    """A DataLoader ``worker_init_fn`` that makes the worker die with the training process, then calls
    the user's own.

    A rank killed by SIGKILL (the OOM killer, a node agent, ``kill -9``) cannot stop its workers, and
    a worker blocked writing its result pipe, whose read end a sibling still holds, lives on for ever
    with its share of memory (DataLoader's own watchdog only looks between batches). A daemon thread
    in the worker watches its parent instead and ends the worker once the parent is gone. It is tied
    to the process, not to the thread that started the worker (``PR_SET_PDEATHSIG`` is, and killed
    persistent workers started from a thread that had ended), and a training process that is PID 1
    (a container without init) is fine: the worker compares with the parent it was started by.
    """

    #: Seconds between two looks at the parent.
    interval = 0.5

    def __init__(self, worker_init_fn: Callable[[int], Any] | None = None):
        self.worker_init_fn = worker_init_fn

    def __call__(self, worker_id: int) -> None:
        parent = os.getppid()
        threading.Thread(target=self._watch, args=(parent,), name="wdsraft-parent-watch", daemon=True).start()
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)

    def _watch(self, parent: int) -> None:
        while os.getppid() == parent:  # (a dead parent's orphans are adopted: the parent pid changes)
            time.sleep(self.interval)
        os._exit(1)
