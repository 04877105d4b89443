"""Per-shard indexes (``SHARD.idx`` beside ``SHARD``, msgpack): the sample count, the byte
offset of every sample's first header (plus one entry for the end of the last sample, so
sample ``i`` spans ``offsets[i]:offsets[i+1]``), the shard's size and sha256, and (since
wdsraft writes them) a CRC-32 of each sample's span. They make epoch lengths exact, seeking
to a sample O(1), and let readers check a shard as they go. Plain data: reading one never runs code.
"""

from __future__ import annotations

import bisect
import logging
import sys
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from wdsraft.core.errors import IndexFormatError
from wdsraft.io.gopen import gopen
from wdsraft.io.storage import is_s3, local_path, write_bytes_atomic

logger = logging.getLogger(__name__)

INDEX_FORMAT = "wdsraft-shard-index"


INDEX_VERSION = 1


INDEX_SUFFIX = ".idx"


def _pack_offsets(offsets: Sequence[int], typecode: str = "Q") -> bytes:
    packed = array(typecode, offsets)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _unpack_offsets(raw: bytes, typecode: str = "Q") -> array:
    offsets = array(typecode)
    offsets.frombytes(raw)
    if sys.byteorder == "big":
        offsets.byteswap()
    return offsets


def span_digest(data: bytes | memoryview, running: int = 0) -> int:
    """The per-sample digest stored in indexes: CRC-32 (zlib) of the sample's bytes, headers included.

    CRC-32 rather than a cryptographic hash: it guards against accidents (torn copies, flipped
    bits), not against an adversary (the shard's sha256 does that), detects every burst error up
    to 32 bits, and runs at several GB/s, so checking every sample costs little next to reading it.
    """
    return zlib.crc32(data, running)


@dataclass
class ShardIndex:
    """What a reader needs to know about one shard without reading it."""

    shard: str  # the shard's file name (basename), as written
    offsets: array  # num_samples + 1 uncompressed byte offsets; the last is where the archive ends
    size: int  # bytes of the shard file as stored (compressed if it is)
    sha256: str | None = None
    compression: str | None = None
    #: CRC-32 of each sample's bytes (``offsets[i]:offsets[i+1]`` of the uncompressed tar), or None in
    #: indexes written before wdsraft recorded them.
    crc32: array | None = None

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1

    def offset_of(self, ordinal: int) -> int:
        if not 0 <= ordinal <= self.num_samples:
            raise IndexError(f"{self.shard}: sample {ordinal} out of range (0..{self.num_samples})")
        return self.offsets[ordinal]

    def ordinal_at(self, offset: int) -> int | None:
        """The ordinal of the sample starting at byte ``offset`` (the end offset gives ``num_samples``), or None."""
        ordinal = bisect.bisect_left(self.offsets, offset)
        return ordinal if ordinal < len(self.offsets) and self.offsets[ordinal] == offset else None

    @property
    def identity(self) -> str:
        """What names this shard's contents cheaply: its sha256, else its size and sample count."""
        return self.sha256 if self.sha256 else f"size={self.size},samples={self.num_samples}"

    def to_bytes(self) -> bytes:
        record = {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "shard": self.shard,
            "num_samples": self.num_samples,
            "size": self.size,
            "sha256": self.sha256,
            "compression": self.compression,
            "offsets": _pack_offsets(self.offsets),
        }
        if self.crc32 is not None:  # an optional key: readers of version 1 that predate it ignore it
            record["crc32"] = _pack_offsets(self.crc32, "I")
        return msgpack.packb(record, use_bin_type=True)

    @classmethod
    def from_bytes(cls, raw: bytes, url: str = "<index>") -> ShardIndex:
        try:
            record = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except Exception as exn:
            raise IndexFormatError(url, f"not a msgpack shard index ({exn})") from None
        if not isinstance(record, dict) or record.get("format") != INDEX_FORMAT:
            raise IndexFormatError(url, "not a wdsraft shard index")
        if record.get("version") != INDEX_VERSION:
            raise IndexFormatError(url, f"unsupported index version {record.get('version')!r}")
        offsets = _unpack_offsets(record["offsets"])
        if len(offsets) != record["num_samples"] + 1:
            raise IndexFormatError(url, "offset table does not match the sample count (torn or corrupt file)")
        crc32 = None
        if record.get("crc32") is not None:
            crc32 = _unpack_offsets(record["crc32"], "I")
            if len(crc32) != record["num_samples"]:
                raise IndexFormatError(url, "digest table does not match the sample count (torn or corrupt file)")
        return cls(
            shard=record["shard"],
            offsets=offsets,
            size=record["size"],
            sha256=record.get("sha256"),
            compression=record.get("compression"),
            crc32=crc32,
        )

    @classmethod
    def load(cls, url: str) -> ShardIndex:
        """Load the index of a shard (``url`` names the shard or its ``.idx`` file)."""
        index_url = url if url.endswith(INDEX_SUFFIX) else url + INDEX_SUFFIX
        try:
            with gopen(index_url, "rb") as stream:
                raw = stream.read()
        except FileNotFoundError:
            raise IndexFormatError(index_url, "no index; build one with `wdsraft index`") from None
        return cls.from_bytes(raw, index_url)

    @classmethod
    def beside(cls, url: str) -> ShardIndex | None:
        """The index saved beside a local or S3 shard, or None where there is none.

        Shards elsewhere (``pipe:``, HTTP) are not looked up: a missing index there costs a
        command or a request that cannot be told from a failure. An index that exists but does
        not parse is logged and ignored (the shard still reads, unchecked).
        """
        if local_path(url) is None and not is_s3(url):
            return None
        index_url = url + INDEX_SUFFIX
        try:
            with gopen(index_url, "rb") as stream:
                raw = stream.read()
        except FileNotFoundError:  # (a missing S3 object is a RemoteNotFoundError, a FileNotFoundError:
            return None  # no matching on messages, which name the URL: a shard-000404.tar's 403 is no 404)
        try:
            return cls.from_bytes(raw, index_url)
        except IndexFormatError as exn:
            logger.warning("%s (read without the index's checks)", exn)
            return None

    def save(self, shard_url: str) -> str:
        """Write the index beside its shard, atomically; returns the index URL."""
        index_url = shard_url + INDEX_SUFFIX
        write_bytes_atomic(index_url, self.to_bytes())
        return index_url
