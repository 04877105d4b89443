"""Per-shard indexes (``SHARD.idx`` beside ``SHARD``, msgpack): the sample count, the byte
offset of every sample's first header (plus one entry for the end of the last sample, so
sample ``i`` spans ``offsets[i]:offsets[i+1]``), the shard's size and sha256. They make
epoch lengths exact and seeking to a sample O(1). Plain data: reading one never runs code.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from wdsraft.core.errors import IndexFormatError
from wdsraft.io.gopen import gopen
from wdsraft.io.storage import write_bytes_atomic

INDEX_FORMAT = "wdsraft-shard-index"


INDEX_VERSION = 1


INDEX_SUFFIX = ".idx"


def _pack_offsets(offsets: Sequence[int]) -> bytes:
    packed = array("Q", offsets)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _unpack_offsets(raw: bytes) -> array:
    offsets = array("Q")
    offsets.frombytes(raw)
    if sys.byteorder == "big":
        offsets.byteswap()
    return offsets


@dataclass
class ShardIndex:
    """What a reader needs to know about one shard without reading it."""

    shard: str  # the shard's file name (basename), as written
    offsets: array  # num_samples + 1 uncompressed byte offsets; the last is where the archive ends
    size: int  # bytes of the shard file as stored (compressed if it is)
    sha256: str | None = None
    compression: str | None = None

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1

    def offset_of(self, ordinal: int) -> int:
        if not 0 <= ordinal <= self.num_samples:
            raise IndexError(f"{self.shard}: sample {ordinal} out of range (0..{self.num_samples})")
        return self.offsets[ordinal]

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "format": INDEX_FORMAT,
                "version": INDEX_VERSION,
                "shard": self.shard,
                "num_samples": self.num_samples,
                "size": self.size,
                "sha256": self.sha256,
                "compression": self.compression,
                "offsets": _pack_offsets(self.offsets),
            },
            use_bin_type=True,
        )

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
        return cls(
            shard=record["shard"],
            offsets=offsets,
            size=record["size"],
            sha256=record.get("sha256"),
            compression=record.get("compression"),
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

    def save(self, shard_url: str) -> str:
        """Write the index beside its shard, atomically; returns the index URL."""
        index_url = shard_url + INDEX_SUFFIX
        write_bytes_atomic(index_url, self.to_bytes())
        return index_url
