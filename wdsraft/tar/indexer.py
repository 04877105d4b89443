"""Build a shard's index in one pass over it (``wdsraft index`` and ``wds.build_index``)."""

from __future__ import annotations

import hashlib
import posixpath
from array import array
from typing import IO, cast
from urllib.parse import urlparse

from wdsraft.core.fields import OFFSET_FIELD
from wdsraft.index.shard_index import ShardIndex
from wdsraft.io.compression import uncompressed
from wdsraft.io.gopen import gopen
from wdsraft.tar.reader import ShardSampleReader


class _HashingReader:
    """Passes reads through, counting and (unless told not to) hashing every byte (sha256 of the stored shard)."""

    def __init__(self, stream: IO[bytes], hashing: bool = True):
        self._stream = stream
        self.digest = hashlib.sha256() if hashing else None
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read(n)
        if self.digest is not None:
            self.digest.update(data)
        self.count += len(data)
        return data

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._stream.close()


def build_index(url: str, checksum: bool = True) -> ShardIndex:
    """Read a shard once and return its index (offsets, size, sha256 of the stored bytes)."""
    hashing = _HashingReader(gopen(url, "rb"), hashing=checksum)
    try:
        stream, compression = uncompressed(cast(IO[bytes], hashing))
        reader = ShardSampleReader(url, stream=stream)  # (metadata members skipped, as every reader does)
        offsets = array("Q", (sample[OFFSET_FIELD] for sample in reader))
        offsets.append(reader.next_offset)
        while hashing.read(1 << 22):  # whatever follows the end blocks still belongs to the file
            pass
    finally:
        hashing.close()
    sha256 = hashing.digest.hexdigest() if hashing.digest is not None else None
    return ShardIndex(posixpath.basename(urlparse(url).path or url), offsets, hashing.count, sha256, compression)
