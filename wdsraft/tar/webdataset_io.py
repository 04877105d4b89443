"""webdataset's low-level reading functions (``url_opener``, ``tar_file_iterator``,
``tar_file_expander``) over wdsraft's opener and member reader, for pipelines that build their own
reader from webdataset's pieces.

They carry provenance: ``url_opener`` honours a shard dict's ``offset`` (and notes where it opened),
``tar_file_iterator`` adds each member's byte offset (``__offset__``), and ``tar_file_expander`` tells a
listener on this thread (``listen_to_members``) each member it hands out and each shard it finishes, so
that a pipeline around a client's own grouper can find where each of its samples starts.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, Protocol

from webdataset.handlers import reraise_exception

from wdsraft.core.fields import OFFSET_FIELD
from wdsraft.io.compression import uncompressed
from wdsraft.io.gopen import open_shard
from wdsraft.tar.members import TarMemberReader
from wdsraft.tar.naming import DEFAULT_SKIP_META

logger = logging.getLogger(__name__)


Handler = Callable[[BaseException], bool]

#: The key under which ``url_opener`` notes the byte offset it opened a shard at.
OPENED_AT = "__opened_at__"


class MemberListener(Protocol):
    """Told, on the thread that reads, what ``tar_file_expander`` hands out."""

    def member(self, url: str, name: str, offset: int) -> None: ...

    def shard_end(self, url: str) -> None: ...


class _Listening(threading.local):
    listener: MemberListener | None = None


_listening = _Listening()


def listen_to_members(listener: MemberListener | None) -> MemberListener | None:
    """Make ``listener`` the one told about members on this thread; returns the one before (to put back)."""
    previous, _listening.listener = _listening.listener, listener
    return previous


def url_opener(
    data: Iterable[dict[str, Any]], handler: Handler = reraise_exception, **kw: Any
) -> Iterator[dict[str, Any]]:
    """Open each ``dict(url=..., offset=...)`` and add the stream, as webdataset's ``url_opener``."""
    for sample in data:
        url = sample["url"]
        try:
            offset = sample.get("offset", 0)
            sample.update(stream=open_shard(url, offset))
            sample[OPENED_AT] = offset
        except Exception as exn:
            exn.args = (*exn.args, url)
            if handler(exn):
                continue
            break
        yield sample


def tar_file_iterator(
    fileobj: IO[bytes],
    skip_meta: str | None = DEFAULT_SKIP_META,
    handler: Handler = reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
    url: str | None = None,
    offset: int = 0,
) -> Iterator[dict[str, Any]]:
    """Yield ``dict(fname=..., data=..., __offset__=...)`` for each regular file, as webdataset's."""
    is_meta = re.compile(skip_meta).match if skip_meta is not None else None
    stream, _ = uncompressed(fileobj)  # (a compressed tar stream too, as tarfile's "r|*" reads it)
    for name, member_offset, data in TarMemberReader(stream, url or str(fileobj), offset):
        try:
            if "/" not in name and name.startswith("__") and name.endswith("__"):
                continue
            if is_meta is not None and is_meta(name):
                continue
            if rename_files:
                name = rename_files(name)
            if select_files is not None and not select_files(name):
                continue
            yield {"fname": name, "data": data, OFFSET_FIELD: member_offset}
        except Exception as exn:
            if handler(exn):
                continue
            break


def tar_file_expander(
    data: Iterable[dict[str, Any]],
    handler: Handler = reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
    eof_value: Any = {},  # noqa: B006 - webdataset's sentinel: group_by_keys ends a sample on it
) -> Iterator[dict[str, Any]]:
    """Expand opened shards into their files, as webdataset's ``tar_file_expander``."""
    for source in data:
        url = source["url"]
        local_path = source.get("local_path")
        try:
            for sample in tar_file_iterator(
                source["stream"],
                handler=handler,
                select_files=select_files,
                rename_files=rename_files,
                url=url,
                offset=source.get(OPENED_AT, 0),  # (a stream another opener made starts at the shard's start)
            ):
                sample["__url__"] = url
                if local_path is not None:
                    sample["__local_path__"] = local_path
                listener = _listening.listener
                if listener is not None:
                    listener.member(url, sample["fname"], sample[OFFSET_FIELD])
                yield sample
            _shard_end(url)
            if eof_value is not None:
                yield eof_value
        except Exception as exn:
            _shard_end(url)  # (nothing more is read from it)
            exn.args = (*exn.args, source.get("stream"), url)
            if handler(exn):
                continue
            break


def _shard_end(url: str) -> None:
    listener = _listening.listener
    if listener is not None:
        listener.shard_end(url)
