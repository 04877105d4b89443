"""Duplicate sample keys (``--id-field`` values that repeat, or become the same key: 7 and "7"), found with
bounded memory. Two samples under one key in a dataset are one sample to webdataset (their members are
grouped together) and a shard of them fails to read, so they are bad records.

The scatter phase writes, per unit, a 16-byte digest and the line of every record's key into a *keys file*,
partitioned by digest like the data file is by shuffle key (``KeySpiller``): equal keys land in the same
partition whatever input they come from. After the scatter phase, each partition is read from every unit
and sorted (``find_duplicates``): equal digests are equal keys (blake2b-128: a false match among 10^9 keys
has odds under 10^-20). The first record of a key (in input order) is kept; the others stop the conversion
(``--on-bad-record error``) or are rejected (``skip``): left out of the buckets they were scattered to,
counted as rejected, and written to ``rejects.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from wdsraft.convert.extents import read_extents, write_extent_table
from wdsraft.convert.keys import ShuffleKeys
from wdsraft.convert.options import ConvertError
from wdsraft.convert.workdir import Plan, WorkDir
from wdsraft.io.storage import write_bytes_atomic

KEY_RECORD = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("line", "<u8")])  # 24 bytes per record
# One row per rejected record: where it is, its shuffle bucket and key (to leave it out), and the record kept.
DUPLICATE = np.dtype(
    [("unit", "<i8"), ("line", "<i8"), ("bucket", "<i8"), ("key", "<u8"), ("kept_unit", "<i8"), ("kept_line", "<i8")]
)


def key_digests(keys: Sequence[bytes]) -> bytes:
    """The 16-byte digests of sample keys, concatenated."""
    return b"".join(hashlib.blake2b(key, digest_size=16).digest() for key in keys)


class KeySpiller:
    """Writes a unit's keys file: (digest, line) records, partitioned by digest, in spilled segments with
    the extent table and footer of a scatter data file (``read_extents`` reads both)."""

    def __init__(self, stream: object, partitions: int, budget: int):
        self.stream = stream
        self.partitions = np.uint64(partitions)
        self.budget = max(budget, KEY_RECORD.itemsize)
        self._held: list[np.ndarray] = []
        self._held_bytes = 0
        self.offset = 0
        self.extents: list[tuple[int, int, int, int]] = []  # (partition, offset, count, length)

    def add(self, digests: bytes, lines: Sequence[int]) -> None:
        if not lines:
            return
        pairs = np.frombuffer(digests, dtype=np.dtype([("hi", ">u8"), ("lo", ">u8")]))
        records = np.empty(len(lines), dtype=KEY_RECORD)
        records["hi"], records["lo"] = pairs["hi"], pairs["lo"]
        records["line"] = lines
        self._held.append(records)
        self._held_bytes += records.nbytes
        if self._held_bytes >= self.budget:
            self.spill()

    def _partition(self, records: np.ndarray) -> np.ndarray:
        return ((records["hi"] >> np.uint64(32)) * self.partitions) >> np.uint64(32)

    def spill(self) -> None:
        if not self._held:
            return
        records = np.concatenate(self._held)
        self._held, self._held_bytes = [], 0
        partitions = self._partition(records)
        order = np.argsort(partitions, kind="stable")
        records, partitions = records[order], partitions[order]
        bounds = np.searchsorted(partitions, np.arange(int(self.partitions) + 1, dtype=np.uint64))
        for partition in range(int(self.partitions)):
            first, end = int(bounds[partition]), int(bounds[partition + 1])
            if first < end:
                block = records[first:end].tobytes()
                self.stream.write(block)  # type: ignore[attr-defined]
                self.extents.append((partition, self.offset, end - first, len(block)))
                self.offset += len(block)

    def close(self) -> int:
        """Spill what is left and write the extent table and footer; returns the file's size."""
        self.spill()
        return write_extent_table(self.stream, self.extents, int(self.partitions), self.offset)  # type: ignore[arg-type]


