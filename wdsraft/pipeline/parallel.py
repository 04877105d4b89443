"""``parallel_map`` and ``parallel_filter_map``: a function applied to items on a pool of threads or
processes, results handed out in input order, checkpointable.

The items in flight (taken from upstream, result not yet handed out) are saved as their addresses;
a restore re-reads them and submits them again, so a state holds positions, never payloads or
results, and its size does not depend on what the function returns.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

from wdsraft.core.state import describe
from wdsraft.pipeline.addresses import Address, pack_addresses, unpack_addresses
from wdsraft.pipeline.stage import AddressTracker, Context, Curried, Stage, unresumable_state

EXECUTORS = ("thread", "process")


class parallel_filter_map(Curried, Stage):
    """``fn`` on each item, on ``max_workers`` threads or processes, results in input order; an item for
    which ``fn`` returns None is dropped (epochraft's ``parallel_filter_map``).

    At most ``max_workers * prefetch_factor`` items are in flight. ``fn`` must be a deterministic
    function of the item (a restore runs it again on the items that were in flight); for processes, it
    and the items must pickle. The number of workers, the prefetch and the executor may change between
    a save and a restore: they do not change the stream.
    """

    drops_none = True

    def __init__(
        self,
        fn: Callable[[Any], Any],
        max_workers: int | None = None,
        prefetch_factor: int = 10,
        executor: str = "thread",
        mp_context: Any = None,
    ):
        if executor not in EXECUTORS:
            raise ValueError(f"{type(self).__name__}: executor must be one of {EXECUTORS}, not {executor!r}")
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"{type(self).__name__}: max_workers must be >= 1, not {max_workers}")
        if prefetch_factor < 1:
            raise ValueError(f"{type(self).__name__}: prefetch_factor must be >= 1, not {prefetch_factor}")
        self.fn = fn
        self.max_workers = max_workers or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        self.prefetch_factor = prefetch_factor
        self.executor = executor
        self.mp_context = mp_context
        self._in_flight: deque[tuple[Address | None, Any, Future[Any]]] = deque()  # (address, item, result)
        self._restored: list[Address] = []  # in flight at the save, until the generator re-reads them
        #: Whether it dropped an item in this pass (between a split and a buffer, the pass then refuses states).
        self.dropped = False

    def config(self) -> dict[str, Any]:
        return {"fn": describe(self.fn)}

    def state_dict(self) -> dict[str, Any]:
        addresses = self._restored + [address for address, _, _ in self._in_flight]
        if None in addresses:
            return unresumable_state(
                f"cannot save stage {self.index} ({type(self).__name__}): items in flight have no position in "
                "the shards (a stage before it merges items, or the pipeline's reader gives no positions)"
            )
        return {"in_flight": pack_addresses(addresses)}  # type: ignore[arg-type]

    def addresses(self) -> list[Address]:
        return self._restored + [address for address, _, _ in self._in_flight if address is not None]

    def replay(self, src: Iterator[Any]) -> Iterator[Any]:
        for item in src:
            result = self.fn(item)
            if result is not None or not self.drops_none:
                yield result

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        self._in_flight = deque()
        self.dropped = False
        # Adopted now, not when the generator first runs (a state taken before then must hold them): the items
        # in flight at the save wait here until the generator re-reads them.
        self._restored = unpack_addresses(state["in_flight"]) if state else []
        return self._results(ctx, src)

    def _pool(self) -> Executor:
        if self.executor == "thread":
            return ThreadPoolExecutor(self.max_workers, thread_name_prefix=f"wdsraft-{type(self).__name__}")
        if multiprocessing.current_process().daemon:
            raise ValueError(
                f"stage {self.index} ({type(self).__name__}): executor='process' cannot start processes inside "
                "a DataLoader worker (a daemon process); use executor='thread' there, or put the stage after the "
                "WebLoader (in the training process)"
            )
        return ProcessPoolExecutor(self.max_workers, mp_context=self.mp_context)

    def _results(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        in_flight = self._in_flight
        limit = self.max_workers * self.prefetch_factor
        pool = self._pool()
        try:
            restored, self._restored = self._restored, []
            if restored:  # the items in flight at the save, re-read, go first
                for saved, item in zip(restored, ctx.rematerializers[self.index](restored), strict=True):
                    in_flight.append((saved, item, pool.submit(self.fn, item)))
            tracker = AddressTracker(ctx)
            src = iter(src)
            exhausted = False
            while True:
                while not exhausted and len(in_flight) < limit:
                    item = next(src, _END)
                    if item is _END:
                        exhausted = True
                        break
                    in_flight.append((tracker.address(), item, pool.submit(self.fn, item)))
                if not in_flight:
                    return
                address, item, future = in_flight[0]  # (the oldest: results go out in input order)
                try:
                    result = future.result()
                except Exception as error:
                    where = f" at {address}" if address is not None else ""
                    _name_in(error, f"in stage {self.index} ({type(self).__name__}), on {_name_of(item)}{where}")
                    raise
                in_flight.popleft()
                if result is None and self.drops_none:
                    self.dropped = True
                    continue
                upstream = ctx.hand_out(address)  # what comes out is the item taken in at that address
                yield result
                ctx.resume(upstream)
        finally:
            for _, _, future in in_flight:
                future.cancel()
            pool.shutdown(wait=False, cancel_futures=True)


class parallel_map(parallel_filter_map):
    """``fn`` on each item, on ``max_workers`` threads or processes, results in input order (epochraft's
    ``parallel_map``); a None result is handed out as it is. See ``parallel_filter_map``."""

    drops_none = False


def _name_in(error: Exception, note: str) -> None:
    """Say in ``error`` which item failed, keeping its type (a handler catching it still does): a note
    (Python 3.11+), else one more argument, as webdataset adds the shard's name to a reader's errors."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(note)
    else:
        error.args = (*error.args, note)


def _name_of(item: Any) -> str:
    """The item, as an error message names it: its key and shard for a sample."""
    if isinstance(item, dict) and "__key__" in item:
        url = item.get("__url__")
        return f"{item['__key__']!r}" + (f" of {url}" if url else "")
    text = repr(item)
    return text if len(text) <= 80 else text[:77] + "..."


_END = object()
