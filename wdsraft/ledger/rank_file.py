"""A rank file: one msgpack file per (run, rank) holding that rank's commits (each a consumed set and
a step), checksummed, written atomically; and the run id that names it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from typing import Any

import msgpack

from wdsraft.core.errors import LedgerError
from wdsraft.io.storage import write_bytes_atomic

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

    def to_bytes(self) -> bytes:
        body = msgpack.packb(
            {
                "run": self.run,
                "rank": self.rank,
                "world_size": self.world_size,
                "parent": self.parent,
                "parent_steps": self.parent_steps,
                "commits": self.commits,
            },
            use_bin_type=True,
        )
        return msgpack.packb(
            {
                "format": LEDGER_FORMAT,
                "version": LEDGER_VERSION,
                "sha256": hashlib.sha256(body).hexdigest(),
                "body": body,
            },
            use_bin_type=True,
        )

    def save(self) -> None:
        write_bytes_atomic(self.url, self.to_bytes())

    @classmethod
    def parse(cls, url: str, raw: bytes) -> RankFile:
        try:
            outer = msgpack.unpackb(raw, raw=False)
        except Exception as exn:
            raise LedgerError(url, f"unreadable ledger file (torn or not msgpack: {exn})") from None
        if not isinstance(outer, dict) or outer.get("format") != LEDGER_FORMAT:
            raise LedgerError(url, "not a wdsraft ledger file")
        if outer.get("version") != LEDGER_VERSION:
            raise LedgerError(url, f"unsupported ledger version {outer.get('version')!r}")
        body = outer.get("body", b"")
        if hashlib.sha256(body).hexdigest() != outer.get("sha256"):
            raise LedgerError(url, "checksum mismatch: the file is torn or corrupt")
        record = msgpack.unpackb(body, raw=False, strict_map_key=False)
        loaded = cls(
            url, record["run"], record["rank"], record["world_size"], record["parent"], record.get("parent_steps")
        )
        loaded.commits = record["commits"]
        return loaded


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
