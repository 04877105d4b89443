"""A view of a whole ledger for ``wdsraft ledger show | merge | export | compact``: every run's summary
(ranks, commits, steps, the watermark it resumed from, the steps every rank committed), read from the
snapshot written last plus the rank files of only the runs it cannot vouch for, instead of every file.

The snapshot's summaries are used for the runs it covers, except: runs with a late commit it lacks
(their late markers), and the newest runs it covers (those no other run in it resumed from), whose files
are listed and compared by size with what it recorded (a rank file grows with every commit): any that
differ, and every run it does not cover, are read whole. Earlier runs are as the snapshot recorded them
(commits they wrote after the checkpoint a later run resumed from are not shown: ``--every-file`` reads them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from wdsraft.ledger.merged import read_rank_files
from wdsraft.ledger.rank_file import RankFile, RunSummary, summarize
from wdsraft.ledger.reading import list_runs
from wdsraft.ledger.snapshot import LedgerReads, Snapshot

logger = logging.getLogger(__name__)


@dataclass
class LedgerView:
    runs: dict[str, RunSummary]  # every run of the ledger
    files: list[RankFile]  # the rank files read (whole)
    reads: LedgerReads  # what was read (snapshots, late markers, listings): not read again
    snapshot: Snapshot | None = None  # where the summaries of the other runs come from
    trusted: set[str] = field(default_factory=set)  # runs as the snapshot recorded them (files not read)


def view_ledger(path: str, use_snapshot: bool = True, progress: str | None = None) -> LedgerView:
    """Every run's summary: from the snapshot written last where it can vouch for the run, else its files."""
    reads = LedgerReads(path)
    snapshot = reads.latest() if use_snapshot else None
    if snapshot is None or not snapshot.summaries():
        files = list(read_rank_files(reads.listing.everything(), progress))
        return LedgerView(summarize(files), files, reads)
    listed = set(list_runs(path))
    covered = set(snapshot.summaries()) & listed
    stale = snapshot.stale(reads.late())
    recorded = snapshot.summaries()
    parents = {parent for run in covered for lineage, _ in recorded[run].parents for parent in lineage}
    # One listing per run, in parallel, of the runs whose sizes are compared and of those read whole.
    reads.listing.of((covered - parents) | (listed - covered) | (stale & covered))
    changed = {run for run in covered - parents if reads.listing.sizes(run) != _recorded_sizes(recorded[run])}
    trusted = covered - stale - changed
    logger.info(
        "ledger: %d runs as %s recorded them; reading the files of %d runs (%d it does not cover, %d changed since)",
        len(trusted),
        snapshot.url,
        len(listed - trusted),
        len(listed - covered),
        len((stale | changed) & covered),
    )
    files = list(read_rank_files(reads.listing.urls(listed - trusted), progress)) if listed - trusted else []
    runs = {run: recorded[run] for run in sorted(trusted)} | summarize(files)
    return LedgerView(runs, files, reads, snapshot, trusted)


def _recorded_sizes(summary: RunSummary) -> dict[int, int]:
    return {rank: size for rank, (size, _) in summary.files.items()}