def find_duplicates(workdir: WorkDir, sizes: Sequence[int], partition: int) -> np.ndarray:
    """The records of one partition whose key an earlier record (in input order) already has, as
    ``DUPLICATE`` rows (bucket and key filled in later)."""
    parts, units = [], []
    for unit, size in enumerate(sizes):
        path = workdir.unit_keys(unit)
        extents = read_extents(path, partition, size)
        if not len(extents):
            continue
        with open(path, "rb") as handle:
            for offset, count, length in extents.tolist():
                handle.seek(offset)
                parts.append(np.frombuffer(handle.read(length), dtype=KEY_RECORD, count=count))
                units.append(np.full(count, unit, dtype=np.int64))
    found = np.zeros(0, dtype=DUPLICATE)
    if not parts:
        return found
    records, unit_of = np.concatenate(parts), np.concatenate(units)
    order = np.lexsort((records["line"], unit_of, records["lo"], records["hi"]))  # by key, then input order
    records, unit_of = records[order], unit_of[order]
    same = (records["hi"][1:] == records["hi"][:-1]) & (records["lo"][1:] == records["lo"][:-1])
    if not same.any():
        return found
    # The first record of each run of equal keys is kept; each later one points at it.
    starts = np.flatnonzero(np.concatenate(([True], ~same)))
    first_of = starts[np.searchsorted(starts, np.arange(len(records)), side="right") - 1]
    repeated = np.flatnonzero(np.concatenate(([False], same)))
    found = np.zeros(len(repeated), dtype=DUPLICATE)
    found["unit"], found["line"] = unit_of[repeated], records["line"][repeated]
    found["kept_unit"], found["kept_line"] = unit_of[first_of[repeated]], records["line"][first_of[repeated]]
    return found


class Duplicates:
    """The rejected duplicates of a conversion (``WORKDIR/scatter/duplicates.npy``), by shuffle bucket."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    @classmethod
    def build(cls, plan: Plan, found: np.ndarray) -> Duplicates:
        """Fill in each duplicate's shuffle bucket and key: what the scatter phase gave its record."""
        rows = np.sort(found, order=["unit", "line"])
        for unit in np.unique(rows["unit"]).tolist():
            mine = rows["unit"] == unit
            keys = ShuffleKeys(plan.seed, plan.inputs[unit].name, plan.buckets)
            shuffle = keys.keys_at(rows["line"][mine])
            rows["key"][mine] = shuffle
            rows["bucket"][mine] = keys.bucket_of(shuffle).astype(np.int64)
        return cls(rows)

    def save(self, path: str) -> None:
        import io

        buffer = io.BytesIO()
        np.save(buffer, self.rows, allow_pickle=False)
        write_bytes_atomic(path, buffer.getvalue())

    @classmethod
    def load(cls, path: str) -> Duplicates | None:
        rows = _load_rows(path, os.path.getmtime(path)) if os.path.exists(path) else None
        return None if rows is None else cls(rows)

    def per_bucket(self, buckets: int) -> np.ndarray:
        return np.bincount(self.rows["bucket"], minlength=buckets).astype(np.int64)

    def per_unit(self, units: int) -> np.ndarray:
        return np.bincount(self.rows["unit"], minlength=units).astype(np.int64)

    def excluded(self, bucket: int) -> dict[int, np.ndarray]:
        """Per unit, the shuffle keys of its records to leave out of ``bucket``."""
        rows = self.rows[self.rows["bucket"] == bucket]
        return {unit: rows["key"][rows["unit"] == unit] for unit in np.unique(rows["unit"]).tolist()}

    def error(self, plan: Plan, workdir: str) -> ConvertError:
        row = self.rows[0]
        kept, repeated = plan.inputs[int(row["kept_unit"])].url, plan.inputs[int(row["unit"])].url
        more = f" ({len(self.rows)} records repeat a key in all)" if len(self.rows) > 1 else ""
        return ConvertError(
            f"{repeated}: line {int(row['line'])}: the sample key of {kept} line {int(row['kept_line'])} again "
            f'(--id-field {plan.settings["id_field"]!r}: equal values, or values such as 7 and "7", give one key)'
            f"{more}: fix the inputs and then remove the work directory {workdir} (it holds what was read from "
            "them), or pass --on-bad-record skip to keep the first and reject the others"
        )

    def rejects(self, plan: Plan) -> bytes:
        """The rejects.jsonl lines of the duplicates (no raw bytes: the input line and the line kept say
        where the record is)."""
        lines = []
        for row in self.rows.tolist():
            unit, line, _bucket, _key, kept_unit, kept_line = row
            reason = f"duplicate sample key: the same as {plan.inputs[kept_unit].url} line {kept_line} (kept)"
            lines.append(json.dumps({"input": plan.inputs[unit].url, "line": line, "reason": reason}) + "\n")
        return "".join(lines).encode("utf-8")


@lru_cache(maxsize=4)
def _load_rows(path: str, mtime: float) -> np.ndarray:
    rows = np.load(path, allow_pickle=False)
    if rows.dtype != DUPLICATE:
        raise ConvertError(f"{path}: not a duplicates file of this conversion")
    return rows
