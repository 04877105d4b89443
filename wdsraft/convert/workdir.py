"""The work directory (the plan, the scatter data, the done-files of units and buckets, the staging
area; every file written atomically) and the plan: the inputs, the settings that shape the output
and the number of buckets, which every task and every rerun works from.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from wdsraft.convert.inputs import InputFile
from wdsraft.convert.options import MAX_BUCKETS, ConvertError, ConvertOptions
from wdsraft.io.storage import write_bytes_atomic

PLAN_FORMAT = "wdsraft-convert-plan"
PLAN_VERSION = 1
# A bucket is planned at half a worker's share of --memory.
BUCKET_FRACTION = 2


#: What ``os.link`` fails with on a file system without hard links.
_NO_HARD_LINKS = frozenset({errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EXDEV})
_PLAN_WAIT = 300.0  # seconds a task waits for the plan another task claimed


class WorkDir:
    """The shared work directory: the plan, the scatter phase's data files, the done-files of units
    and buckets, and the staging area for uploads. Every file in it is written atomically."""

    def __init__(self, root: str):
        self.root = root
        self.plan = os.path.join(root, "plan.json")
        self.finalize_lock = os.path.join(root, "finalize.lock")

    def _unit(self, unit: int, suffix: str) -> str:
        return os.path.join(self.root, "scatter", f"unit-{unit:06d}{suffix}")

    def unit_data(self, unit: int) -> str:
        return self._unit(unit, ".data")

    def unit_done(self, unit: int) -> str:
        return self._unit(unit, ".done")

    def unit_rejects(self, unit: int) -> str:
        return self._unit(unit, ".rejects.jsonl")

    def unit_failed(self, unit: int) -> str:
        return self._unit(unit, ".failed")

    def unit_keys(self, unit: int) -> str:
        """The digests of the unit's sample keys (with ``--id-field``), for finding duplicates."""
        return self._unit(unit, ".keys")

    @property
    def duplicates(self) -> str:
        return os.path.join(self.root, "scatter", "duplicates.npy")

    @property
    def duplicate_rejects(self) -> str:
        return os.path.join(self.root, "scatter", "duplicates.rejects.jsonl")

    def bucket_done(self, bucket: int) -> str:
        return os.path.join(self.root, "write", f"bucket-{bucket:06d}.done")

    def staging(self, bucket: int) -> str:
        return os.path.join(self.root, "staging", f"bucket-{bucket:06d}")

    def remove(self) -> None:
        """Remove what a conversion put here, and the directory if that leaves it empty: never anything
        else (a work directory may be a shared scratch directory, or the output's own)."""
        for part in ("scatter", "write", "staging"):
            shutil.rmtree(os.path.join(self.root, part), ignore_errors=True)
        for path in (self.plan, self.finalize_lock):
            self.clear_leftovers(path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        with contextlib.suppress(OSError):  # (not empty: other files were there before)
            os.rmdir(self.root)

    def create_plan(self, raw: bytes) -> bool:
        """Write the plan unless there is one: False when another task's plan is already there. Written
        whole under a temporary name, then linked to its name (which fails if taken): a plan is never
        replaced, and never seen partly written."""
        descriptor, temporary = tempfile.mkstemp(
            prefix=f".{os.path.basename(self.plan)}.tmp-{os.getpid()}-", dir=self.root
        )
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(raw)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temporary, self.plan)
            except FileExistsError:
                return False
            except OSError as exn:  # (no hard links here: s3fs, gcsfuse, some SMB mounts)
                if exn.errno not in _NO_HARD_LINKS:
                    raise
                return self._create_plan_without_links(temporary)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)

    def _create_plan_without_links(self, temporary: str) -> bool:
        """``create_plan`` where the file system has no hard links: an exclusively created claim file decides
        which task writes the plan (then renamed into place, whole); the others wait for it to appear."""
        try:
            os.close(os.open(self.plan + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            deadline = time.monotonic() + _PLAN_WAIT
            while not os.path.exists(self.plan):
                if time.monotonic() > deadline:
                    raise ConvertError(
                        f"{self.plan}.claim exists but no plan came in {_PLAN_WAIT:.0f} s: another task died while "
                        "planning; remove the claim file and rerun"
                    ) from None
                time.sleep(0.2)
            return False
        os.replace(temporary, self.plan)
        return True

    @staticmethod
    def read_json(path: str) -> dict[str, Any] | None:
        try:
            with open(path, "rb") as handle:
                return json.loads(handle.read())
        except FileNotFoundError:
            return None

    @staticmethod
    def write_json(path: str, record: dict[str, Any]) -> None:
        write_bytes_atomic(path, json.dumps(record, separators=(",", ":")).encode("utf-8"))

    @staticmethod
    def clear_leftovers(path: str) -> None:
        """Remove the temporary files a killed writer of ``path`` left (``.NAME.tmp-PID-XXXX``)."""
        directory, name = os.path.split(path)
        for leftover in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.tmp-*")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)


@dataclass
class Plan:
    """What a conversion is: its inputs, the settings that shape the output, and the number of
    buckets. Written once to ``WORKDIR/plan.json``; every task and every rerun works from it."""

    inputs: list[InputFile]
    output: str
    settings: dict[str, Any]
    buckets: int

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.inputs, self.settings)

    def to_json(self) -> bytes:
        record = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "fingerprint": self.fingerprint,
            "output": self.output,
            "settings": self.settings,
            "buckets": self.buckets,
            "inputs": [item.to_dict() for item in self.inputs],
        }
        return json.dumps(record, indent=1).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes, path: str) -> Plan:
        try:
            record = json.loads(raw)
        except ValueError:
            raise ConvertError(f"{path}: not a conversion plan") from None
        if record.get("format") != PLAN_FORMAT or record.get("version") != PLAN_VERSION:
            raise ConvertError(f"{path}: not a conversion plan of this version")
        inputs = [InputFile.from_dict(item) for item in record["inputs"]]
        return cls(inputs, record["output"], record["settings"], record["buckets"])

    @property
    def seed(self) -> int:
        return int(self.settings["seed"])

    @property
    def name(self) -> str:
        return str(self.settings["name"])

    def shard_name(self, number: int) -> str:
        return f"{self.name}-{number:06d}.tar"


def plan_settings(options: ConvertOptions) -> dict[str, Any]:
    """The options that shape the output (``--workers``, tasks, ``--memory`` do not)."""
    return {
        "seed": options.seed,
        "format": options.format,
        "text_field": options.text_field,
        "id_field": options.id_field,
        "samples_per_shard": options.samples_per_shard,
        "shard_size": options.shard_size,
        "name": options.dataset_name,
    }


def fingerprint(inputs: Sequence[InputFile], settings: dict[str, Any]) -> str:
    identity = {"inputs": [[item.url, item.size] for item in inputs], "settings": settings}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()


def choose_buckets(inputs: Sequence[InputFile], memory: int, workers: int = 1, tasks: int = 1) -> int:
    """Buckets of about half a worker's share of ``memory`` (of uncompressed input), and at least one
    per worker of every task. The output does not depend on this number; it trades the copies made
    for shards that straddle buckets (fewer, larger buckets) against parallelism and the headroom
    left for an underestimated input size (a bucket over the budget is written in slower slices)."""
    total = sum(item.estimated_bytes() for item in inputs)
    target = max(1, memory // (BUCKET_FRACTION * workers))
    return max(1, min(MAX_BUCKETS, max(math.ceil(total / target), workers * tasks)))
