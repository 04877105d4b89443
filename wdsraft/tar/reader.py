"""Tar shards to samples, with webdataset's grouping rules and a position on every sample.

``tarfile_samples`` is a drop-in for webdataset's: same arguments, same grouping (key =
path up to the first dot of the basename, lower-cased extension, only adjacent members
grouped, a repeated extension is an error), same handler protocol. Each sample also
carries ``__ordinal__`` and ``__offset__`` (see :mod:`wdsraft.core.fields`), and a
reader can start at any sample's offset.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import IO, Any, Literal, cast

from webdataset.handlers import reraise_exception

from wdsraft.core.errors import IndexFormatError, ShardIntegrityError
from wdsraft.core.fields import OFFSET_FIELD, ORDINAL_FIELD
from wdsraft.index.shard_index import INDEX_SUFFIX, ShardIndex
from wdsraft.io.gopen import open_shard
from wdsraft.io.storage import local_path as path_of
from wdsraft.tar.members import TarMemberReader
from wdsraft.tar.naming import DEFAULT_SKIP_META, split_key
from wdsraft.tar.spans import SpanDigester

logger = logging.getLogger(__name__)


Handler = Callable[[BaseException], bool]


def _members(reader: TarMemberReader) -> Iterator[tuple[str, int, bytes]]:
    """The reader's members one by one, as plain tuples (chained in C: no Python frame per member)."""
    return chain.from_iterable(reader.batches(plain=True))


