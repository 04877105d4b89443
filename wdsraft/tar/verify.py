"""Checking shards against their indexes and the manifest (``wdsraft verify``): one read of each
shard, compared field by field with what was recorded when it was written."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from wdsraft.core.errors import IndexFormatError, TarFormatError
from wdsraft.index.manifest import Manifest, ManifestEntry, resolve
from wdsraft.index.shard_index import ShardIndex
from wdsraft.io.storage import local_path
from wdsraft.tar.indexer import build_index

MAX_LISTED = 5  # bad samples named per shard; the rest are counted


@dataclass
class ShardReport:
    """What one shard's check found: an empty ``problems`` list means the shard is as recorded."""

    url: str
    num_samples: int | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked (not damage)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self, verbose: bool = False) -> list[str]:
        """The report as printed by ``wdsraft verify``: a bad shard with each problem; good ones if verbose."""
        lines = [f"BAD {self.url}", *(f"  - {problem}" for problem in self.problems)] if self.problems else []
        if verbose:
            lines += [] if self.problems else [f"ok  {self.url} ({self.num_samples} samples)"]
            lines += [f"  note: {note}" for note in self.notes]
        return lines


def verify_shard(url: str, entry: ManifestEntry | None = None, checksum: bool = True) -> ShardReport:
    """Read ``url`` once and compare it with its index (``SHARD.idx``) and, if given, its manifest entry:
    size, sha256, sample count, where every sample starts, and every sample's CRC-32."""
    report = ShardReport(url)
    try:
        recorded: ShardIndex | None = ShardIndex.load(url)
    except IndexFormatError as exn:
        recorded = None
        report.problems.append(f"index: {exn.reason}")
    try:
        actual = build_index(url, checksum=checksum)
    except FileNotFoundError:
        report.problems.append("the shard does not exist")
        return report
    except (TarFormatError, OSError) as exn:
        report.problems.append(str(exn))
        path = local_path(url)
        if recorded is not None and path is not None and os.path.getsize(path) != recorded.size:
            report.problems.append(f"{os.path.getsize(path)} bytes, the index says {recorded.size}")
        return report
    report.num_samples = actual.num_samples
    if recorded is not None:
        report.problems += compare_indexes(actual, recorded, "the index")
        if recorded.crc32 is None:
            report.notes.append("its index has no per-sample digests (older wdsraft): `wdsraft index` adds them")
    if entry is not None:
        report.problems += compare_entry(actual, entry)
    return report


def compare_indexes(actual: ShardIndex, recorded: ShardIndex, what: str) -> list[str]:
    """How the shard as read (``actual``) differs from a recorded index, each difference with its place."""
    problems = _compare_totals(actual, recorded.size, recorded.sha256, recorded.num_samples, what)
    common = min(actual.num_samples, recorded.num_samples) + 1
    moved = next((i for i in range(common) if actual.offsets[i] != recorded.offsets[i]), None)
    if moved is not None:
        label = f"sample {moved}" if moved < actual.num_samples else "the end of the archive"
        problems.append(f"{label} at byte {actual.offsets[moved]}, {what} says byte {recorded.offsets[moved]}")
        common = moved  # (past a moved sample, spans differ for that reason alone)
    if actual.crc32 is not None and recorded.crc32 is not None:
        changed = [i for i in range(min(common, actual.num_samples)) if actual.crc32[i] != recorded.crc32[i]]
        listed = ", ".join(
            f"sample {i} (bytes {actual.offsets[i]}:{actual.offsets[i + 1]})" for i in changed[:MAX_LISTED]
        )
        more = f" and {len(changed) - MAX_LISTED} more" if len(changed) > MAX_LISTED else ""
        if changed:
            problems.append(f"CRC-32 differs from {what}'s: {listed}{more}")
    return problems


def compare_entry(actual: ShardIndex, entry: ManifestEntry) -> list[str]:
    """How the shard as read differs from its manifest entry (size, sha256, sample count)."""
    return _compare_totals(actual, entry.size, entry.sha256, entry.num_samples, "the manifest")


def _compare_totals(actual: ShardIndex, size: int, sha256: str | None, num_samples: int, what: str) -> list[str]:
    problems = []
    if actual.size != size:
        problems.append(f"{actual.size} bytes, {what} says {size}")
    if actual.sha256 and sha256 and actual.sha256 != sha256:
        problems.append(f"sha256 {actual.sha256[:16]}..., {what} says {sha256[:16]}...")
    if actual.num_samples != num_samples:
        problems.append(f"{actual.num_samples} samples, {what} says {num_samples}")
    return problems


def url_key(url: str) -> str:
    """A URL as a dictionary key: local paths normalised (``./a/x.tar`` and ``a/x.tar`` are one shard)."""
    path = local_path(url)
    return os.path.normpath(path) if path is not None else url


def recorded_entries(manifest_url: str) -> dict[str, ManifestEntry]:
    """The entries of an existing manifest by shard URL; none when there is no manifest (or not ours)."""
    try:
        manifest = Manifest.load(manifest_url)
    except (IndexFormatError, OSError, UnicodeDecodeError):
        return {}
    return {url_key(resolve(manifest_url, entry.url)): entry for entry in manifest.shards}
