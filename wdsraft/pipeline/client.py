"""Positions for readers the client built from webdataset's pieces.

Training code often reads shards with its own function, ``url_opener`` + ``tar_file_expander`` + a
grouper of its own (``tarfile_to_samples_nothrow`` in CLIP-style code), whose samples carry only
``__key__`` and ``__url__``. :class:`ClientReader` wraps such a function for one pass: wdsraft's
``tar_file_expander`` tells it the byte offset of each member it hands out, and it matches each sample
the grouper yields to the member that began it (same shard, a name of the sample's key). That gives
the sample an address (shard, offset), and the state the offset where the next sample starts; a
restore feeds the function the shard list from that shard on, the current shard opened at that
offset, and re-reads buffered samples by opening their shard at their offset.

What cannot be located (the function reads with other tools, or its samples carry no ``__key__`` /
``__url__``) is marked unresumable, never guessed.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import webdataset.shardlists
import webdataset.tariterators
from webdataset.utils import PipelineStage

from wdsraft.core.errors import StateMismatchError
from wdsraft.pipeline.addresses import Address
from wdsraft.pipeline.shardlists import single_node_only, split_by_node, split_by_worker
from wdsraft.pipeline.stage import Context, SourceStage, Stage, unresumable_state
from wdsraft.tar.webdataset_io import listen_to_members, tar_file_expander, url_opener

logger = logging.getLogger(__name__)

#: Shard-level functions a pipeline puts between its shard list and its reader.
_SHARD_LEVEL: tuple[Any, ...] = (
    single_node_only,
    split_by_node,
    split_by_worker,
    webdataset.shardlists.single_node_only,
    webdataset.shardlists.split_by_node,
    webdataset.shardlists.split_by_worker,
)

_OPENERS = (url_opener, webdataset.tariterators.url_opener)
_EXPANDERS = (tar_file_expander, webdataset.tariterators.tar_file_expander)

#: Wanted samples further apart than this are re-read by opening the shard again at the later one.
_GAP = 1 << 18

#: Members remembered while no sample claims them (a grouper that drops everything).
_HISTORY = 100_000


def client_reader_span(stages: list[Any]) -> tuple[int, int] | None:
    """Where a client's reader lies (first and last index): the first plain function after a replayable
    shard list (wdsraft's, webdataset's ``SimpleShardList`` or a list) and the shard-level stages after
    it; webdataset's pieces as separate stages (``url_opener``, ``tar_file_expander``, then a grouper)
    make one reader."""
    if not stages or not _replayable_shard_list(stages[0]):
        return None
    for index in range(1, len(stages)):
        stage = stages[index]
        if any(stage is f for f in _SHARD_LEVEL):
            continue
        if isinstance(stage, Stage):
            if stage.epoch_start_state() is None:
                return None  # a sample-level stage: no reader in between
            continue
        if isinstance(stage, (PipelineStage, list)) or not callable(stage):
            return None
        end = index
        if any(stage is f for f in _OPENERS):
            while end + 1 < len(stages) and any(stages[end + 1] is f for f in _EXPANDERS):
                end += 1
            if end > index and end + 1 < len(stages) and _plain(stages[end + 1]):
                end += 1  # the grouper
        return index, end
    return None


def _plain(stage: Any) -> bool:
    return callable(stage) and not isinstance(stage, (Stage, PipelineStage, list))


def composed(functions: list[Any], invoke: Callable[..., Any]) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The stages of a reader given as several (url_opener, tar_file_expander, a grouper) as one function."""

    def read(src: Iterator[Any]) -> Iterator[Any]:
        for function in functions:
            src = invoke(function, src)
        return src

    read.__name__ = "+".join(_name(function) for function in functions)
    return read


def passed_through(src: Iterator[Any]) -> Iterator[Any]:
    """Stands in a pass for a piece of a reader that ``composed`` took into the reader stage."""
    return src


def _replayable_shard_list(stage: Any) -> bool:
    if isinstance(stage, Stage):
        return stage.epoch_start_state() is not None
    if isinstance(stage, list):  # (shard URLs, not items of some other kind)
        first = stage[0] if stage else None  # (the first item only: a list of samples may be long)
        return isinstance(first, str) or (isinstance(first, dict) and "url" in first and "__key__" not in first)
    return isinstance(stage, webdataset.shardlists.SimpleShardList)