class ShardSampleReader:
    """Reads the samples of one shard, optionally starting at a sample's byte offset.

    Yields webdataset sample dicts (``__key__``, ``__url__``, one entry per extension)
    plus the sample's ``__ordinal__`` and ``__offset__``. After each yielded sample,
    ``next_offset``/``next_ordinal`` name where the following sample starts: opening a
    new reader there continues the stream exactly.

    Member-level problems (a repeated extension) go to ``handler``, which returns True
    to skip the member. Format errors (corrupt or truncated tar) end the shard: the
    sample being assembled is yielded first, then the error is raised with the shard
    URL and byte offset; :func:`tarfile_samples` hands it to the handler.

    With the shard's index (``index="auto"``: the ``SHARD.idx`` beside a local or S3 shard,
    loaded once; or a ``ShardIndex``; None: no checks), the reader checks as it goes that
    every sample starts where the index says, and at the end that the archive ends where
    and after as many samples as the index says, and (local shards) that the file has the
    index's size; a mismatch raises :class:`ShardIntegrityError` naming shard, byte offset and
    sample ordinal. A sample is then handed out only once its whole span is known good:
    never a partial one before the error. ``verify=True`` also checks each sample's CRC-32
    against the index before handing it out (the index must have them).
    """

    def __init__(
        self,
        url: str,
        *,
        offset: int = 0,
        ordinal: int | None = 0,
        handler: Handler = reraise_exception,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        skip_meta: str | None = DEFAULT_SKIP_META,
        stream: IO[bytes] | None = None,
        block_size: int = 1 << 20,
        index: ShardIndex | Literal["auto"] | None = "auto",
        verify: bool = False,
    ):
        self.url = url
        self.handler = handler
        self.select_files = select_files
        self.rename_files = rename_files
        self.skip_meta = re.compile(skip_meta) if skip_meta is not None else None
        self.block_size = block_size
        self._stream = stream
        self.start_offset = offset
        # None: the ordinal of the sample at `offset`, from the index (0 without one, as before indexes)
        self.start_ordinal = ordinal
        self.next_offset = offset
        self.next_ordinal = ordinal if ordinal is not None else 0
        self.index_option = index
        self.verify = verify
        #: The index the reader checks against (resolved when iteration starts), or None.
        self.index: ShardIndex | None = None
        #: True once the whole shard has been read.
        self.exhausted = False
        #: True when the handler asked to stop everything (not just this shard).
        self.stopped = False

    def _is_meta(self, name: str) -> bool:
        if "/" not in name and name.startswith("__") and name.endswith("__"):  # webdataset's __meta__ files
            return True
        return self.skip_meta is not None and self.skip_meta.match(name) is not None

    def _resolve_index(self) -> ShardIndex | None:
        option = self.index_option
        if option == "auto":
            # A caller that hands in the stream (build_index, a span re-read) knows what it reads.
            return ShardIndex.beside(self.url) if self._stream is None else None
        return option

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.index = index = self._resolve_index()
        if self.start_ordinal is None:
            found = index.ordinal_at(self.start_offset) if index is not None else None
            if index is not None and found is None:
                raise ShardIntegrityError(self.url, self.start_offset, "no sample of the index starts at this offset")
            self.start_ordinal = self.next_ordinal = found or 0
        if self.verify and (index is None or index.crc32 is None):
            raise IndexFormatError(
                self.url + INDEX_SUFFIX,
                "verify=True needs the shard's index with per-sample digests; "
                "`wdsraft index SHARD` writes one" + (" (this one predates them)" if index else ""),
            )
        if index is not None and self._stream is None:
            _check_size(self.url, index)
        if self._stream is not None:
            stream = self._stream
        else:  # (a shard its index says is a plain tar needs no look at its first bytes: one request on S3)
            stream = open_shard(self.url, self.start_offset, plain=index is not None and index.compression is None)
        try:
            digester = SpanDigester(stream, self.start_offset) if self.verify else None
            source = cast(IO[bytes], digester) if digester is not None else stream
            members = TarMemberReader(source, self.url, self.start_offset, self.block_size)
            yield from self._group(members, index, digester)
            if not self.stopped:
                self.next_offset = members.end_offset
                self.exhausted = True
        finally:
            if self._stream is None:  # close only what we opened
                stream.close()

    def _group(
        self, members: TarMemberReader, index: ShardIndex | None, digester: SpanDigester | None
    ) -> Iterator[dict[str, Any]]:
        url = self.url
        rename, select = self.rename_files, self.select_files
        # The default pattern only matches names starting with "__": a one-character test first (a cached
        # string, no new one), it is the hot loop.
        meta_prefix_only = self.skip_meta is None or self.skip_meta.pattern == DEFAULT_SKIP_META
        ordinal = self.next_ordinal - 1
        raw_key: str | None = None  # the key before renaming: ordinals follow the shard as written
        group_offset = self.start_offset
        current: dict[str, Any] | None = None
        # With an index, a sample goes out once the group it came from (its span as written) is checked:
        # `verified` is the last checked ordinal; samples of the group still open wait in `held`
        # (only a rename that splits a group makes any). Without an index everything goes out at once.
        first = self.next_ordinal  # (the start ordinal, resolved)
        checks = _Checks(url, index, digester, first) if index is not None else None
        offsets = index.offsets if index is not None else None
        count = index.num_samples if index is not None else 0
        verified = ordinal if checks is not None else sys.maxsize
        held: list[tuple[dict[str, Any], int, int]] = []
        # Without a rename, a sample goes out when the next group starts, just after that group's check:
        # only a rename can hand one out earlier, so only then is the test below needed.
        holding = checks is not None and rename is not None
        current_key: str | None = None  # current's "__key__" and "__offset__" (read often: kept at hand)
        current_offset = -1
        try:
            for name, offset, data in _members(members):
                if (name[:1] == "_" or not meta_prefix_only) and self._is_meta(name):
                    continue
                # split_key, inline for the common name (no directory, not starting with a dot)
                raw_prefix: str | None
                if "/" not in name:
                    raw_prefix, dot, extension = name.partition(".")
                    if not (dot and raw_prefix):
                        raw_prefix, extension = split_key(name)
                else:
                    slash = name.rfind("/")
                    dot_at = name.find(".", slash + 1)
                    if dot_at > slash + 1:
                        raw_prefix, extension = name[:dot_at], name[dot_at + 1 :]
                    else:
                        raw_prefix, extension = split_key(name)
                if raw_prefix is None:  # no key as written: if a rename gives it one, its sample starts here
                    group_offset = offset
                elif raw_prefix != raw_key:
                    raw_key = raw_prefix
                    ordinal += 1
                    group_offset = offset
                    if offsets is not None:  # the free check: one compare per sample
                        if ordinal >= count or offsets[ordinal] != offset:
                            raise checks.misplaced(ordinal, offset)  # type: ignore[union-attr]
                        if digester is not None and ordinal > first:
                            checks.verify_span(ordinal - 1, offset)  # type: ignore[union-attr]
                        verified = ordinal - 1
                        if held:
                            for sample, next_offset, next_ordinal in held:
                                self.next_offset, self.next_ordinal = next_offset, next_ordinal
                                yield sample
                            held.clear()
                if rename is not None:
                    name = rename(name)
                    prefix, suffix = split_key(name)
                else:
                    prefix, suffix = raw_prefix, extension
                if prefix is None:
                    continue  # no extension: webdataset drops such members
                if select is not None and not select(name):
                    continue
                suffix = suffix.lower()
                if current is None or prefix != current_key:
                    # A sample normally starts where its raw group starts; one that a rename split off
                    # mid-group starts at its own first member (resuming there yields it first).
                    start = group_offset if current is None or current_offset != group_offset else offset
                    number = ordinal if ordinal > 0 else 0  # (-1 before the first keyed member)
                    if current is not None:
                        if not holding or current[ORDINAL_FIELD] <= verified:
                            self.next_offset, self.next_ordinal = start, number
                            yield current
                        else:
                            held.append((current, start, number))
                    current = {"__key__": prefix, "__url__": url, ORDINAL_FIELD: number, OFFSET_FIELD: start}
                    current_key, current_offset = prefix, start
                if suffix in current:
                    error = ValueError(
                        f"{name}: duplicate file name in tar file {suffix} {current.keys()} "
                        f"({url} at byte offset {offset})"
                    )
                    try:
                        skip = self.handler(error)
                    except BaseException:
                        current = None  # (it lacks this member: not handed out, as webdataset's grouping does not)
                        raise
                    if skip:
                        continue
                    self.stopped = True  # as webdataset: a handler that says stop ends the whole stream
                    self.next_offset, self.next_ordinal = offset, max(ordinal, 0)
                    break
                current[suffix] = data
        except Exception as exn:
            # A format error ends the shard; the sample in hand is delivered before the error (with an
            # index: only if its group ends where the index says, i.e. it is whole).
            intact = checks is not None and not isinstance(exn, ShardIntegrityError)
            if intact and checks.closes(ordinal, members.end_offset):  # type: ignore[union-attr]
                verified = ordinal
            if current is not None and current[ORDINAL_FIELD] <= verified:
                for sample, next_offset, next_ordinal in held:
                    self.next_offset, self.next_ordinal = next_offset, next_ordinal
                    yield sample
                self.next_offset, self.next_ordinal = members.end_offset, ordinal + 1
                yield current
            raise
        short = closed = False
        if checks is not None and not self.stopped:  # (a handler's stop: the group in hand is not whole)
            closed = checks.closes(ordinal, members.end_offset)
            short = not closed or ordinal + 1 < count
            # An archive that ends early on zero blocks is a torn copy: the zeros may have begun inside
            # the last sample's payload, which its boundaries cannot show. Only its CRC can clear it.
            if closed and (not short or digester is not None):
                verified = ordinal
        if current is not None and current[ORDINAL_FIELD] <= verified:
            for sample, next_offset, next_ordinal in held:
                self.next_offset, self.next_ordinal = next_offset, next_ordinal
                yield sample
            if not self.stopped:
                self.next_offset, self.next_ordinal = members.end_offset, ordinal + 1
            yield current
        if short:
            raise checks.ends_early(ordinal, members.end_offset, closed)  # type: ignore[union-attr]


