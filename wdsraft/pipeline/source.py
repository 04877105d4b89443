"""The checkpointable source: ``TarfileToSamples`` turns a stream of shard URLs into samples.

Its state is how many shards it has started this epoch, the current shard (and, where its
index gives it, the shard's identity: sha256, else size and sample count), and the byte
offset and ordinal of the next sample: resuming seeks straight there, after checking that the
shard is still the one the state was taken on. Items it hands out are addressed by
``(url, ordinal, offset)``.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Container, Iterator, Mapping
from typing import IO, Any, Protocol

from webdataset.handlers import reraise_exception

from wdsraft.core.errors import IndexFormatError, ShardIntegrityError, StateMismatchError
from wdsraft.core.fields import OFFSET_FIELD, ORDINAL_FIELD
from wdsraft.core.state import describe
from wdsraft.index.shard_index import ShardIndex, span_digest
from wdsraft.io.storage import local_path
from wdsraft.pipeline.active import ActiveShards
from wdsraft.pipeline.addresses import Address
from wdsraft.pipeline.shard_entries import open_entry
from wdsraft.pipeline.stage import Context, SourceStage
from wdsraft.tar.format import BLOCK
from wdsraft.tar.reader import ShardSampleReader

logger = logging.getLogger(__name__)


Handler = Callable[[BaseException], bool]


class SkipSet(Protocol):
    """What an elastic resume tells the source to leave out of each shard, and to note on what it reads.

    ``wdsraft.ledger.ConsumedSet`` implements it: samples consumed by earlier runs, and the first
    token still owed of documents they delivered in part.
    """

    def skipped_in(self, url: str) -> Container[int] | None:
        """The ordinals of ``url`` not to read, or None where none are skipped."""
        ...

    def marks_in(self, url: str) -> Mapping[int, Mapping[str, Any]] | None:
        """Fields to set on samples of ``url`` by ordinal (e.g. ``__token_start__``), or None."""
        ...


class TarfileToSamples(SourceStage):
    """The pipeline stage that turns a stream of shard URLs into samples, checkpointably.

    Its state is how many shards it has started this epoch, the current shard, and the
    byte offset and ordinal of the next sample: resuming seeks straight there. Items it
    hands out are addressed by ``(url, ordinal, offset)``, so buffering stages downstream
    save positions and re-read them on restore.

    Each shard's index (``SHARD.idx`` beside a local or S3 shard) is loaded once when the shard
    starts; readers check the shard against it as they go (see ``ShardSampleReader``), and
    ``verify=True`` checks every sample's CRC-32 too, re-reads by ``rematerialize`` included.

    ``n_active_shards=k`` keeps k shards open and hands out a sample of each in turn (``ActiveShards``):
    more mixing within a worker, for k open streams. A shard-list entry may bound a shard with
    ``{"url", "offset", "ordinal", "end"}`` (an exclusive ordinal): an eval split reads part of a shard.
    Such an entry may leave the seek to the shard's index (``"offset": None``) and hold the sample count
    the split assumed (``"nsamples"``): the shard is refused unless its index has that count.
    """

    def __init__(
        self,
        handler: Handler = reraise_exception,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        local_path: bool = False,
        verify: bool = False,
        n_active_shards: int = 1,
    ):
        if not isinstance(n_active_shards, int) or n_active_shards < 1:
            raise ValueError(f"n_active_shards must be a positive integer, not {n_active_shards!r}")
        self.handler = handler
        self.verify = verify  # (not in config(): it changes no sample, only whether damage is found)
        self.select_files = select_files
        self.rename_files = rename_files
        self.local_path = local_path  # add __local_path__ for local shards, as webdataset.WebDataset does
        self._live: dict[str, Any] = self._fresh()
        self._skip: SkipSet | None = None  # an elastic resume's skip set, for this pass
        #: Shards read at once, in turn (``ActiveShards``); 1 reads them one after the other.
        self.n_active_shards = n_active_shards
        self._round: ActiveShards | None = None  # the round-robin in progress (n_active_shards > 1)

    @staticmethod
    def _fresh() -> dict[str, Any]:
        return {"shards_started": 0, "url": None, "offset": 0, "ordinal": 0, "done": False, "shard": None}

    def config(self) -> dict[str, Any]:
        config = {
            "select_files": describe(self.select_files),
            "rename_files": describe(self.rename_files),
            "handler": describe(self.handler),
        }
        if self.n_active_shards != 1:  # (absent at 1: states saved before the option still match)
            config["n_active_shards"] = self.n_active_shards
        return config

    def state_dict(self) -> dict[str, Any]:
        if self._round is not None:
            return self._round.state()
        return dict(self._live)

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
        if src is None:
            raise ValueError("tarfile_to_samples needs a stream of shard URLs before it")
        self._skip = ctx.skip
        if self.n_active_shards > 1:
            if state is not None and "active" not in state:
                raise StateMismatchError("this state was saved reading one shard at a time, not n_active_shards")
            self._round = ActiveShards(self, self.n_active_shards, state)  # (holds the state until it runs)
            return self._round.samples(ctx, src)
        # Adopt the state now: a state taken before the generator first runs must be this one.
        self._live = dict(state) if state is not None else self._fresh()
        return self._samples(ctx, src, state)

    def _reader(
        self,
        url: str,
        offset: int,
        ordinal: int,
        index: ShardIndex | None,
        block_size: int = 1 << 20,
        stream: IO[bytes] | None = None,
        verify: bool | None = None,
    ) -> ShardSampleReader:
        return ShardSampleReader(
            url,
            offset=offset,
            ordinal=ordinal,
            handler=self.handler,
            select_files=self.select_files,
            rename_files=self.rename_files,
            stream=stream,
            block_size=block_size,
            index=index,
            verify=self.verify if verify is None else verify,
        )

    def _samples(self, ctx: Context, src: Iterator[Any], resume: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
        live = self._live
        started = 0
        for source in src:
            started += 1
            saved = None
            if resume is not None and started <= resume["shards_started"]:
                if started < resume["shards_started"]:
                    continue  # finished before the checkpoint: not even opened
                saved = resume
            opened = open_entry(source, started, saved)
            if opened is None:
                continue  # (the shard the state was on, finished)
            url, offset, ordinal, end, index = opened
            identity = index.identity if index is not None else None
            live.update(shards_started=started, url=url, offset=offset, ordinal=ordinal, done=False, shard=identity)
            local = local_path(url) if self.local_path else None
            stopped = False
            try:
                for reader in self._readers(ctx, url, offset, ordinal, index, end):
                    for sample in reader:
                        live["offset"], live["ordinal"] = reader.next_offset, reader.next_ordinal
                        if local is not None:
                            sample["__local_path__"] = local
                        ctx.provenance = (url, sample[ORDINAL_FIELD], sample[OFFSET_FIELD], 0)  # (ctx.stamp, inline)
                        ctx.serial = next(ctx.serials)
                        yield sample
                    stopped = stopped or reader.stopped
            except Exception as exn:
                if not (exn.args and str(url) in str(exn.args[0])):
                    exn.args = (*exn.args, url)
                if not self.handler(exn):
                    live["done"] = True
                    return
            live["done"] = True
            if stopped:
                return
        if resume is not None and started < resume["shards_started"]:
            raise StateMismatchError(
                f"the saved state had started {resume['shards_started']} shards this epoch, but only {started} remain"
            )

    def _readers(
        self, ctx: Context, url: str, offset: int, ordinal: int, index: ShardIndex | None, end: int | None = None
    ) -> Iterator[Any]:
        """Readers over what is left to read of a shard (up to ordinal ``end``, exclusive, where the shard
        list bounds it): all of it, or -- with a ledger's consumed set (elastic resume) -- the runs of
        samples not yet consumed, found through the shard index so consumed samples are not even read,
        and fully consumed shards not opened."""
        if end is not None and ordinal >= end:
            return
        consumed = ctx.skip.skipped_in(url) if ctx.skip is not None else None
        if consumed is None:
            reader = self._marking(ctx, url, self._reader(url, offset, ordinal, index))
            yield reader if end is None else _Bounded(reader, end)
            return
        if index is None or index.compression is not None:
            # No index, or a compressed shard (a reader per run would decompress it from the start for
            # each run): one reader over the rest of the shard, dropping what was consumed.
            rest = _Filtered(self._marking(ctx, url, self._reader(url, offset, ordinal, index)), consumed)
            yield rest if end is None else _Bounded(rest, end)
            return
        offsets = index.offsets
        # Consumed samples between two runs are read through (and dropped) where they are fewer bytes than
        # what opening the next run costs: a request on S3, a reader locally. A shuffled run leaves its
        # buffer's samples as holes all over its last shards: a reader per hole made hundreds of openings.
        read_through = READ_THROUGH_LOCAL if local_path(url) is not None else READ_THROUGH_REMOTE
        for first, stop, holes in _unconsumed_stretches(offsets, consumed, ordinal, end, read_through):
            reader = self._marking(ctx, url, self._reader(url, offsets[first], first, index))
            yield _Bounded(_Filtered(reader, consumed) if holes else reader, stop)

    def _marking(self, ctx: Context, url: str, reader: ShardSampleReader) -> ShardSampleReader:
        marks = ctx.skip.marks_in(url) if ctx.skip is not None else None
        return _Marked(reader, marks) if marks else reader  # type: ignore[return-value]

    def rematerialize(self, addresses: list[Address]) -> list[Any]:
        """Re-read samples by (url, ordinal, offset).

        A local, uncompressed shard with an index is read sample by sample (one positioned
        read of exactly each sample's bytes), so the cost follows the number of samples
        wanted and nothing else. Otherwise the wanted offsets are grouped into runs of nearby
        samples, each read forward from its first offset (on S3/HTTP, a ranged read per run, after a
        short read of the shard's first bytes to recognise its compression).
        """
        wanted: dict[str, dict[int, list[int]]] = {}
        ordinals: dict[tuple[str, int], int] = {}
        for slot, (url, ordinal, offset, _sub) in enumerate(addresses):
            wanted.setdefault(url, {}).setdefault(offset, []).append(slot)
            ordinals[url, offset] = ordinal
        found: list[Any] = [None] * len(addresses)
        for url, by_offset in wanted.items():
            local = local_path(url)
            try:
                index = ShardIndex.beside(url)
            except OSError:
                index = None  # (the shard's own read reports what is wrong)
            samples = None
            if local is not None and index is not None and index.compression is None:
                samples = self._read_spans(url, local, index, by_offset, ordinals)
            if samples is None:
                samples = self._read_runs(url, index, by_offset, ordinals)
            marks = self._skip.marks_in(url) if self._skip is not None else None
            for offset, sample in samples.items():
                if self.local_path and local is not None:
                    sample["__local_path__"] = local
                if marks and sample[ORDINAL_FIELD] in marks:  # as _Marked does when reading
                    sample.update(marks[sample[ORDINAL_FIELD]])
                slots = by_offset[offset]
                for slot in slots:
                    found[slot] = sample if slot == slots[0] else dict(sample)
        return found

    def _read_spans(
        self,
        url: str,
        path: str,
        index: ShardIndex,
        by_offset: dict[int, list[int]],
        ordinals: dict[tuple[str, int], int],
    ) -> dict[int, dict[str, Any]]:
        if self.verify and index.crc32 is None:
            raise IndexFormatError(
                url + ".idx", "verify=True needs per-sample digests; `wdsraft index SHARD` adds them"
            )
        samples = {}
        with open(path, "rb", buffering=0) as raw:
            for offset in sorted(by_offset):
                ordinal = ordinals[url, offset]
                if index.offset_of(ordinal) != offset:
                    raise StateMismatchError(f"{url}: sample {ordinal} is not at byte {offset}: the shard changed")
                end = index.offsets[ordinal + 1]
                span = os.pread(raw.fileno(), end - offset, offset)
                if len(span) != end - offset:
                    raise ShardIntegrityError(url, offset + len(span), "the file ends inside this sample", ordinal)
                if self.verify and span_digest(span) != index.crc32[ordinal]:  # type: ignore[index]
                    raise ShardIntegrityError(
                        url, offset, f"bytes {offset}:{end} differ from the index's CRC-32", ordinal
                    )
                stream = io.BytesIO(span + bytes(2 * BLOCK))  # end-of-archive blocks after the one sample
                # (the span's digest is checked above: the reader of this one sample checks nothing more)
                reader = self._reader(
                    url, offset, ordinal, None, block_size=len(span) + 2 * BLOCK, stream=stream, verify=False
                )
                sample = next(iter(reader), None)
                if sample is None:
                    raise StateMismatchError(f"{url}: no sample at byte {offset}")
                samples[offset] = sample
        return samples

    def _read_runs(
        self,
        url: str,
        index: ShardIndex | None,
        by_offset: dict[int, list[int]],
        ordinals: dict[tuple[str, int], int],
    ) -> dict[int, dict[str, Any]]:
        samples = {}
        for run in _runs(sorted(by_offset)):
            pending = set(run)
            for sample in self._reader(url, run[0], ordinals[url, run[0]], index, block_size=1 << 16):
                offset = sample[OFFSET_FIELD]
                if offset in pending:
                    pending.discard(offset)
                    samples[offset] = sample
                if not pending or offset > run[-1]:
                    break
            if pending:
                raise StateMismatchError(f"{url}: saved sample positions {sorted(pending)[:5]} not found")
        return samples


class _ReaderView:
    """A reader seen through a filter; keeps the reader's resume position and stop flag visible."""

    def __init__(self, reader: Any):
        self.reader = reader

    @property
    def next_offset(self) -> int:
        return self.reader.next_offset

    @property
    def next_ordinal(self) -> int:
        return self.reader.next_ordinal

    @property
    def stopped(self) -> bool:
        return self.reader.stopped


#: Consumed bytes between two runs of unconsumed samples read through rather than opened anew.
READ_THROUGH_LOCAL = 64 << 10
READ_THROUGH_REMOTE = 1 << 20


def _unconsumed_stretches(
    offsets: Any, consumed: Container[int], ordinal: int, end: int | None, read_through: int
) -> Iterator[tuple[int, int, bool]]:
    """``(first, stop, holes)``: the stretches of a shard to read from ``ordinal`` on, each up to ``stop``
    (exclusive), with ``holes`` where consumed samples lie inside it (fewer than ``read_through`` bytes
    each) and must be dropped."""
    total = len(offsets) - 1 if end is None else min(len(offsets) - 1, end)
    current: list[Any] | None = None  # [first, stop, holes]
    start = ordinal
    while start < total:
        while start < total and start in consumed:
            start += 1
        stop = start
        while stop < total and stop not in consumed:
            stop += 1
        if start < stop:
            if current is not None and offsets[start] - offsets[current[1]] <= read_through:
                current[1], current[2] = stop, True
            else:
                if current is not None:
                    yield current[0], current[1], current[2]
                current = [start, stop, False]
        start = stop
    if current is not None:
        yield current[0], current[1], current[2]


class _Filtered(_ReaderView):
    """Drops samples whose ordinal is consumed (shards without an index)."""

    def __init__(self, reader: Any, consumed: Any):
        super().__init__(reader)
        self.consumed = consumed

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (s for s in self.reader if s[ORDINAL_FIELD] not in self.consumed)


class _Bounded(_ReaderView):
    """Stops before ordinal ``end`` (a run of unconsumed samples)."""

    def __init__(self, reader: Any, end: int):
        super().__init__(reader)
        self.end = end

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for sample in self.reader:
            if sample[ORDINAL_FIELD] >= self.end:
                return
            yield sample
            if sample[ORDINAL_FIELD] + 1 >= self.end:
                return


class _Marked(_ReaderView):
    """Sets a skip set's fields on the samples it names (a ledger marks documents partly delivered
    before, so that the sequence stages continue them)."""

    def __init__(self, reader: Any, marks: Mapping[int, Mapping[str, Any]]):
        super().__init__(reader)
        self.marks = marks

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for sample in self.reader:
            fields = self.marks.get(sample[ORDINAL_FIELD])
            if fields:
                sample.update(fields)
            yield sample


def _runs(offsets: list[int], gap: int = 1 << 18) -> list[list[int]]:
    """Sorted offsets split where two neighbours lie more than ``gap`` bytes apart."""
    runs: list[list[int]] = []
    for offset in offsets:
        if runs and offset - runs[-1][-1] <= gap:
            runs[-1].append(offset)
        else:
            runs.append([offset])
    return runs


tarfile_to_samples = TarfileToSamples