def _name(function: Any) -> str:
    inner = getattr(function, "f", function)  # (pipelinefilter's curried form keeps the function as .f)
    return getattr(inner, "__name__", type(inner).__name__)


_END = object()  # what _next_heard returns once the items are exhausted


def _next_heard(items: Iterator[Any], locator: _Locator) -> Any:
    """The next item, with the locator hearing the tar members read to make it (``_END`` at the end)."""
    previous = listen_to_members(locator)
    try:
        return next(items, _END)
    finally:
        listen_to_members(previous)


class _Locator:
    """Matches the samples a grouper yields to the members ``tar_file_expander`` handed out before."""

    def __init__(self) -> None:
        self.shard = 0  # number of the shard being fed (members belong to it: shards are read in turn)
        self.members: deque[tuple[int, str, str, int]] = deque(maxlen=_HISTORY)  # (shard, url, name, offset)
        self.ended: set[int] = set()
        self.skipped = False  # whether the last sample located came after members of no sample yet

    def member(self, url: str, name: str, offset: int) -> None:
        self.members.append((self.shard, url, name, offset))

    def shard_end(self, url: str) -> None:
        self.ended.add(self.shard)

    def locate(self, sample: Any) -> tuple[tuple[int, str, int] | None, dict[str, Any] | None]:
        """(shard number, url, offset) of the member that began ``sample`` and the state that resumes right
        after it ({shards_started, url, offset, done}), each None where unknown."""
        if not isinstance(sample, dict):
            return None, None
        key, url = sample.get("__key__"), sample.get("__url__")
        if not isinstance(key, str) or not isinstance(url, str):
            return None, None
        members, prefix = self.members, key + "."
        start = next((i for i, m in enumerate(members) if m[1] == url and m[2].startswith(prefix)), None)
        if start is None:
            return None, None
        # Members before the sample's own were read but not handed out with it: a reader that drops or
        # reorders samples (an internal shuffle) may hand them out later, so "resume after this sample"
        # would lose them. Such a reader is not resumable (marked by the caller), never guessed.
        self.skipped = start > 0
        shard, _, name, offset = members[start]
        # The sample's members: those of its key that follow, until a suffix repeats (a grouper that does
        # not raise on duplicates starts a new sample there, as CLIP-style ones do).
        suffixes = {name[len(prefix) :]}
        end = start + 1
        while end < len(members):
            _, other_url, other, _ = members[end]
            if other_url != url or not other.startswith(prefix) or other[len(prefix) :] in suffixes:
                break
            suffixes.add(other[len(prefix) :])
            end += 1
        for _ in range(end):
            members.popleft()
        if members:
            next_shard, next_url, _, next_offset = members[0]
            after = {"shards_started": next_shard, "url": next_url, "offset": next_offset, "done": False}
        elif shard in self.ended:
            after = {"shards_started": shard, "url": url, "offset": 0, "done": True}
        else:
            after = None  # the grouper yielded before reading on: where the next sample starts is not known
        return (shard, url, offset), after


