"""Writing shards: webdataset's ``TarWriter``/``ShardWriter`` with atomic files and an index.

Same arguments and defaults as webdataset 1.0.2, and the output reads the same with
webdataset, GNU tar and wdsraft. In addition:

- a shard written to a path appears under its final name only when complete
  (temporary name, fsync, rename); an exception inside ``with TarWriter(...)`` leaves
  nothing behind;
- the index (sample offsets, size, sha256) is recorded while writing and saved beside
  the shard as ``SHARD.idx``; ``ShardWriter`` also writes the dataset ``manifest.json``.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import logging
import lzma
import os
import posixpath
import tarfile
import time
from array import array
from collections.abc import Callable
from typing import IO, Any, cast

from webdataset.writer import make_encoder

from wdsraft.index.manifest import MANIFEST_NAME, manifest_for
from wdsraft.index.shard_index import ShardIndex, span_digest
from wdsraft.io.storage import abort_write, is_s3, local_path, open_atomic
from wdsraft.tar.format import HeaderBuilder, end_of_archive, member_padding
from wdsraft.tar.naming import is_meta_member, split_key

logger = logging.getLogger(__name__)


class _CountingSink:
    """The stored byte stream of a shard: counts and hashes what reaches the file."""

    def __init__(self, stream: IO[bytes]):
        self.stream = stream
        self.count = 0
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.count += len(data)
        self.stream.write(data)
        return len(data)

    def flush(self) -> None:
        flush = getattr(self.stream, "flush", None)  # webdataset's Pipe has none
        if flush is not None:
            flush()

    def close(self) -> None:
        self.stream.close()


def _compression(fileobj: Any, compress: bool | str | None) -> str | None:
    """webdataset's rule: an explicit ``compress``, else the file name's suffix."""
    name = fileobj if isinstance(fileobj, str) else ""
    if compress is False:
        return None
    if compress is True or compress == "gz" or name.endswith("gz"):
        return "gzip"
    if compress == "bz2" or name.endswith("bz2"):
        return "bz2"
    if compress == "xz" or name.endswith("xz"):
        return "xz"
    return None


def _compressor(kind: str | None, sink: _CountingSink) -> IO[bytes]:
    stream = cast(IO[bytes], sink)
    if kind == "gzip":
        return cast(IO[bytes], gzip.GzipFile(fileobj=stream, mode="wb", mtime=0))
    if kind == "bz2":
        return cast(IO[bytes], bz2.BZ2File(stream, mode="wb"))
    if kind == "xz":
        return cast(IO[bytes], lzma.LZMAFile(stream, mode="wb"))
    return stream


class TarWriter:
    """Write samples (dicts with ``__key__``) to one tar shard, as webdataset's ``TarWriter``.

    ``fileobj`` is a URL/path (local, ``file:``, ``s3://``, ``pipe:``...) or an open binary
    stream. With a local path the shard is written atomically and, unless ``index=False``,
    its index is saved beside it on ``close``. ``self.index`` holds the index either way.
    """

    def __init__(
        self,
        fileobj: Any,
        user: str = "bigdata",
        group: str = "bigdata",
        mode: int = 0o0444,
        compress: bool | str | None = None,
        encoder: Any = True,
        keep_meta: bool = False,
        mtime: float | None = None,
        format: Any = None,
        *,
        index: bool = True,
        fsync: bool = True,
    ):
        # webdataset 1.0.2 never passes `format` on to tarfile, so its shards are PAX: plain ustar
        # headers, plus a PAX record only where a name or number needs one. That is our default too;
        # an explicit `format` is honoured. Integer mtimes keep tarfile from adding a PAX mtime
        # record to every member (webdataset's float mtimes cost about a third more bytes).
        if format is None:
            tar_format = tarfile.PAX_FORMAT
        else:  # a tarfile constant, or its name ("GNU_FORMAT")
            tar_format = getattr(tarfile, format) if isinstance(format, str) else format
        self.url: str | None = fileobj if isinstance(fileobj, str) else None
        self.compression = _compression(fileobj, compress)
        # An index goes beside shards stored as files or objects, not beside pipe: commands.
        self.save_index = index and self.url is not None and (local_path(self.url) is not None or is_s3(self.url))
        self.encoder = make_encoder(encoder)
        self.keep_meta = keep_meta
        self.mtime = mtime
        self.headers = HeaderBuilder(user, group, mode, tar_format)
        raw = open_atomic(self.url, fsync=fsync) if self.url is not None else fileobj
        self._owns_stream = self.url is not None
        self._sink = _CountingSink(raw)
        self.stream = _compressor(self.compression, self._sink)
        self._offset = 0  # uncompressed bytes written so far
        self._offsets = array("Q")
        self._crcs = array("I")  # per-sample CRC-32 of the uncompressed bytes, one per finished sample
        self._crc = 0  # running CRC-32 of the sample being written
        self._last_key: str | None = None  # the key a reader sees for the last member written
        self.index: ShardIndex | None = None
        self._closed = False

    def __enter__(self) -> TarWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _emit(self, data: bytes) -> None:
        self.stream.write(data)
        self._offset += len(data)
        self._crc = span_digest(data, self._crc)

    def write(self, obj: dict[str, Any]) -> int:
        """Write one sample; returns the number of payload bytes written (as webdataset)."""
        obj = self.encoder(obj)
        if "__key__" not in obj:
            raise ValueError("object must contain a __key__")
        for k, v in obj.items():
            if k[0] == "_":
                continue
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise ValueError(f"{k} doesn't map to a bytes after encoding ({type(v)})")
        key = obj["__key__"]
        total = 0
        for k in sorted(obj.keys()):
            if k == "__key__" or (not self.keep_meta and k[0] == "_"):
                continue
            value = obj[k]
            if isinstance(value, str):
                value = value.encode("utf-8")
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise ValueError(f"converter didn't yield bytes: {k}, {type(value)}")
            value = bytes(value)  # a memoryview's len() counts items, not bytes
            name = f"{key}.{k}"
            self._note_sample_start(name)
            size = len(value)
            mtime = self.mtime if self.mtime is not None else time.time()
            self._emit(self.headers.build(name, size, int(mtime)))
            self._emit(value)
            self._emit(member_padding(size))
            total += size
        return total

    def _note_sample_start(self, name: str) -> None:
        """Record an index entry where a reader will see a new sample begin (which is not always
        where a write() begins: an empty sample writes nothing, and keys with dots merge)."""
        if is_meta_member(name):
            return
        reader_key, _ = split_key(name)
        if reader_key is None or reader_key == self._last_key:
            return
        self._last_key = reader_key
        if self._offsets:  # the previous sample's span ends here (bytes before the first sample have none)
            self._crcs.append(self._crc)
        self._crc = 0
        self._offsets.append(self._offset)

    def close(self) -> None:
        """Finish the archive, commit the file, save the index."""
        if self._closed:
            return
        self._closed = True
        end = self._offset
        crcs = array("I", self._crcs)
        if self._offsets:
            crcs.append(self._crc)
        self._emit(end_of_archive(self._offset))
        if self.stream is not self._sink:
            self.stream.close()  # flushes the compressor into the sink (GzipFile leaves the sink open)
        self._sink.flush()
        if self._owns_stream:
            self._sink.close()
        offsets = array("Q", self._offsets)
        offsets.append(end)
        name = posixpath.basename(self.url) if self.url else ""
        self.index = ShardIndex(
            name, offsets, self._sink.count, self._sink.digest.hexdigest(), self.compression, crc32=crcs
        )
        if self.save_index and self.url is not None:
            self.index.save(self.url)

    def abort(self) -> None:
        """Give up on this shard: nothing appears under the final name."""
        if self._closed:
            return
        self._closed = True
        stream = self._sink.stream
        if not abort_write(stream) and self._owns_stream:
            self._sink.close()

    @staticmethod
    def tarmode(fileobj: Any, compress: bool | str | None = None) -> str:
        """webdataset's mode string for the same arguments (kept for code that calls it)."""
        kind = _compression(fileobj, compress)
        return {"gzip": "w|gz", "bz2": "w|bz2", "xz": "w|xz"}.get(kind or "", "w|")


class ShardWriter:
    """Write samples into numbered shards, as webdataset's ``ShardWriter``.

    A new shard starts when the current one holds ``maxcount`` samples or ``maxsize``
    payload bytes. ``post(fname)`` runs after each shard is committed. Unless
    ``manifest=None``, ``close`` writes ``manifest.json`` (or the path given) listing the
    shards this writer produced; with ``opener``, the writer cannot know where shards
    land, so no index or manifest is written.
    """

    def __init__(
        self,
        pattern: str,
        maxcount: int = 100000,
        maxsize: float = 3e9,
        post: Callable[[str], Any] | None = None,
        start_shard: int = 0,
        verbose: int = 1,
        opener: Callable[[str], Any] | None = None,
        *,
        manifest: str | None = "auto",
        **kw: Any,
    ):
        self.verbose = verbose
        self.kw = kw
        self.maxcount = maxcount
        self.maxsize = maxsize
        self.post = post
        self.tarstream: TarWriter | None = None
        self.shard = start_shard
        self.pattern = pattern
        self.total = 0
        self.count = 0
        self.size = 0
        self.fname: str | None = None
        self.opener = opener
        self.written: list[tuple[str, ShardIndex]] = []
        directory = posixpath.dirname(pattern)
        if manifest == "auto":
            manifest = posixpath.join(directory, MANIFEST_NAME) if opener is None else None
        self.manifest_url = manifest
        self._directory = directory
        self.next_stream()

    def next_stream(self) -> None:
        """Close the current shard and start the next one."""
        self.finish()
        self.fname = self.pattern % self.shard
        if self.verbose:
            logger.info("# writing %s %d %.1f GB %d", self.fname, self.count, self.size / 1e9, self.total)
        self.shard += 1
        target = self.opener(self.fname) if self.opener else self.fname
        self.tarstream = TarWriter(target, **self.kw)
        self.count = 0
        self.size = 0

    def write(self, obj: dict[str, Any]) -> None:
        if self.tarstream is None or self.count >= self.maxcount or self.size >= self.maxsize:
            self.next_stream()
        assert self.tarstream is not None
        size = self.tarstream.write(obj)
        self.count += 1
        self.total += 1
        self.size += size

    def finish(self) -> None:
        """Commit the current shard (use ``close`` at the end)."""
        if self.tarstream is None:
            return
        self.tarstream.close()
        assert self.fname is not None and self.tarstream.index is not None
        self.written.append((self.fname, self.tarstream.index))
        if callable(self.post):
            self.post(self.fname)
        self.tarstream = None

    def close(self) -> None:
        """Commit the last shard and write the manifest."""
        self.finish()
        if self.manifest_url:
            name = posixpath.basename(os.path.splitext(self.pattern)[0]).split("%")[0].rstrip("-_.") or "dataset"
            manifest_for(self._directory, self.written, name).save(self.manifest_url)

    def abort(self) -> None:
        """Drop the shard in progress (committed shards stay)."""
        if self.tarstream is not None:
            self.tarstream.abort()
            self.tarstream = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
