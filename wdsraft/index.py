"""Per-shard indexes and the dataset manifest.

**Shard index** (``SHARD.idx`` beside ``SHARD``, msgpack): the sample count, the byte
offset of every sample's first header (plus one entry for the end of the last sample,
so sample ``i`` spans ``offsets[i]:offsets[i+1]``), the shard's size and sha256. It
makes epoch lengths exact and seeking to a sample O(1).

**Manifest** (``manifest.json``, JSON): one entry per shard (URL relative to the
manifest, sample count, bytes, sha256, index name) and totals. Its ``shardlist`` also
makes it a valid wids shard index (``__kind__: wids-shard-index-v1``).

Both are plain data: reading them never runs code.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, cast
from urllib.parse import urlparse

import msgpack

from wdsraft.core.errors import IndexFormatError
from wdsraft.io.compression import uncompressed
from wdsraft.io.gopen import gopen
from wdsraft.io.storage import write_bytes_atomic
from wdsraft.tariterators import ShardSampleReader

INDEX_FORMAT = "wdsraft-shard-index"
INDEX_VERSION = 1
INDEX_SUFFIX = ".idx"
MANIFEST_FORMAT = "wdsraft-manifest"
MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"


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
        offsets = array("Q", (sample["__offset__"] for sample in reader))
        offsets.append(reader.next_offset)
        while hashing.read(1 << 22):  # whatever follows the end blocks still belongs to the file
            pass
    finally:
        hashing.close()
    sha256 = hashing.digest.hexdigest() if hashing.digest is not None else None
    return ShardIndex(posixpath.basename(urlparse(url).path or url), offsets, hashing.count, sha256, compression)


# ---------------------------------------------------------------------------------------------


@dataclass
class ManifestEntry:
    url: str  # relative to the manifest's directory (or absolute)
    num_samples: int
    size: int
    sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "nsamples": self.num_samples,
            "filesize": self.size,
            "sha256": self.sha256,
            "index": posixpath.basename(self.url) + INDEX_SUFFIX,
        }


@dataclass
class Manifest:
    """The list of shards of a dataset with their sample counts, sizes and checksums."""

    shards: list[ManifestEntry] = field(default_factory=list)
    name: str = "dataset"
    # Optional, written only when set (older readers ignore them): per-input record accounting and
    # the settings of the `wdsraft convert` run that made the dataset.
    inputs: list[dict[str, Any]] | None = None
    conversion: dict[str, Any] | None = None

    @property
    def num_samples(self) -> int:
        return sum(entry.num_samples for entry in self.shards)

    @property
    def size(self) -> int:
        return sum(entry.size for entry in self.shards)

    def add(self, url: str, index: ShardIndex) -> None:
        self.shards.append(ManifestEntry(url, index.num_samples, index.size, index.sha256))

    def to_json(self) -> str:
        record = {
            "__kind__": "wids-shard-index-v1",
            "wids_version": 1,
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "name": self.name,
            "num_shards": len(self.shards),
            "num_samples": self.num_samples,
            "size": self.size,
            "shardlist": [entry.to_dict() for entry in self.shards],
        }
        if self.inputs is not None:
            record["inputs"] = self.inputs
        if self.conversion is not None:
            record["conversion"] = self.conversion
        return json.dumps(record, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, url: str = "<manifest>") -> Manifest:
        try:
            record = json.loads(text)
        except ValueError as exn:
            raise IndexFormatError(url, f"not JSON ({exn})") from None
        if not isinstance(record, dict) or record.get("format") != MANIFEST_FORMAT:
            raise IndexFormatError(url, "not a wdsraft manifest")
        if record.get("version") != MANIFEST_VERSION:
            raise IndexFormatError(url, f"unsupported manifest version {record.get('version')!r}")
        shards = [
            ManifestEntry(item["url"], item["nsamples"], item["filesize"], item.get("sha256"))
            for item in record["shardlist"]
        ]
        return cls(shards, record.get("name", "dataset"), record.get("inputs"), record.get("conversion"))

    @classmethod
    def load(cls, url: str) -> Manifest:
        with gopen(url, "rb") as stream:
            return cls.from_json(stream.read().decode("utf-8"), url)

    def save(self, url: str) -> None:
        write_bytes_atomic(url, self.to_json().encode("utf-8"))

    def urls(self, manifest_url: str) -> list[str]:
        """Shard URLs resolved against the manifest's location."""
        return [resolve(manifest_url, entry.url) for entry in self.shards]


def resolve(base_url: str, url: str) -> str:
    """Resolve a manifest-relative shard URL."""
    if urlparse(url).scheme or url.startswith("/"):
        return url
    directory = base_url.rsplit("/", 1)[0] if "/" in base_url else "."
    return f"{directory}/{url}" if directory != "." else url


def relative_to(directory: str, url: str) -> str:
    """Express a shard URL relative to the manifest's directory when it lies below it."""
    prefix = directory.rstrip("/") + "/"
    return url[len(prefix) :] if url.startswith(prefix) else url


def manifest_for(directory: str, entries: Iterable[tuple[str, ShardIndex]], name: str = "dataset") -> Manifest:
    manifest = Manifest(name=name)
    for url, index in entries:
        manifest.add(relative_to(directory, url), index)
    return manifest