class ClientReader(SourceStage):
    """A client's reader function (shard dicts in, samples out) as a source stage, for one pass.

    State: how many shards were fed, and the shard and byte offset where the next sample starts.
    """

    def __init__(self, function: Callable[..., Any], invoke: Callable[..., Any]):
        self.function = function
        self.invoke = invoke
        self.name = _name(function)
        self._live: dict[str, Any] | None = {"shards_started": 0, "url": None, "offset": 0, "done": False}
        self._lost: str | None = None  # why the position is not known, once it is not

    def config(self) -> dict[str, Any]:
        return {"reader": self.name}

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        if src is None:
            raise ValueError(f"{self.name} needs a stream of shards before it")
        if ctx.skip is not None:  # (it reads whole shards: the consumed samples would come back)
            raise StateMismatchError(
                f"stage {self.index} ({self.name}) cannot skip the samples a ledger says were consumed (an "
                "elastic resume): read the shards with wds.tarfile_to_samples() or wds.WebDataset"
            )
        if state is not None:
            self._live = dict(state)
        return self._samples(ctx, src, state)

    def _lose(self, why: str) -> None:
        if self._lost is None:
            self._lost = why
            logger.info("stage %s (%s): %s", self.index, self.name, why)

    def _feed(self, locator: _Locator, src: Iterator[Any], resume: dict[str, Any] | None) -> Iterator[Any]:
        started = 0
        for source in src:
            started += 1
            locator.shard = started
            if resume is not None and started <= resume["shards_started"]:
                if started < resume["shards_started"]:
                    continue
                url = source["url"] if isinstance(source, dict) else source
                if url != resume["url"]:
                    raise StateMismatchError(
                        f"stage {self.index} ({self.name}): shard #{started} of this epoch is {url}, but the saved "
                        f"state was reading {resume['url']}: the shard list or its order changed"
                    )
                if resume["done"]:
                    continue
                if isinstance(source, dict):  # (another kind of shard item is read from its start: see _samples)
                    source = {**source, "offset": resume["offset"]}
            yield source
        if resume is not None and started < resume["shards_started"]:
            raise StateMismatchError(
                f"stage {self.index} ({self.name}): the saved state had started {resume['shards_started']} shards "
                f"this epoch, but only {started} remain"
            )

    def _samples(self, ctx: Context, src: Iterator[Any], resume: dict[str, Any] | None) -> Iterator[Any]:
        locator = _Locator()
        skip_before = (resume["shards_started"], resume["offset"]) if resume and not resume["done"] else None
        items = self.invoke(self.function, self._feed(locator, src, resume))
        while (sample := _next_heard(items, locator)) is not _END:
            where, after = locator.locate(sample)
            if locator.skipped:
                self._lose(
                    "it handed out a sample after tar members that were in no sample yet (a reader that drops "
                    "or reorders samples: resuming after this one could lose them)"
                )
            if where is None:
                self._lose(
                    "its samples' positions are unknown (no __key__/__url__, or members not read by "
                    "wds.tariterators.url_opener + tar_file_expander)"
                )
                ctx.provenance = None
                yield sample
                continue
            shard, url, offset = where
            if skip_before is not None and shard == skip_before[0] and offset < skip_before[1]:
                continue  # (an opener that ignored the offset read the shard from its start)
            self._live = after  # (None until a sample says where the next one starts)
            ctx.stamp((url, offset, 0))
            yield sample

    def state_dict(self) -> dict[str, Any]:
        if self._lost is not None:
            return unresumable_state(f"cannot save stage {self.index} ({self.name}): {self._lost}")
        if self._live is None:
            return unresumable_state(
                f"cannot save stage {self.index} ({self.name}): it yielded a sample before reading the next one, "
                "so where that one starts is not known yet"
            )
        return dict(self._live)

    def rematerialize(self, addresses: list[Address]) -> list[Any]:
        """Re-read samples by (url, offset): the function fed each shard opened at a wanted offset, reading
        on while the following wanted offsets of that shard come."""
        wanted: dict[str, set[int]] = {}
        for url, offset, _sub in addresses:
            wanted.setdefault(url, set()).add(offset)
        found: dict[tuple[str, int], Any] = {}
        for url, offsets in wanted.items():
            pending = sorted(offsets)
            while pending:
                self._read_from(url, pending, found)
        return [found[url, offset] for url, offset, _ in addresses]

    def _read_from(self, url: str, pending: list[int], found: dict[tuple[str, int], Any]) -> None:
        """Read ``url`` from ``pending[0]`` on, taking the wanted samples met, until none is left or the
        reader passes the last wanted one; removes what it found from ``pending``."""
        locator = _Locator()
        locator.shard = 1
        first = pending[0]
        items = self.invoke(self.function, iter([{"url": url, "offset": first}]))
        try:
            while pending and (sample := _next_heard(items, locator)) is not _END:
                where, _ = locator.locate(sample)
                if where is None:
                    break
                offset = where[2]
                if offset in pending:
                    found[url, offset] = sample
                    pending.remove(offset)
                if pending and (offset > pending[0] or pending[0] - offset > _GAP):
                    break  # passed a wanted one (reported below, on its own read) or far from the next
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()
        if first in pending:
            raise StateMismatchError(f"stage {self.index} ({self.name}): {url}: no sample starts at byte {first}")
