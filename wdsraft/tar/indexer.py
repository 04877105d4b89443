"""Build a shard's index in one pass over it (``wdsraft index`` and ``wds.build_index``)."""

from __future__ import annotations

import hashlib
import posixpath
from array import array
from typing import IO, cast
from urllib.parse import urlparse

from wdsraft.core.errors import ShardIntegrityError
from wdsraft.core.fields import OFFSET_FIELD
from wdsraft.index.shard_index import ShardIndex
from wdsraft.io.compression import uncompressed
from wdsraft.io.gopen import gopen
from wdsraft.tar.format import BLOCK, RECORD
from wdsraft.tar.reader import ShardSampleReader
from wdsraft.tar.spans import SpanDigester

# Blocking factors whose record padding is taken as padding, not as a torn tail: tar's default (20
# blocks: 10240 bytes) and powers of two up to ``tar -b 4096`` (2 MiB records).
BLOCKING_FACTORS = (20, *(1 << k for k in range(13)))


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


def build_index(url: str, checksum: bool = True, strict: bool = True) -> ShardIndex:
    """Read a shard once and return its index (offsets, per-sample CRC-32, size, sha256 of the stored bytes).

    ``strict`` (the default) refuses a shard whose archive ends early and is followed by zeros well
    past tar's end-of-archive padding: the mark of a torn copy (a file preallocated with zeros and
    filled in part), which would otherwise be indexed as a shorter, valid shard.
    """
    hashing = _HashingReader(gopen(url, "rb"), hashing=checksum)
    try:
        stream, compression = uncompressed(cast(IO[bytes], hashing))
        digester = SpanDigester(stream, 0)
        reader = ShardSampleReader(url, stream=cast(IO[bytes], digester))  # (metadata members skipped, as all readers)
        offsets, crcs = array("Q"), array("I")
        for sample in reader:  # digest each span as soon as the next sample begins: memory stays bounded
            if offsets:
                crcs.append(digester.digest(offsets[-1], sample[OFFSET_FIELD]))
            offsets.append(sample[OFFSET_FIELD])
        end = reader.next_offset
        if offsets:
            crcs.append(digester.digest(offsets[-1], end))
        offsets.append(end)
        tail, zeros = _tail(digester, end)
        if strict and zeros and not _record_padding(end, tail):
            raise ShardIntegrityError(
                url,
                end,
                f"the archive ends here after {len(offsets) - 1} samples but {tail} zero bytes follow, far more "
                "than tar's end-of-archive padding: a torn copy? (index it anyway with `wdsraft index --force`)",
            )
        while hashing.read(1 << 22):  # whatever follows the uncompressed stream still belongs to the file
            pass
    finally:
        hashing.close()
    sha256 = hashing.digest.hexdigest() if hashing.digest is not None else None
    name = posixpath.basename(urlparse(url).path or url)
    return ShardIndex(name, offsets, hashing.count, sha256, compression, crc32=crcs)


def _tail(digester: SpanDigester, end: int) -> tuple[int, bool]:
    """Bytes of the uncompressed stream from ``end`` (where the archive ends) to its end, and whether
    they are all zero."""
    digester.digest(end, end)  # drop what precedes the end blocks
    held = digester.held()
    length = len(held)
    zeros = not held.strip(b"\0")
    while chunk := digester.read(1 << 22):
        length += len(chunk)
        zeros = zeros and not chunk.strip(b"\0")
        digester.digest(digester.read_to, digester.read_to)  # keep nothing
    return length, zeros


def _record_padding(end: int, tail: int) -> bool:
    """Whether ``tail`` bytes after the archive's end are the end blocks plus padding to a whole record
    of a usual blocking factor (a record longer than the padding, the file a whole number of them)."""
    if tail <= 2 * BLOCK + RECORD:
        return True
    total = end + tail
    if total % BLOCK:
        return False
    blocks = total // BLOCK
    return any(blocks % factor == 0 and factor * BLOCK > tail - 2 * BLOCK for factor in BLOCKING_FACTORS)
