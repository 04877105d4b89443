"""The options of a conversion (``ConvertOptions``: defaults and checks), sizes such as ``512M``, the
SLURM array task, and ``ConvertError``, which every phase raises when a conversion cannot go on.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass

from wdsraft.io.storage import local_path

FORMAT_TXT_JSON = "txt+json"
FORMAT_MSGPACK = "msgpack"
FORMATS = (FORMAT_TXT_JSON, FORMAT_MSGPACK)
PHASES = ("all", "scatter", "write", "finalize")
BAD_RECORD_POLICIES = ("error", "skip")
DEFAULT_SAMPLES_PER_SHARD = 10_000
DEFAULT_MEMORY = 1 << 30
MAX_BUCKETS = 1 << 20


class ConvertError(Exception):
    """A conversion cannot go on: bad input (in ``error`` mode), bad options, a workdir from another run..."""


def parse_size(text: str | int) -> int:
    """``'256M'``, ``'2G'``, ``'1.5GiB'``, ``'4096'`` -> bytes (binary units: 1K = 1024)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 512M, 2G, 1048576)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def slurm_array_task() -> tuple[int, int] | None:
    """(task index, task count) of a SLURM job array task, from its environment; None outside one."""
    task_id = os.environ.get("SLURM_ARRAY_TASK_ID")
    count = os.environ.get("SLURM_ARRAY_TASK_COUNT")
    if task_id is None or count is None:
        return None
    first = int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))
    step = int(os.environ.get("SLURM_ARRAY_TASK_STEP", "1") or 1)  # --array=0-14:2
    return (int(task_id) - first) // step, int(count)


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))  # honours SLURM's CPU binding
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass
class ConvertOptions:
    """Everything ``wdsraft convert`` takes; see ``wdsraft convert --help``."""

    inputs: Sequence[str]
    output: str
    workdir: str | None = None
    seed: int = 0
    memory: int = DEFAULT_MEMORY
    samples_per_shard: int | None = None
    shard_size: int | None = None
    text_field: str = "text"
    id_field: str | None = None
    format: str = FORMAT_TXT_JSON
    on_bad_record: str = "error"
    workers: int = 1
    task_index: int = 0
    task_count: int = 1
    phase: str = "all"
    name: str | None = None
    buckets: int | None = None
    keep_workdir: bool = False
    overwrite: bool = False
    wait_timeout: float | None = None
    poll_interval: float = 2.0
    progress: bool = False

    def __post_init__(self) -> None:
        self.output = self.output.rstrip("/") or self.output
        if self.samples_per_shard is None and self.shard_size is None:
            self.samples_per_shard = DEFAULT_SAMPLES_PER_SHARD

    def check(self) -> None:
        problems = []
        if not self.inputs and self.phase in ("all", "scatter"):
            problems.append("no inputs")
        if self.format not in FORMATS:
            problems.append(f"--format must be one of {', '.join(FORMATS)}")
        if self.on_bad_record not in BAD_RECORD_POLICIES:
            problems.append("--on-bad-record must be 'error' or 'skip'")
        if self.phase not in PHASES:
            problems.append(f"--phase must be one of {', '.join(PHASES)}")
        if self.samples_per_shard is not None and self.samples_per_shard < 1:
            problems.append("--samples-per-shard must be at least 1")
        if self.shard_size is not None and self.shard_size < 1:
            problems.append("--shard-size must be at least 1 byte")
        if self.memory < 4 << 20:
            problems.append("--memory must be at least 4M")
        if self.workers < 1:
            problems.append("--workers must be at least 1")
        if self.task_count < 1 or not 0 <= self.task_index < self.task_count:
            problems.append(f"task index {self.task_index} is not in 0..{self.task_count - 1}")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            problems.append("--name may hold only letters, digits, '_', '-' and '.'")
        if self.buckets is not None and not 1 <= self.buckets <= MAX_BUCKETS:
            problems.append(f"--buckets must be in 1..{MAX_BUCKETS}")
        if problems:
            raise ConvertError("; ".join(problems))

    @property
    def dataset_name(self) -> str:
        if self.name:
            return self.name
        base = posixpath.basename(self.output.rstrip("/"))
        # What --name allows, from the output's base name: a shard name is part of a URL (Manifest.urls() over
        # HTTP); the %-escapes of sample keys would read as URL escapes there (v1.0 gave v1%2E0-*.tar: 404).
        return re.sub(r"[^A-Za-z0-9_.-]", "_", base) if base and base not in (".", "..") else "data"

    @property
    def work_directory(self) -> str:
        if self.workdir:
            return self.workdir
        path = local_path(self.output)
        if path is not None:
            return os.path.join(path, ".wdsraft-work")
        # Remote output: a local (shared, under SLURM) directory named after the output.
        return os.path.abspath(f".wdsraft-work-{hashlib.sha1(self.output.encode()).hexdigest()[:12]}")
