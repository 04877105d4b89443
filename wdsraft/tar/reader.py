"""Tar shards to samples, with webdataset's grouping rules and a position on every sample.

``tarfile_samples`` is a drop-in for webdataset's: same arguments, same grouping (key =
path up to the first dot of the basename, lower-cased extension, only adjacent members
grouped, a repeated extension is an error), same handler protocol. Each sample also
carries ``__ordinal__`` and ``__offset__`` (see :mod:`wdsraft.core.fields`), and a
reader can start at any sample's offset.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from webdataset.handlers import reraise_exception

from wdsraft.core.fields import OFFSET_FIELD, ORDINAL_FIELD
from wdsraft.io.gopen import open_shard
from wdsraft.tar.format import TarMember
from wdsraft.tar.members import TarMemberReader
from wdsraft.tar.naming import DEFAULT_SKIP_META, split_key

logger = logging.getLogger(__name__)


Handler = Callable[[BaseException], bool]


def _members(reader: TarMemberReader) -> Iterator[TarMember]:
    for batch in reader.batches():
        yield from batch


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
    """

    def __init__(
        self,
        url: str,
        *,
        offset: int = 0,
        ordinal: int = 0,
        handler: Handler = reraise_exception,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        skip_meta: str | None = DEFAULT_SKIP_META,
        stream: IO[bytes] | None = None,
        block_size: int = 1 << 20,
    ):
        self.url = url
        self.handler = handler
        self.select_files = select_files
        self.rename_files = rename_files
        self.skip_meta = re.compile(skip_meta) if skip_meta is not None else None
        self.block_size = block_size
        self._stream = stream
        self.start_offset = offset
        self.next_offset = offset
        self.next_ordinal = ordinal
        #: True once the whole shard has been read.
        self.exhausted = False
        #: True when the handler asked to stop everything (not just this shard).
        self.stopped = False

    def _is_meta(self, name: str) -> bool:
        if "/" not in name and name.startswith("__") and name.endswith("__"):  # webdataset's __meta__ files
            return True
        return self.skip_meta is not None and self.skip_meta.match(name) is not None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        stream = self._stream if self._stream is not None else open_shard(self.url, self.start_offset)
        try:
            members = TarMemberReader(stream, self.url, self.start_offset, self.block_size)
            yield from self._group(members)
            if not self.stopped:
                self.next_offset = members.end_offset
                self.exhausted = True
        finally:
            if self._stream is None:  # close only what we opened
                stream.close()

    def _group(self, members: TarMemberReader) -> Iterator[dict[str, Any]]:
        url = self.url
        rename, select = self.rename_files, self.select_files
        # The default pattern only matches names starting with "__": test that first, it is the hot loop.
        meta_prefix_only = self.skip_meta is None or self.skip_meta.pattern == DEFAULT_SKIP_META
        ordinal = self.next_ordinal - 1
        raw_key: str | None = None  # the key before renaming: ordinals follow the shard as written
        group_offset = self.start_offset
        current: dict[str, Any] | None = None
        try:
            for name, offset, data in _members(members):
                if (name[:2] == "__" or not meta_prefix_only) and self._is_meta(name):
                    continue
                raw_prefix, _ = split_key(name)
                if raw_prefix is None:  # no key as written: if a rename gives it one, its sample starts here
                    group_offset = offset
                elif raw_prefix != raw_key:
                    raw_key = raw_prefix
                    ordinal += 1
                    group_offset = offset
                if rename is not None:
                    name = rename(name)
                prefix, suffix = split_key(name) if rename is not None else (raw_prefix, _)
                if prefix is None:
                    continue  # no extension: webdataset drops such members
                if select is not None and not select(name):
                    continue
                suffix = suffix.lower()
                if current is None or prefix != current["__key__"]:
                    # A sample normally starts where its raw group starts; one that a rename split off
                    # mid-group starts at its own first member (resuming there yields it first).
                    start = group_offset if current is None or current[OFFSET_FIELD] != group_offset else offset
                    if current is not None:
                        self.next_offset, self.next_ordinal = start, max(ordinal, 0)
                        yield current
                    current = {"__key__": prefix, "__url__": url, ORDINAL_FIELD: max(ordinal, 0), OFFSET_FIELD: start}
                if suffix in current:
                    error = ValueError(
                        f"{name}: duplicate file name in tar file {suffix} {current.keys()} "
                        f"({url} at byte offset {offset})"
                    )
                    if self.handler(error):
                        continue
                    self.stopped = True  # as webdataset: a handler that says stop ends the whole stream
                    self.next_offset, self.next_ordinal = offset, max(ordinal, 0)
                    break
                current[suffix] = data
        except Exception:
            # A format error ends the shard; the sample in hand is delivered before the error.
            if current is not None:
                self.next_offset, self.next_ordinal = members.end_offset, ordinal + 1
                yield current
            raise
        if current is not None:
            if not self.stopped:
                self.next_offset, self.next_ordinal = members.end_offset, ordinal + 1
            yield current


def tarfile_samples(
    src: Iterable[dict[str, Any]],
    handler: Handler = reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Samples from a stream of ``dict(url=...)`` shard descriptions, as webdataset's.

    A description may also hold ``offset`` and ``ordinal`` (from an index or a saved
    state) to start inside the shard.
    """
    for source in src:
        url = source["url"]
        reader = ShardSampleReader(
            url,
            offset=source.get("offset", 0),
            ordinal=source.get("ordinal", 0),
            handler=handler,
            select_files=select_files,
            rename_files=rename_files,
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
