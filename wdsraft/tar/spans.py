"""Per-sample digests of a tar stream as it is read: a pass-through stream that keeps the bytes
read but not yet digested, so a sample's span can be digested once the reader has seen where it
ends (the reader reads ahead of the samples it hands out, so the span is always read by then).
"""

from __future__ import annotations

from collections import deque
from typing import IO

from wdsraft.index.shard_index import span_digest


class SpanDigester:
    """Wraps an uncompressed tar stream positioned at ``start``; ``digest(begin, end)`` returns the
    digest of bytes ``begin:end`` (absolute offsets), which must follow the previous span's
    (spans go forward; bytes before ``begin`` are dropped). Holds at most what the reader has read
    ahead of the sample being digested (a read block, or one large member)."""

    def __init__(self, stream: IO[bytes], start: int):
        self._stream = stream
        self._chunks: deque[memoryview] = deque()
        self._first = start  # offset of the first byte held
        self._read_to = start  # offset just past the last byte read

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read(n)
        if data:
            self._chunks.append(memoryview(data))
            self._read_to += len(data)
        return data

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._stream.close()

    @property
    def read_to(self) -> int:
        """Offset just past the last byte read."""
        return self._read_to

    def held(self) -> bytes:
        """The bytes read but not yet digested or dropped."""
        return b"".join(self._chunks)

    def digest(self, begin: int, end: int) -> int:
        if begin < self._first or end > self._read_to:
            raise ValueError(f"span {begin}:{end} not held (held {self._first}:{self._read_to})")
        self._drop(begin)
        running = 0
        position = self._first
        for chunk in self._chunks:
            if position >= end:
                break
            running = span_digest(chunk[: end - position], running)
            position += len(chunk)
        self._drop(end)
        return running

    def _drop(self, offset: int) -> None:
        """Forget the bytes before ``offset``."""
        chunks = self._chunks
        while chunks and self._first + len(chunks[0]) <= offset:
            self._first += len(chunks.popleft())
        if chunks and self._first < offset:
            chunks[0] = chunks[0][offset - self._first :]
            self._first = offset
