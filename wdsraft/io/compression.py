"""Compressed streams: recognise gzip, bz2, xz and zstd by their first bytes and decompress on the fly."""

from __future__ import annotations

import bz2
import gzip
import logging
import lzma
import zlib
from typing import IO, Any, cast

logger = logging.getLogger(__name__)


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


def decompressor(kind: str) -> Any:
    """An incremental decompressor of one gzip member, zstd frame, bz2 or xz stream, for a caller that
    feeds the bytes itself: ``decompress(data)``, then ``eof`` and ``unused_data`` at the member's end
    (and ``copy()`` for gzip)."""
    if kind == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if kind == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj()
    if kind == "bz2":
        return bz2.BZ2Decompressor()
    if kind == "xz":
        return lzma.LZMADecompressor()
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

    def __enter__(self) -> PrefixedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def uncompressed(raw: IO[bytes]) -> tuple[IO[bytes], str | None]:
    """The tar stream inside ``raw`` (decompressed if its first bytes say it is compressed) and the
    compression found. Reads those first bytes; the stream returned still starts with them."""
    head = _read_head(raw)
    kind = sniff_compression(head)
    stream: IO[bytes] = cast(IO[bytes], PrefixedStream(head, raw))
    return (decompress_stream(kind, stream) if kind is not None else stream), kind
