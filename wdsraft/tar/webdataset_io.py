"""webdataset's low-level reading functions (``url_opener``, ``tar_file_iterator``,
``tar_file_expander``) over wdsraft's opener and member reader, for pipelines that build their own
reader from webdataset's pieces.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from webdataset.handlers import reraise_exception

from wdsraft.core.fields import OFFSET_FIELD
from wdsraft.io.compression import uncompressed
from wdsraft.io.gopen import open_shard
from wdsraft.tar.members import TarMemberReader
from wdsraft.tar.naming import DEFAULT_SKIP_META

logger = logging.getLogger(__name__)


Handler = Callable[[BaseException], bool]


def url_opener(
    data: Iterable[dict[str, Any]], handler: Handler = reraise_exception, **kw: Any
) -> Iterator[dict[str, Any]]:
    """Open each ``dict(url=..., offset=...)`` and add the stream, as webdataset's ``url_opener``."""
    for sample in data:
        url = sample["url"]
        try:
            sample.update(stream=open_shard(url, sample.get("offset", 0)))
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
        try:
            for sample in tar_file_iterator(
                source["stream"],
                handler=handler,
                select_files=select_files,
                rename_files=rename_files,
                url=url,
                offset=source.get("offset", 0),
            ):
                sample["__url__"] = url
                yield sample
            if eof_value is not None:
                yield eof_value
        except Exception as exn:
            exn.args = (*exn.args, source.get("stream"), url)
            if handler(exn):
                continue
            break
