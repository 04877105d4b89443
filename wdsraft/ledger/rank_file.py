"""A rank file: one msgpack file per (run, rank) holding that rank's commits (each a consumed set and
a step), checksummed, written atomically; the run id that names it; and what a set of rank files
says was committed (the steps every rank of a run reached, the newest such watermark).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from wdsraft.core.errors import LedgerError
from wdsraft.io.storage import write_bytes_atomic
from wdsraft.ledger.envelope import seal, unseal

logger = logging.getLogger(__name__)


LEDGER_FORMAT = "wdsraft-ledger"


LEDGER_VERSION = 1


SUFFIX = ".ledger"


def default_run_id(world_size: int = 1) -> str:
    """A run id that every rank of one job agrees on, and that no other job (array task, requeue,
    job step, relaunch) has: ``WDSRAFT_RUN``; else what SLURM (job or array task, step, restart
    count) and torchrun (run id, restart count) say, both where both run; else, with
    torch.distributed initialised, a fresh id drawn by rank 0 and broadcast; else (one process)
    a fresh id."""
    given = os.environ.get("WDSRAFT_RUN")
    if given:
        return given
    env = os.environ
    parts = []
    array = env.get("SLURM_ARRAY_JOB_ID")
    slurm = f"{array}_{env.get('SLURM_ARRAY_TASK_ID', '0')}" if array else env.get("SLURM_JOB_ID")
    if slurm:
        step = f".{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") else ""
        parts.append(f"slurm{slurm}{step}-restart{env.get('SLURM_RESTART_COUNT', '0')}")
    elastic = env.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        parts.append(f"torchrun{elastic}-restart{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if parts:
        return "-".join(parts)
    fresh = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        chosen = [fresh]
        dist.broadcast_object_list(chosen, src=0)
        return str(chosen[0])
    if world_size > 1:
        raise LedgerError(
            "ledger",
            f"{world_size} ranks need one run id they agree on: set WDSRAFT_RUN (unique per job), pass "
            "Ledger(run=...), run under SLURM or torchrun, or initialise torch.distributed first",
        )
    return fresh


class RankFile:
    """One (run, rank) file: its commits, rewritten whole and atomically at each commit."""

    def __init__(
        self,
        url: str,
        run: str,
        rank: int,
        world_size: int,
        parent: dict[str, int],
        parent_steps: dict[str, int | None] | None = None,
    ):
        self.url = url
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.parent = parent  # the watermark the run resumed from: earlier runs -> commit (and step)
        self.parent_steps = parent_steps or {}
        self.commits: list[dict[str, Any]] = []
        self.size = 0  # bytes, as last read or written

    def to_bytes(self) -> bytes:
        record = {
            "run": self.run,
            "rank": self.rank,
            "world_size": self.world_size,
            "parent": self.parent,
            "parent_steps": self.parent_steps,
            "commits": self.commits,
        }
        return seal(LEDGER_FORMAT, LEDGER_VERSION, record)

    def parents(self) -> list[Any]:
        return [self.parent, self.parent_steps]

    def save(self) -> None:
        data = self.to_bytes()
        write_bytes_atomic(self.url, data)
        self.size = len(data)

    @classmethod
    def parse(cls, url: str, raw: bytes) -> RankFile:
        record = unseal(url, raw, LEDGER_FORMAT, LEDGER_VERSION, "ledger file")
        try:
            _check_structure(record)
        except (ValueError, TypeError) as exn:  # (the checksum held: written so)
            raise LedgerError(url, f"checksum right but not the structure of a ledger file ({exn})") from None
        loaded = cls(
            url, record["run"], record["rank"], record["world_size"], record["parent"], record.get("parent_steps")
        )
        loaded.commits = record["commits"]
        loaded.size = len(raw)
        return loaded


def _check_structure(record: Any) -> None:
    """Raise ValueError saying what is wrong where a ledger body is not laid out as ``to_bytes`` writes it
    (types only: reading it then cannot fail half-way, far from the file's name)."""

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(what)

    need(isinstance(record, dict), "the body is not a map")
    need(isinstance(record.get("run"), str), "no run id")
    for name in ("rank", "world_size"):
        need(isinstance(record.get(name), int), f"{name} is not an integer")
    need(isinstance(record.get("parent"), dict), "parent is not a map")
    need(isinstance(record.get("parent_steps", {}) or {}, dict), "parent_steps is not a map")
    commits = record.get("commits")
    need(isinstance(commits, list), "commits is not a list")
    for number, commit in enumerate(commits, 1):
        where = f"commit {number}"
        need(isinstance(commit, dict) and isinstance(commit.get("commit"), int), f"{where} has no commit number")
        need(commit.get("step") is None or isinstance(commit["step"], int), f"{where}: step is not an integer")
        need(isinstance(commit.get("shards", {}), dict), f"{where}: shards is not a map")
        epochs = commit.get("epochs")
        need(isinstance(epochs, dict), f"{where}: epochs is not a map")
        for epoch, consumed in epochs.items():
            need(isinstance(epoch, str) and epoch.lstrip("-").isdigit(), f"{where}: epoch {epoch!r} is not a number")
            need(isinstance(consumed, dict), f"{where}, epoch {epoch}: not a map")
            samples, tokens = consumed.get("samples"), consumed.get("tokens")
            need(
                isinstance(samples, dict) and all(isinstance(b, bytes) for b in samples.values()),
                f"{where}, epoch {epoch}: samples is not a map of shard to bitmap bytes",
            )
            need(
                isinstance(tokens, dict)
                and all(
                    isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 for p in pairs)
                    for pairs in tokens.values()
                ),
                f"{where}, epoch {epoch}: tokens is not a map of shard to [ordinal, tokens] pairs",
            )


