"""What a ledger says was consumed under a watermark, read at the least cost: from a compacted snapshot
within that watermark where there is one, plus the rank files of only the runs it does not cover, read in
parallel. Under torch.distributed, one rank reads and hands the result to the others (``shared``).
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack

from wdsraft.core.errors import LedgerError, StateMismatchError
from wdsraft.core.fields import shard_of_key
from wdsraft.ledger.consumed import ConsumedSet
from wdsraft.ledger.identity import Identity, ShardIdentities
from wdsraft.ledger.rank_file import RankFile, RunSummary, counted
from wdsraft.ledger.reading import parallel_map, read_bytes
from wdsraft.ledger.snapshot import LedgerReads, Snapshot, find_snapshot

logger = logging.getLogger(__name__)


@dataclass
class Merged:
    """Every epoch's consumed set under a watermark, and what reading it took."""

    epochs: dict[int, ConsumedSet]
    snapshot: Snapshot | None  # the snapshot it started from
    files_read: int  # rank files merged besides it (read here, or given as read already)
    read_ranks: dict[str, dict[int, int]] = field(default_factory=dict)  # of the runs read: rank -> last commit
    stale: set[str] = field(default_factory=set)  # runs of the snapshot read again for late commits
    shards: dict[str, Identity] = field(default_factory=dict)  # the dataset identities recorded
    unrecorded: bool = False  # some commit merged records none (an older wdsraft wrote it)
    read_runs: dict[str, RunSummary] = field(default_factory=dict)  # the summaries of the runs read
    reread: set[str] = field(default_factory=set)  # the runs whose files were read

    def rank_commits(self) -> dict[str, dict[int, int]]:
        """Per run, each rank's last commit counted (from the snapshot for the runs it covered)."""
        kept = self.snapshot.rank_commits() if self.snapshot is not None else {}
        return {run: dict(per) for run, per in kept.items() if run not in self.reread} | self.read_ranks

    def summaries(self) -> dict[str, RunSummary]:
        """Per run of the lineage, what its files say (from the snapshot for the runs it covered)."""
        kept = self.snapshot.summaries() if self.snapshot is not None else {}
        return {run: summary for run, summary in kept.items() if run not in self.reread} | self.read_runs


def read_rank_files(urls: list[str], progress: str | None = None) -> Iterator[RankFile]:
    """The rank files at ``urls``, in order, fetched in parallel (bounded) and parsed one by one."""
    for url, raw in zip(urls, parallel_map(read_bytes, urls, progress), strict=True):
        yield RankFile.parse(url, raw)


def merge_under(
    path: str,
    lineage: dict[str, int],
    steps: dict[str, int | None] | None,
    identities: ShardIdentities,
    use_snapshots: bool = True,
    progress: str | None = None,
    known: Iterable[RankFile] = (),
    reads: LedgerReads | None = None,
) -> Merged:
    """Merge what the commits counted under the watermark consumed, per epoch, learning the dataset
    identities they recorded into ``identities``. Only the runs of the lineage are listed and read: the
    commits of other runs never count. ``known``, ``reads``: rank files (whole), and the snapshots, late
    markers and listings, read already (by this command: none is read again)."""
    reads = reads if reads is not None else LedgerReads(path)
    snapshot = find_snapshot(path, lineage, steps, reads) if use_snapshots and lineage else None
    epochs: dict[int, ConsumedSet] = defaultdict(ConsumedSet)
    ranks: dict[str, dict[int, int]] = {}
    summaries: dict[str, RunSummary] = {}
    runs, stale = set(lineage), set()
    if snapshot is not None:
        epochs.update(snapshot.epochs)
        identities.learn_recorded(snapshot.shards, snapshot.unrecorded, snapshot.url)
        stale = snapshot.stale(reads.late())
        if stale:
            logger.warning(
                "ledger snapshot %s: ranks of runs %s committed within it after it was written: reading their files",
                snapshot.url,
                ", ".join(sorted(stale)),
            )
        runs = snapshot.runs_to_read(lineage, steps) | stale
        logger.info("ledger: read %s; %d runs after it to read", snapshot.url, len(runs))
    urls = reads.listing.urls(runs) if runs else []
    given = {rank_file.url: rank_file for rank_file in known}
    fetch = [url for url in urls if url not in given]
    for rank_file in itertools.chain((given[url] for url in urls if url in given), read_rank_files(fetch, progress)):
        summaries.setdefault(rank_file.run, RunSummary(rank_file.run, rank_file.world_size)).add_file(rank_file)
        for commit in rank_file.commits:
            if counted(commit, rank_file.run, lineage, steps):
                identities.learn(commit, rank_file.url)
                per_run = ranks.setdefault(rank_file.run, {})
                per_run[rank_file.rank] = max(per_run.get(rank_file.rank, 0), commit["commit"])
                for epoch, record in commit["epochs"].items():
                    epochs[int(epoch)].update(ConsumedSet.from_plain(record))
    merged = Merged(dict(sorted(epochs.items())), snapshot, len(urls), ranks, stale)
    merged.shards, merged.unrecorded = dict(identities.recorded), identities.unrecorded_seen
    merged.read_runs, merged.reread = summaries, set(runs)
    return merged


def shared(compute: Callable[[], ConsumedSet], identities: ShardIdentities) -> ConsumedSet:
    """``compute()`` on rank 0 only, its result (and the dataset identities it learned and checked) handed
    to every rank of the initialised process group in one broadcast; elsewhere (no process group, or one
    rank) ``compute()`` here. Every rank must call it at the same point. A failure on rank 0 is raised on
    every rank (a dataset that differs as ``StateMismatchError``), not left to hang the others."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return compute()
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            consumed = compute()
            payload[0] = _pack(consumed, identities)
        except Exception as exn:
            payload[0] = ("error", type(exn).__name__, str(exn))
            dist.broadcast_object_list(payload, src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], tuple):
        _, kind, message = payload[0]
        if kind == StateMismatchError.__name__:
            raise StateMismatchError(f"(found by rank 0) {message}")
        raise LedgerError("ledger", f"rank 0 could not read the ledger: {kind}: {message}")
    return _unpack(payload[0], identities)


def _pack(consumed: ConsumedSet, identities: ShardIdentities) -> bytes:
    shards = {shard_of_key(key) for key in (*consumed.samples, *consumed.tokens)}  # (identities are by URL)
    return bytes(
        msgpack.packb(
            {
                "consumed": consumed.to_plain(),
                "shards": identities.recorded,
                "unrecorded": identities.unrecorded_seen,
                "checked": {url: found for url, found in identities.checked.items() if url in shards},
            },
            use_bin_type=True,
        )
    )


def _unpack(raw: bytes, identities: ShardIdentities) -> ConsumedSet:
    record = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    identities.learn_recorded(record["shards"], record["unrecorded"], "the ledger read by rank 0")
    identities.checked.update(record["checked"])  # (rank 0 compared them with the dataset: not read again)
    return ConsumedSet.from_plain(record["consumed"])
