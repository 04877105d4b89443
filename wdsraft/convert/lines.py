"""Reading lines: the lines of one input, decompressed on the fly, in batches; a truncated or corrupt
stream is reported after the last whole line before the damage (with the input's line number).
"""

from __future__ import annotations

import contextlib
import lzma
import zlib
from collections.abc import Callable, Iterator

import zstandard

from wdsraft.convert.inputs import InputFile
from wdsraft.convert.options import ConvertError
from wdsraft.io.compression import decompressor, sniff_compression
from wdsraft.io.gopen import gopen

_UTF8_BOM = b"\xef\xbb\xbf"


class _StreamDamaged(Exception):
    """The compressed stream is cut short or corrupt; nothing after this point can be read.
    ``decoded``: what the last feed decoded before the damage (whole lines in it are good)."""

    def __init__(self, message: str, decoded: bytes = b""):
        super().__init__(message)
        self.decoded = decoded


class _Decoder:
    """Decompresses a stream chunk by chunk, across concatenated members/frames, and notices a stream
    that ends inside one (a truncated file), which the stdlib readers of zstd do not."""

    def __init__(self, kind: str):
        self.kind = kind
        self._decoder = decompressor(kind)
        self._open = False  # fed bytes of a member/frame not yet ended
        self._member_ended = False  # a member/frame ended, and no byte of another came since

    # A failing decompress() call loses what it decoded. Members/frames that ended before the damage
    # are kept for every format; where the decoder can be copied (gzip), the failing piece is re-fed
    # byte by byte from a copy taken before it, up to the damaged byte. (One copy per 64 KiB piece:
    # smaller pieces cost a few percent of conversion speed.)
    PIECE = 1 << 16

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for start in range(0, len(data), self.PIECE):
            piece = data[start : start + self.PIECE]
            copy = getattr(self._decoder, "copy", None)
            before = (copy(), self._open, self._member_ended, len(out)) if copy is not None else None
            try:
                self._feed(piece, out)
            except _StreamDamaged as exn:
                if before is not None:
                    self._decoder, self._open, self._member_ended, kept = before
                    del out[kept:]
                    with contextlib.suppress(_StreamDamaged):
                        for offset in range(len(piece)):
                            self._feed(piece[offset : offset + 1], out)
                raise _StreamDamaged(str(exn), b"".join(out)) from None
        return b"".join(out)

    def _feed(self, data: bytes, out: list[bytes]) -> None:
        try:
            if self._member_ended:  # (zero padding after a member may run on over the next pieces)
                data = data.lstrip(b"\0")
            while data:
                self._open, self._member_ended = True, False
                out.append(self._decoder.decompress(data))
                if not self._decoder.eof:
                    break
                # Zero padding after a member (tape-style gzip) is skipped, as Python's gzip skips it, and so
                # is what follows it: more padding, or the next member.
                data = self._decoder.unused_data.lstrip(b"\0")
                self._decoder = decompressor(self.kind)
                self._open, self._member_ended = False, True
        except (zlib.error, zstandard.ZstdError, OSError, EOFError, lzma.LZMAError, ValueError) as exn:
            raise _StreamDamaged(f"corrupt {self.kind} data ({exn})") from None

    def finish(self) -> None:
        if self._open:
            raise _StreamDamaged(f"the {self.kind} stream ends early (truncated file?)")


class InputDamaged(Exception):
    """Raised by :class:`LineReader` after the last whole line before damage."""

    def __init__(self, line: int, partial: bytes, reason: str):
        super().__init__(reason)
        self.line = line
        self.partial = partial
        self.reason = reason


class LineReader:
    """The lines of one input file, decompressed, in batches with the 1-based number of their first line.

    Compression is recognised by the magic bytes (else the name). A stream that is truncated or
    corrupt raises :class:`InputDamaged` after the last whole line, with the bytes of the partial
    line. ``advance(n)`` is called with the stored bytes consumed (for progress).
    """

    # Small enough that a chunk and the copies made while splitting it into lines stay a few MB.
    PLAIN_CHUNK = 1 << 19
    COMPRESSED_CHUNK = 1 << 16  # compressed input expands several times

    def __init__(self, source: InputFile, advance: Callable[[int], None] | None = None):
        self.source = source
        self.advance = advance or (lambda n: None)
        self.bytes_out = 0  # decompressed bytes read
        self.window = 0  # bytes the decompressor keeps (zstd's window: up to 8 MB usually, 128 MB with --long)

    def batches(self) -> Iterator[tuple[int, list[bytes]]]:
        line = 1
        parts: list[bytes] = []  # the line being assembled (a long line can span many chunks)
        damage: str | None = None
        try:
            stream = gopen(self.source.url, "rb")
        except FileNotFoundError:
            raise ConvertError(f"input not found: {self.source.url}") from None
        with contextlib.closing(stream):
            head = stream.read(18)  # enough for the compression's magic and a zstd frame header
            kind = sniff_compression(head) or self.source.compression
            if kind == "zstd":
                with contextlib.suppress(zstandard.ZstdError):
                    self.window = zstandard.get_frame_parameters(head).window_size
            decoder = _Decoder(kind) if kind else None
            chunk_size = self.COMPRESSED_CHUNK if decoder else self.PLAIN_CHUNK
            pending, first, pending_head = head, True, b""
            while damage is None:
                raw = pending or stream.read(chunk_size)
                pending = b""
                if not raw:
                    break
                self.advance(len(raw))
                try:
                    data = decoder.feed(raw) if decoder else raw
                except _StreamDamaged as exn:  # (the whole lines decoded before the damage still count)
                    damage, data = str(exn), exn.decoded
                if not data:
                    continue
                if first:
                    data, pending_head = pending_head + data, b""
                    if len(data) < len(_UTF8_BOM) and _UTF8_BOM.startswith(data) and damage is None:
                        pending_head = data  # (a decoder may hand out the first bytes a few at a time)
                        continue
                    data = data[len(_UTF8_BOM) :] if data.startswith(_UTF8_BOM) else data
                    first = False
                self.bytes_out += len(data)
                end = data.rfind(b"\n")
                if end < 0:
                    parts.append(data)
                    continue
                block = data[:end] if not parts else b"".join(parts) + data[:end]
                parts = [data[end + 1 :]] if end + 1 < len(data) else []
                lines = block.split(b"\n")
                yield line, lines
                line += len(lines)
            if decoder is not None and damage is None:
                try:
                    decoder.finish()
                except _StreamDamaged as exn:
                    damage = str(exn)
        tail = pending_head + b"".join(parts)  # (pending_head: a file of one or two BOM bytes, held back)
        if damage is not None:
            raise InputDamaged(line, tail, damage)
        if tail:
            yield line, [tail]