def counted(
    commit: dict[str, Any], run: str, lineage: dict[str, int], steps: dict[str, int | None] | None = None
) -> bool:
    """Whether a commit of some rank of ``run`` is within a watermark. Each rank numbers its own
    commits, and ranks need not commit equally often (one may commit twice at a step, another not
    at all): where the watermark has the step of the run's last commit, commits count by step."""
    if run not in lineage:
        return False
    step = (steps or {}).get(run)
    if step is not None and commit.get("step") is not None:
        return bool(commit["step"] <= step)
    return bool(commit["commit"] <= lineage[run])


def mark_of(commit: dict[str, Any]) -> int:
    """A commit's place in its run: its step, or minus its commit number where it has no step."""
    return int(commit["step"]) if commit.get("step") is not None else -int(commit["commit"])


def commit_entries(commits: list[dict[str, Any]], seen: set[int]) -> list[list[Any]]:
    """What a summary takes of each of a rank's commits: [mark, commit, time, step, whether it is the rank's
    first commit at that mark]; ``seen``, the marks of its earlier commits, is updated."""
    entries = []
    for commit in commits:
        mark = mark_of(commit)
        entries.append(
            [mark, int(commit["commit"]), float(commit.get("time") or 0.0), commit.get("step"), mark not in seen]
        )
        seen.add(mark)
    return entries