class _Checks:
    """A shard read against its index: where samples start and end, and (with a digester) their CRCs."""

    def __init__(self, url: str, index: ShardIndex, digester: SpanDigester | None, first: int):
        self.url = url
        self.index = index
        self.digester = digester
        self.first = first  # the first ordinal this reader reads

    def misplaced(self, ordinal: int, offset: int) -> ShardIntegrityError:
        index = self.index
        if ordinal >= index.num_samples:
            reason = f"a sample beyond the index's {index.num_samples} samples (index ends at byte {index.offsets[-1]})"
        else:
            reason = f"a sample starts here, the index puts sample {ordinal} at byte {index.offsets[ordinal]}"
        return ShardIntegrityError(self.url, offset, reason, ordinal)

    def closes(self, ordinal: int, end: int) -> bool:
        """Whether the group ``ordinal`` (the last one read; ``first - 1`` if none) ends at ``end`` as the
        index says; with a digester, its CRC is checked too (a mismatch raises)."""
        offsets = self.index.offsets
        if ordinal + 1 > self.index.num_samples or offsets[ordinal + 1] != end:
            return False
        if self.digester is not None and ordinal >= self.first:
            self.verify_span(ordinal, end)
        return True

    def verify_span(self, ordinal: int, end: int) -> None:
        assert self.digester is not None and self.index.crc32 is not None
        begin = self.index.offsets[ordinal]
        found = self.digester.digest(begin, end)
        expected = self.index.crc32[ordinal]
        if found != expected:
            raise ShardIntegrityError(
                self.url, begin, f"bytes {begin}:{end} have CRC-32 {found:08x}, the index says {expected:08x}", ordinal
            )

    def ends_early(self, ordinal: int, end: int, closed: bool) -> ShardIntegrityError:
        """The archive ended at ``end`` with group ``ordinal`` the last read: ``closed`` if it ended where
        the index says (then samples are missing after it), else it is cut short."""
        index = self.index
        if closed:
            held = "" if self.digester is not None else f" (sample {ordinal} held back: only verify=True can clear it)"
            reason = (
                f"the archive ends here after {ordinal + 1} samples; the index has {index.num_samples} "
                f"ending at byte {index.offsets[-1]} (a torn or truncated copy?){held}"
            )
            return ShardIntegrityError(self.url, end, reason, ordinal + 1)
        expected = index.offsets[ordinal + 1] if 0 <= ordinal + 1 <= index.num_samples else index.offsets[-1]
        reason = (
            f"the archive ends here, inside this sample; the index has it end at byte {expected} "
            f"and {index.num_samples} samples in all (a torn or truncated copy?)"
        )
        return ShardIntegrityError(self.url, end, reason, max(ordinal, 0))


