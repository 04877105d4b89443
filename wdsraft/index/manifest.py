"""The dataset manifest (``manifest.json``, JSON): one entry per shard (URL relative to the
manifest, sample count, bytes, sha256, index name) and totals. Its ``shardlist`` also makes it
a valid wids shard index (``__kind__: wids-shard-index-v1``). Plain data: reading it never runs code.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from wdsraft.core.errors import IndexFormatError
from wdsraft.index.shard_index import INDEX_SUFFIX, ShardIndex
from wdsraft.io.gopen import gopen
from wdsraft.io.storage import write_bytes_atomic

MANIFEST_FORMAT = "wdsraft-manifest"


MANIFEST_VERSION = 1


MANIFEST_NAME = "manifest.json"


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
            raw = stream.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exn:  # (the decoder's message does not name the file)
            raise IndexFormatError(url, f"not a manifest: not UTF-8 text ({exn.reason} at byte {exn.start})") from None
        return cls.from_json(text, url)

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
