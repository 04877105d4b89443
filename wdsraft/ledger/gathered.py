"""Snapshots written at checkpoint time under torch.distributed: at each ``Ledger.checkpoint()`` every rank
sends rank 0 the commits it wrote since the last one (``gather_object``: a few kB each), and rank 0 adds them
to the snapshot it holds of the previous checkpoint and writes the snapshot of the new watermark, atomically.
Every checkpoint then has its snapshot, and a restart from it reads one object, whichever checkpoint it is.

The rank files stay the truth: rank 0 merges exactly the commits the rank files hold under the new watermark
(each rank saves its file before sending, and sends every commit it wrote, not just the last), so the
snapshot is what ``ledger compact`` would write from the files. A snapshot that cannot be written, or a
chain rank 0 cannot start (the base of an earlier run unreadable), only costs speed: the next read finds no
snapshot of its watermark and reads the rank files, as without torch.distributed.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import msgpack
from pyroaring import BitMap

from wdsraft.io.storage import remove
from wdsraft.ledger.consumed import ConsumedSet
from wdsraft.ledger.identity import Identity, ShardIdentities
from wdsraft.ledger.merged import Merged, merge_under
from wdsraft.ledger.rank_file import RankFile, RunSummary, commit_entries, counted
from wdsraft.ledger.snapshot import Snapshot, write_snapshot

logger = logging.getLogger(__name__)

#: Snapshots of one run rank 0 keeps (a resume from the checkpoint before the last still reads one object).
KEEP = 3


def process_group() -> Any:
    """``torch.distributed`` where a process group of more than one rank is initialised, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def copy_epochs(epochs: dict[int, ConsumedSet]) -> dict[int, ConsumedSet]:
    """A deep copy (the skip set handed to the dataset must not grow with this run's commits)."""
    return {
        epoch: ConsumedSet(
            {shard: BitMap(bitmap) for shard, bitmap in consumed.samples.items()},
            {shard: dict(partial) for shard, partial in consumed.tokens.items()},
        )
        for epoch, consumed in epochs.items()
    }


class SnapshotChain:
    """One rank's part of the gathered snapshots of its run; on rank 0, the running snapshot itself."""

    def __init__(self, path: str, run: str):
        self.path = path
        self.run = run
        self.sent = 0  # this rank's commits sent to rank 0 so far
        self.seen: set[int] = set()  # the marks (steps) of those
        self.started = False  # (rank 0) the base read
        self.broken = False  # (rank 0) no more snapshots for this run
        self.epochs: dict[int, ConsumedSet] = defaultdict(ConsumedSet)
        self.ranks: dict[str, dict[int, int]] = {}
        self.shards: dict[str, Identity] = {}
        self.unrecorded = False
        self.held: list[tuple[int, dict[str, Any]]] = []  # (rank, commit) not counted yet by a watermark
        self.runs: dict[str, RunSummary] = {}  # (rank 0) the summaries of the runs covered, this one's too
        self.written: list[str] = []  # this run's snapshots, oldest first
        #: (rank 0) the last snapshot written, for tests and logs.
        self.last_url: str | None = None

    def gather(self, rank_file: RankFile, watermark: dict[str, Any], base: Merged | None, dist: Any) -> None:
        """Collective: send this rank's new commits to rank 0, which writes the snapshot of ``watermark``.
        ``base``: what rank 0 read of the run's parent watermark at resume, if it read it."""
        new = rank_file.commits[self.sent :]
        summary = [rank_file.size, len(rank_file.commits), commit_entries(new, self.seen), rank_file.parents()]
        payload = msgpack.packb([rank_file.rank, rank_file.world_size, new, summary], use_bin_type=True)
        self.sent = len(rank_file.commits)
        received: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(payload, received, dst=0)
        if received is None or self.broken:
            return
        try:
            self._advance(received, watermark, base)
        except Exception as exn:  # (a snapshot only saves later reads: training goes on without them)
            self.broken = True
            logger.warning("ledger: no more snapshots at checkpoints of run %s: %s", self.run, exn)

    def _advance(self, received: list[bytes], watermark: dict[str, Any], base: Merged | None) -> None:
        lineage, steps = watermark["lineage"], watermark["steps"]
        if not self.started:
            self._start({r: c for r, c in lineage.items() if r != self.run}, steps, base)
        for raw in received:
            rank, world_size, commits, (size, count, entries, parent) = msgpack.unpackb(
                raw, raw=False, strict_map_key=False
            )
            self.held += [(rank, commit) for commit in commits]
            self.runs.setdefault(self.run, RunSummary(self.run, world_size)).add(rank, size, count, entries, parent)
        waiting = []
        for rank, commit in self.held:
            if not counted(commit, self.run, lineage, steps):  # (a rank ahead of this watermark: a later one)
                waiting.append((rank, commit))
                continue
            per_run = self.ranks.setdefault(self.run, {})
            per_run[rank] = max(per_run.get(rank, 0), commit["commit"])
            for url, identity in (commit.get("shards") or {}).items():
                self.shards.setdefault(url, identity)
            for epoch, record in commit["epochs"].items():
                self.epochs[int(epoch)].update(ConsumedSet.from_plain(record))
        self.held = waiting
        snapshot = Snapshot(
            self.path,
            dict(lineage),
            dict(steps),
            dict(sorted(self.epochs.items())),
            dict(self.shards),
            self.unrecorded,
            ranks=self.ranks,
            runs=self.runs,
        )
        try:
            url = write_snapshot(snapshot)
        except Exception as exn:  # (the state held is still right: the next checkpoint's snapshot is whole)
            logger.warning("could not write the ledger snapshot of %s at step %s: %s", self.path, steps, exn)
            return
        self.last_url = url
        if url in self.written:
            self.written.remove(url)
        self.written.append(url)
        while len(self.written) > KEEP:
            old = self.written.pop(0)
            try:
                remove(old)
            except Exception as exn:  # (a snapshot left behind costs a little storage, nothing else)
                logger.debug("could not remove the older snapshot %s: %s", old, exn)

    def _start(self, lineage: dict[str, int], steps: dict[str, int | None], base: Merged | None) -> None:
        """The consumed sets of the watermark this run resumed from: what resume() read, or (one read of its
        snapshot, where the previous run left it; the rank files otherwise) read now."""
        self.started = True
        if not lineage:
            return
        steps = {run: step for run, step in steps.items() if run in lineage}
        if base is None:
            base = merge_under(self.path, lineage, steps, ShardIdentities(self.path))
            logger.info(
                "ledger: snapshots at checkpoints of run %s start from %d rank files", self.run, base.files_read
            )
        self.epochs.update(copy_epochs(base.epochs))
        self.ranks = base.rank_commits()
        self.runs = {run: summary for run, summary in base.summaries().items() if run != self.run}
        self.shards, self.unrecorded = dict(base.shards), base.unrecorded