def _check_size(url: str, index: ShardIndex) -> None:
    """A local shard must have the size its index records (a stat: no read)."""
    path = path_of(url)
    if path is None:
        return
    try:
        size = os.stat(path).st_size
    except OSError:
        return  # (opening it reports the problem)
    if size != index.size:
        raise ShardIntegrityError(url, min(size, index.size), f"the file has {size} bytes, its index says {index.size}")


def tarfile_samples(
    src: Iterable[dict[str, Any]],
    handler: Handler = reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
    verify: bool = False,
) -> Iterator[dict[str, Any]]:
    """Samples from a stream of ``dict(url=...)`` shard descriptions, as webdataset's.

    A description may also hold ``offset`` and ``ordinal`` (from an index or a saved
    state) to start inside the shard; an ``offset`` alone takes its ordinal from the index.
    Shards with an index are checked against it (see :class:`ShardSampleReader`);
    ``verify=True`` checks every sample's digest too.
    """
    for source in src:
        url = source["url"]
        reader = ShardSampleReader(
            url,
            offset=source.get("offset", 0),
            ordinal=source.get("ordinal", None if source.get("offset") else 0),
            handler=handler,
            select_files=select_files,
            rename_files=rename_files,
            verify=verify,
        )
        local_path = source.get("local_path")
        try:
            for sample in reader:
                if local_path is not None:
                    sample["__local_path__"] = local_path
                yield sample
        except Exception as exn:
            if not (exn.args and str(url) in str(exn.args[0])):
                exn.args = (*exn.args, url)
            if handler(exn):
                continue
            break
        if reader.stopped:
            break
