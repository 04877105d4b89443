"""Several shards read at once: the round-robin of ``TarfileToSamples(n_active_shards=k)``.

Up to ``k`` shards are open; each turn hands out the next sample of the shard whose turn it is, then
puts that shard last. A shard that ends leaves the turn, and the next shard of the list joins it at
the end. The state is how many shards have been started this epoch and, for each open shard in turn
order (the next to read first), its number, URL, identity and the byte offset and ordinal of its next
sample: a resume replays the shard list, reopens exactly those shards there, and goes on in the same turn.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from wdsraft.core.errors import StateMismatchError
from wdsraft.core.fields import OFFSET_FIELD, ORDINAL_FIELD
from wdsraft.index.shard_index import ShardIndex
from wdsraft.io.storage import local_path
from wdsraft.pipeline.shard_entries import open_entry
from wdsraft.pipeline.stage import Context

if TYPE_CHECKING:  # (the source imports this module)
    from wdsraft.pipeline.source import TarfileToSamples

__all__ = ["ActiveShards"]

logger = logging.getLogger(__name__)


class _Cursor:
    """One open shard of the round-robin: its samples, and where its next sample starts."""

    def __init__(
        self,
        number: int,
        url: str,
        offset: int,
        ordinal: int,
        index: ShardIndex | None,
        end: int | None,
        local: str | None = None,
    ):
        self.number = number  # which shard of the epoch (1 for the first started)
        self.url = url
        self.local = local  # the path set as ``__local_path__`` (webdataset's field), or None
        self.offset = offset
        self.ordinal = ordinal
        self.index = index
        self.end = end  # an ordinal bound (exclusive) from the shard list, or None
        self.stopped = False  # the handler asked to stop everything
        self._samples: Iterator[dict[str, Any]] | None = None

    def state(self) -> dict[str, Any]:
        identity = self.index.identity if self.index is not None else None
        return {
            "number": self.number,
            "url": self.url,
            "offset": self.offset,
            "ordinal": self.ordinal,
            "shard": identity,
        }

    def next_sample(self, stage: TarfileToSamples, ctx: Context) -> dict[str, Any] | None:
        """The shard's next sample, or None once it has none left (or its error went to the handler)."""
        if self._samples is None:
            self._samples = self._read(stage, ctx)
        try:
            return next(self._samples, None)
        except Exception as exn:
            if not (exn.args and str(self.url) in str(exn.args[0])):
                exn.args = (*exn.args, self.url)
            if not stage.handler(exn):
                self.stopped = True
            return None

    def _read(self, stage: TarfileToSamples, ctx: Context) -> Iterator[dict[str, Any]]:
        for reader in stage._readers(ctx, self.url, self.offset, self.ordinal, self.index, self.end):
            for sample in reader:
                self.offset, self.ordinal = reader.next_offset, reader.next_ordinal
                yield sample
            if reader.stopped:
                self.stopped = True
                return


class ActiveShards:
    """The samples of the shards a shard list names, ``k`` shards at a time, in turn, and its state."""

    def __init__(self, stage: TarfileToSamples, k: int, resume: dict[str, Any] | None):
        self.stage = stage
        self.k = k
        self.resume = resume  # the state to restore, until the first sample is asked for
        self.started = 0  # shards started this epoch
        self.active: deque[_Cursor] = deque()  # the open shards, the next to read first

    def state(self) -> dict[str, Any]:
        if self.resume is not None:  # (not restored yet: the state loaded is the state)
            return copy.deepcopy(self.resume)
        return {"shards_started": self.started, "active": [cursor.state() for cursor in self.active]}

    def _join(self, source: Any, saved: dict[str, Any] | None) -> _Cursor:
        opened = open_entry(source, self.started, saved)
        assert opened is not None  # (an active shard's saved position is never a finished one)
        local = local_path(opened.url) if self.stage.local_path else None
        return _Cursor(self.started, opened.url, opened.offset, opened.ordinal, opened.shard_index, opened.end, local)

    def _restore(self, sources: Iterator[Any], resume: dict[str, Any]) -> None:
        """Replay the shard list up to the shards the state had started; reopen its open ones."""
        saved = {entry["number"]: entry for entry in resume["active"]}
        cursors: dict[int, _Cursor] = {}
        while self.started < resume["shards_started"]:
            source = next(sources, None)
            if source is None:
                raise StateMismatchError(
                    f"the saved state had started {resume['shards_started']} shards this epoch, "
                    f"but only {self.started} remain"
                )
            self.started += 1
            if self.started in saved:
                cursors[self.started] = self._join(source, saved[self.started])
        self.active.extend(cursors[entry["number"]] for entry in resume["active"])

    def samples(self, ctx: Context, src: Iterator[Any]) -> Iterator[dict[str, Any]]:
        stage, active = self.stage, self.active
        sources = iter(src)
        if self.resume is not None:
            self._restore(sources, self.resume)
            self.resume = None
        while True:
            while len(active) < self.k:
                source = next(sources, None)
                if source is None:
                    break
                self.started += 1
                active.append(self._join(source, None))
            if not active:
                return
            cursor = active.popleft()
            sample = cursor.next_sample(stage, ctx)
            if cursor.stopped:
                return
            if sample is None:  # the shard is done: it leaves the turn
                continue
            active.append(cursor)
            if cursor.local is not None:
                sample["__local_path__"] = cursor.local
            ctx.provenance = (cursor.url, sample[ORDINAL_FIELD], sample[OFFSET_FIELD], 0)
            ctx.serial = next(ctx.serials)
            yield sample