@dataclass
class RunSummary:
    """What a run's rank files say, in little: each rank file's size and number of commits, the marks
    (steps) committed with how many ranks reached each, the last step, the watermarks the ranks resumed
    from. Kept in snapshots, so that `ledger show` reads the files of only the runs a snapshot does not
    cover; built from rank files (``add_file``) or from the commits gathered at checkpoints (``add``)."""

    run: str
    world_size: int
    files: dict[int, list[int]] = field(default_factory=dict)  # rank -> [bytes of its file, commits in it]
    marks: dict[int, list[Any]] = field(default_factory=dict)  # mark -> [ranks there, highest commit, last time]
    last_step: int | None = None
    parents: list[list[dict[str, Any]]] = field(default_factory=list)  # distinct [lineage, steps] resumed from

    def add(self, rank: int, size: int, count: int, entries: list[list[Any]], parent: list[Any]) -> None:
        """Take in what a rank's file, now ``size`` bytes and ``count`` commits long, added: ``entries`` of
        ``commit_entries``, one per new commit."""
        self.files[rank] = [size, count]
        for mark, commit, when, step, first in entries:
            entry = self.marks.setdefault(mark, [0, 0, 0.0])
            entry[0] += int(first)
            entry[1], entry[2] = max(entry[1], commit), max(entry[2], when)
            if step is not None:
                self.last_step = step if self.last_step is None else max(self.last_step, step)
        if parent not in self.parents:
            self.parents.append(parent)

    def add_file(self, rank_file: RankFile) -> None:
        entries = commit_entries(rank_file.commits, set())
        self.add(rank_file.rank, rank_file.size, len(rank_file.commits), entries, rank_file.parents())

    def complete(self) -> dict[int, tuple[int, float]]:
        """The marks every rank of the run committed at, each with the highest commit number there and the
        time of the last of those commits; none where a rank never committed (a checkpoint is committed only
        once every rank wrote it, after committing the ledger: a step some rank never reached is no checkpoint
        anyone can resume from). Commits without a step are keyed by minus their commit number."""
        if len(self.files) < self.world_size:
            return {}
        return {mark: (commit, when) for mark, (ranks, commit, when) in self.marks.items() if ranks >= self.world_size}

    def commits(self) -> int:
        """The most commits a rank file of the run holds."""
        return max((count for _, count in self.files.values()), default=0)

    def last_commit(self) -> int:
        """The highest commit number of the run."""
        return max((commit for _, commit, _ in self.marks.values()), default=0)

    def to_plain(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "files": self.files,
            "marks": self.marks,
            "last_step": self.last_step,
            "parents": self.parents,
        }

    @classmethod
    def from_plain(cls, run: str, record: dict[str, Any]) -> RunSummary:
        return cls(
            run,
            int(record["world_size"]),
            {int(rank): [int(size), int(count)] for rank, (size, count) in record["files"].items()},
            {int(mark): list(entry) for mark, entry in record["marks"].items()},
            record["last_step"],
            [list(parent) for parent in record["parents"]],
        )


def summarize(files: Iterable[RankFile]) -> dict[str, RunSummary]:
    """The summaries of the runs of some rank files (each file read whole)."""
    runs: dict[str, RunSummary] = {}
    for rank_file in files:
        runs.setdefault(rank_file.run, RunSummary(rank_file.run, rank_file.world_size)).add_file(rank_file)
    return runs


def committed_in(runs: dict[str, RunSummary]) -> tuple[dict[str, int], dict[str, int | None], str]:
    """The watermark of the newest step every rank of a run committed (what a checkpoint there builds on):
    (run -> commit, run -> step, a description). Empty where no run has such a step."""
    complete = {run: marks for run, summary in runs.items() if (marks := summary.complete())}
    # Lineage first: a run another complete run resumed from is older, whatever the clocks of their nodes
    # say (each rank stamps commits with its own clock). Time only orders unrelated runs.
    ancestors = {parent for run in complete for lineage, _ in runs[run].parents for parent in lineage if parent != run}
    newest: tuple[float, str] | None = None
    for run, marks in complete.items():
        if run not in ancestors:
            when = max(when for _, when in marks.values())
            newest = max(newest, (when, run)) if newest is not None else (when, run)
    if newest is None:
        return {}, {}, "no step that every rank of a run committed"
    run = newest[1]
    mark = max(complete[run], key=lambda m: (m >= 0, abs(m)))  # its highest step (or commit, without steps)
    commit = complete[run][mark][0]
    lineage: dict[str, int] = {}
    steps: dict[str, int | None] = {}
    for parent, parent_steps in runs[run].parents:  # (the ranks of a run resume from one checkpoint: they agree)
        lineage.update(parent)
        steps.update(parent_steps)
    lineage[run], steps[run] = commit, (mark if mark >= 0 else None)
    where = f"step {mark}" if mark >= 0 else f"commit {commit}"
    return lineage, steps, f"the newest step every rank of a run committed: run {run}, {where}"
