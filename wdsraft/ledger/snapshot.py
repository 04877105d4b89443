"""A compacted snapshot of a ledger: every epoch's consumed set counted under one watermark, merged into
one checksummed object at ``PATH/snapshots/DIGEST.snapshot`` (the digest names the watermark), with the
dataset identities those commits recorded. A resume under a watermark that builds on it reads this one
object plus the files of the runs it does not cover, instead of one file per rank per run.

A snapshot is trusted only where it is provably a part of what is being read: it must be whole (its
checksum), of this ledger, and its watermark within the one read (no run outside that lineage, no run
counted further). Otherwise it is ignored with a warning naming it, and the rank files are read.

A snapshot holds a run's commits up to a step as they were when it was written. A rank that later commits
something at a step it had already reached (a second checkpoint at one step, say) leaves a *late marker*
first, ``PATH/late/run-RUN/rank-NNNNN.commit-N.step-S``; a snapshot that covers that step of the run but not
that rank's commit N is stale for the run, whose files are then read again on top of it (one listing of
``PATH/late/`` per read: late commits are rare). The snapshot records, per run, each rank's last commit it
merged, to tell.

A command reads the snapshots, the late markers and the listings of rank files once, however many of its
steps look at them (``LedgerReads``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack

from wdsraft.core.errors import LedgerError
from wdsraft.io.s3 import list_objects
from wdsraft.io.storage import local_path, write_bytes_atomic
from wdsraft.ledger.consumed import ConsumedSet
from wdsraft.ledger.envelope import seal, unseal
from wdsraft.ledger.identity import Identity
from wdsraft.ledger.rank_file import RunSummary
from wdsraft.ledger.reading import RankListing, list_under, parallel_map, read_optional

logger = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "wdsraft-ledger-snapshot"
SNAPSHOT_VERSION = 2  # (2: per-run rank commits; a version 1 snapshot is ignored, the files read)
SNAPSHOT_DIR = "snapshots"
SNAPSHOT_SUFFIX = ".snapshot"
LATE_DIR = "late"
LATEST = "latest"  # (in SNAPSHOT_DIR: the URL of the snapshot written last)
_LATE_NAME = re.compile(r"rank-(\d+)\.commit-(\d+)\.step-(\d+)$")

#: Snapshots read at most when none is named by the watermark itself (one per branch of rewinds, say).
SCAN_LIMIT = 16

Mark = tuple[str, int]  # ("step", n) or ("commit", n): how far a run counts


def marks(lineage: dict[str, int], steps: dict[str, int | None] | None) -> dict[str, Mark]:
    """How far each run of a watermark counts: by step where the watermark has one (every rank's commits
    up to it, whatever their numbers), else by commit number (see ``rank_file.counted``)."""
    found: dict[str, Mark] = {}
    for run, commit in lineage.items():
        step = (steps or {}).get(run)
        found[run] = ("step", int(step)) if step is not None else ("commit", int(commit))
    return found


def snapshot_url(path: str, lineage: dict[str, int], steps: dict[str, int | None] | None) -> str:
    canonical = msgpack.packb(sorted((run, list(mark)) for run, mark in marks(lineage, steps).items()))
    return posixpath.join(path, SNAPSHOT_DIR, hashlib.sha256(canonical).hexdigest()[:32] + SNAPSHOT_SUFFIX)


@dataclass
class Snapshot:
    """The merged consumed sets (every epoch) of the commits counted under ``lineage``/``steps``."""

    ledger: str
    lineage: dict[str, int]
    steps: dict[str, int | None]
    epochs: dict[int, ConsumedSet] = field(default_factory=dict)
    shards: dict[str, Identity] = field(default_factory=dict)  # dataset identities the commits recorded
    unrecorded: bool = False  # some commit was written before identities were recorded
    url: str = ""
    ranks: dict[str, dict[int, int]] = field(default_factory=dict)  # run -> rank -> its last commit merged
    runs: dict[str, RunSummary] = field(default_factory=dict)  # what the files of the runs it covers said
    # ``ranks`` and ``runs`` as read, msgpack each, decoded on first use: a resume needs neither unless there
    # are late commits, and decoding them would triple the time to parse a snapshot of 8,000 ranks x 20 runs.
    packed: dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)

    def rank_commits(self) -> dict[str, dict[int, int]]:
        """Per run it covers, each rank's last commit merged."""
        raw = self.packed.pop("ranks", None)
        if raw is not None:
            plain = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            self.ranks = {str(run): {int(k): int(n) for k, n in per.items()} for run, per in plain.items()}
        return self.ranks

    def summaries(self) -> dict[str, RunSummary]:
        """Per run it covers, what its files said when it was written."""
        raw = self.packed.pop("runs", None)
        if raw is not None:
            plain = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            self.runs = {str(run): RunSummary.from_plain(str(run), record) for run, record in plain.items()}
        return self.runs

    def to_bytes(self) -> bytes:
        record = {
            "ledger": self.ledger,
            "lineage": self.lineage,
            "steps": self.steps,
            "created": time.time(),
            "epochs": {str(epoch): consumed.to_plain() for epoch, consumed in self.epochs.items()},
            "shards": self.shards,
            "unrecorded": self.unrecorded,
            "ranks": msgpack.packb(self.rank_commits()),
            "runs": msgpack.packb({run: summary.to_plain() for run, summary in self.summaries().items()}),
        }
        return seal(SNAPSHOT_FORMAT, SNAPSHOT_VERSION, record)

    @classmethod
    def parse(cls, url: str, raw: bytes) -> Snapshot:
        """Load a snapshot; ``LedgerError`` naming it where it is torn, corrupt or not a snapshot."""
        record = unseal(url, raw, SNAPSHOT_FORMAT, SNAPSHOT_VERSION, "ledger snapshot")
        try:
            epochs = {int(epoch): ConsumedSet.from_plain(plain) for epoch, plain in record["epochs"].items()}
            snapshot = cls(
                str(record["ledger"]),
                {str(run): int(commit) for run, commit in record["lineage"].items()},
                dict(record["steps"]),
                epochs,
                dict(record["shards"]),
                bool(record["unrecorded"]),
                url,
                packed={"ranks": _packed(record["ranks"]), "runs": _packed(record["runs"])},
            )
        except (KeyError, ValueError, TypeError, AttributeError) as exn:
            raise LedgerError(url, f"checksum right but not the structure of a ledger snapshot ({exn!r})") from None
        return snapshot

    def refusal(self, ledger: str, lineage: dict[str, int], steps: dict[str, int | None] | None) -> str | None:
        """Why this snapshot must not be used to read ``ledger`` under a watermark, or None where it may:
        another ledger's, a run outside the lineage, or a run counted further than the watermark counts it
        (a snapshot newer than the checkpoint, after a rewind)."""
        if self.ledger.rstrip("/") != ledger.rstrip("/"):
            return f"it is the snapshot of another ledger ({self.ledger})"
        wanted = marks(lineage, steps)
        for run, (kind, value) in marks(self.lineage, self.steps).items():
            if run not in wanted:
                return (
                    f"it counts run {run}, which is outside the lineage being read (a run after the checkpoint, or "
                    "another branch of the training)"
                )
            want_kind, want_value = wanted[run]
            if kind != want_kind:
                return f"it counts run {run} by {kind}, the watermark by {want_kind}"
            if value > want_value:
                return (
                    f"it is newer than the checkpoint: it counts run {run} up to {kind} {value}, the checkpoint "
                    f"up to {want_value}"
                )
        return None

    def runs_to_read(self, lineage: dict[str, int], steps: dict[str, int | None] | None) -> set[str]:
        """The runs of a watermark (that this snapshot is within) whose files hold commits it lacks: those it counts
        less far (the runs with a late commit within its mark: ``stale``)."""
        mine = marks(self.lineage, self.steps)
        return {run for run, mark in marks(lineage, steps).items() if mine.get(run) != mark}

    def stale(self, late: Late) -> set[str]:
        """The runs this snapshot covers of which a rank committed, at a step within its mark, after it was
        written: their files hold what it lacks."""
        found = set()
        for run, (kind, value) in marks(self.lineage, self.steps).items():
            if kind != "step" or not late.get(run):
                continue
            merged = self.rank_commits().get(run, {})
            if any(step <= value and merged.get(rank, 0) < n for rank, n, step in late.get(run, ())):
                found.add(run)
        return found


