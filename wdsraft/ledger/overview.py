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
import os
import posixpath
from dataclasses import dataclass, field

from wdsraft.io.storage import local_path
from wdsraft.ledger.merged import read_rank_files
from wdsraft.ledger.rank_file import SUFFIX, RankFile, RunSummary, summarize
from wdsraft.ledger.reading import list_objects_sized, list_rank_files, list_runs
from wdsraft.ledger.snapshot import Snapshot, late_commits, latest_snapshot

logger = logging.getLogger(__name__)


@dataclass
class LedgerView:
    runs: dict[str, RunSummary]  # every run of the ledger
    files: list[RankFile]  # the rank files read (whole)
    snapshot: Snapshot | None = None  # where the summaries of the other runs come from
    trusted: set[str] = field(default_factory=set)  # runs as the snapshot recorded them (files not read)


def view_ledger(path: str, use_snapshot: bool = True, progress: str | None = None) -> LedgerView:
    """Every run's summary: from the snapshot written last where it can vouch for the run, else its files."""
    snapshot = latest_snapshot(path) if use_snapshot else None
    if snapshot is None or not snapshot.summaries():
        files = list(read_rank_files(list_rank_files(path), progress))
        return LedgerView(summarize(files), files)
    listed = set(list_runs(path))
    covered = set(snapshot.summaries()) & listed
    stale = snapshot.stale(late_commits(path))
    recorded = snapshot.summaries()
    parents = {parent for run in covered for lineage, _ in recorded[run].parents for parent in lineage}
    changed = {run for run in covered - parents if rank_file_sizes(path, run) != _recorded_sizes(recorded[run])}
    trusted = covered - stale - changed
    logger.info(
        "ledger: %d runs as %s recorded them; reading the files of %d runs (%d it does not cover, %d changed since)",
        len(trusted),
        snapshot.url,
        len(listed - trusted),
        len(listed - covered),
        len((stale | changed) & covered),
    )
    files = list(read_rank_files(list_rank_files(path, listed - trusted), progress)) if listed - trusted else []
    runs = {run: recorded[run] for run in sorted(trusted)} | summarize(files)
    return LedgerView(runs, files, snapshot, trusted)


def _recorded_sizes(summary: RunSummary) -> dict[int, int]:
    return {rank: size for rank, (size, _) in summary.files.items()}


def rank_file_sizes(path: str, run: str) -> dict[int, int]:
    """Each rank file of a run and its size in bytes, from one listing (local: a directory's, S3: a prefix's)."""
    folder = posixpath.join(path, f"run-{run}")
    local = local_path(folder)
    if local is not None:
        names = sorted(os.listdir(local)) if os.path.isdir(local) else []
        found = [(name, os.path.getsize(os.path.join(local, name))) for name in names]
    else:
        found = list_objects_sized(folder.rstrip("/") + "/")
    sizes = {}
    for name, size in found:
        if name.startswith("rank-") and name.endswith(SUFFIX) and name[len("rank-") : -len(SUFFIX)].isdigit():
            sizes[int(name[len("rank-") : -len(SUFFIX)])] = size
    return sizes