def _packed(value: object) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"{type(value).__name__} where packed bytes belong")
    return value


Late = dict[str, list[tuple[int, int, int]]]  # run -> (rank, commit, step) of its late commits


def late_marker_url(path: str, run: str, rank: int, commit: int, step: int) -> str:
    return posixpath.join(path, LATE_DIR, f"run-{run}", f"rank-{rank:05d}.commit-{commit}.step-{step}")


def late_commits(path: str) -> Late:
    """The late commits of a ledger, from the names of its late markers (one listing)."""
    found: Late = {}
    local = local_path(path)
    if local is not None:
        base = os.path.join(local, LATE_DIR)
        names = [
            (folder, name)
            for folder in (sorted(os.listdir(base)) if os.path.isdir(base) else [])
            if os.path.isdir(os.path.join(base, folder))
            for name in sorted(os.listdir(os.path.join(base, folder)))
        ]
    else:
        items = list_objects(posixpath.join(path, LATE_DIR).rstrip("/") + "/")
        names = [tuple(item.name.split("/", 1)) for item in items if item.name.count("/") == 1]  # type: ignore[misc]
    for folder, name in names:  # (anything else there is not a marker: ignored)
        matched = _LATE_NAME.match(name)
        if folder.startswith("run-") and matched:
            rank, commit, step = (int(group) for group in matched.groups())
            found.setdefault(folder[len("run-") :], []).append((rank, commit, step))
    return found


Parsed = Snapshot | LedgerError | None  # a snapshot read: None where it is not there, the error where torn


class LedgerReads:
    """What one command (a read of the ledger, ``wdsraft ledger show``) has read of a ledger so far, so that it
    reads each object and each listing once: the snapshots (the one written last among them), the late
    markers, the rank files listed per run."""

    def __init__(self, path: str):
        self.path = path
        self.listing = RankListing(path)
        self._snapshots: dict[str, Parsed] = {}
        self._latest: list[Snapshot | None] = []  # (empty: not read yet)
        self._late: Late | None = None

    def snapshots(self, urls: list[str]) -> list[Parsed]:
        """The snapshot at each URL, those not read yet read in parallel, each parsed once."""
        missing = [url for url in dict.fromkeys(urls) if url not in self._snapshots]
        for url, raw in zip(missing, parallel_map(read_optional, missing), strict=True):
            try:
                self._snapshots[url] = Snapshot.parse(url, raw) if raw is not None else None
            except LedgerError as exn:
                self._snapshots[url] = exn
        return [self._snapshots[url] for url in urls]

    def latest(self) -> Snapshot | None:
        """The snapshot written last (``latest`` names it), if it is there, whole and of this ledger (read once)."""
        if not self._latest:
            self._latest.append(self._find_latest())
        return self._latest[0]

    def _find_latest(self) -> Snapshot | None:
        path = self.path
        pointer = read_optional(posixpath.join(path, SNAPSHOT_DIR, LATEST))
        if pointer is None:
            return None
        url = pointer.decode(errors="replace")
        if not url.startswith(path.rstrip("/") + "/" + SNAPSHOT_DIR + "/"):
            logger.warning(
                "ignoring %s/%s/%s: it names %s, not a snapshot of this ledger", path, SNAPSHOT_DIR, LATEST, url
            )
            return None
        snapshot = self.snapshots([url])[0]
        if isinstance(snapshot, LedgerError):
            logger.warning("ignoring the ledger snapshot %s: %s", url, snapshot)
            return None
        if snapshot is not None and snapshot.ledger.rstrip("/") != path.rstrip("/"):
            logger.warning("ignoring the ledger snapshot %s: it is the snapshot of another ledger", url)
            return None
        return snapshot

    def late(self) -> Late:
        """``late_commits(path)``, once."""
        if self._late is None:
            self._late = late_commits(self.path)
        return self._late


def find_snapshot(
    path: str, lineage: dict[str, int], steps: dict[str, int | None] | None, reads: LedgerReads | None = None
) -> Snapshot | None:
    """The snapshot to start reading ``path`` under a watermark from: the one of that watermark itself
    (one read), else the one written last if it is within the watermark, else the usable one covering the
    most runs among those in ``PATH/snapshots``. Those that may not be used are skipped with a warning
    saying why. ``reads``: what this command read already (not read again)."""
    reads = reads if reads is not None else LedgerReads(path)
    exact = snapshot_url(path, lineage, steps)
    found = _usable(exact, reads.snapshots([exact])[0], path, lineage, steps)
    if found is not None:
        return found
    # The snapshot written last, where it is within the watermark: the newest part of it there is (rank 0
    # keeps a few per run, so the folder may hold many large snapshots not worth reading one by one).
    latest = reads.latest()
    if latest is not None and latest.url != exact and latest.refusal(path, lineage, steps) is None:
        return latest
    others = [url for url in list_under(path, SNAPSHOT_DIR) if url.endswith(SNAPSHOT_SUFFIX) and url != exact]
    if len(others) > SCAN_LIMIT:
        logger.info("%d ledger snapshots in %s: reading %d of them", len(others), path, SCAN_LIMIT)
        others = others[:SCAN_LIMIT]
    candidates = [
        snapshot
        for url, parsed in zip(others, reads.snapshots(others), strict=True)
        if (snapshot := _usable(url, parsed, path, lineage, steps)) is not None
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda s: (len(s.runs_to_read(lineage, steps)), s.url))


def _usable(
    url: str, parsed: Parsed, path: str, lineage: dict[str, int], steps: dict[str, int | None] | None
) -> Snapshot | None:
    if parsed is None:
        return None
    why = str(parsed) if isinstance(parsed, LedgerError) else parsed.refusal(path, lineage, steps)
    if why is not None or isinstance(parsed, LedgerError):
        logger.warning("ignoring the ledger snapshot %s, reading the rank files instead: %s", url, why)
        return None
    return parsed


def write_snapshot(snapshot: Snapshot) -> str:
    """Write ``snapshot`` (atomically) under its ledger, named by its watermark, and point ``latest`` at it
    (where ``ledger show`` starts); returns its URL."""
    url = snapshot_url(snapshot.ledger, snapshot.lineage, snapshot.steps)
    write_bytes_atomic(url, snapshot.to_bytes())
    snapshot.url = url
    write_bytes_atomic(posixpath.join(snapshot.ledger, SNAPSHOT_DIR, LATEST), url.encode())
    return url


def snapshot_urls(path: str) -> Iterable[str]:
    return [url for url in list_under(path, SNAPSHOT_DIR) if url.endswith(SNAPSHOT_SUFFIX)]
