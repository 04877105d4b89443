"""Buckets read back for the write phase: where every shard lies in the global order (``ShardLayout``),
a bucket's records from every unit's data file (whole, by key slice, or by sorted rank), and the key
slices of a bucket larger than the memory budget.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from wdsraft.convert.duplicates import Duplicates
from wdsraft.convert.extents import read_extents
from wdsraft.convert.options import ConvertError
from wdsraft.convert.scatter import RECORD_HEADER
from wdsraft.convert.workdir import WorkDir


class ShardLayout:
    """Where every shard lies in the global order, from the scatter counts alone.

    The buckets' sorted records, concatenated bucket after bucket, are the whole corpus in
    random-key order; record ``r`` of that order (its global *rank*) goes to shard
    ``r // per_shard``, so every shard but the last holds exactly ``per_shard`` samples, as
    with ``ShardWriter``'s rollover, whatever the number of buckets. ``per_shard`` is
    ``--samples-per-shard``, or fewer where ``--shard-size`` asks for it: the shard size over
    the mean tar bytes of a sample (shuffled samples even out, so shards come close to it).

    Every shard is written by the job of the last bucket it touches: a shard that straddles
    buckets starts with records of earlier buckets, which that job reads from their scatter data.
    """

    def __init__(
        self, counts: np.ndarray, tar_bytes: np.ndarray, samples_per_shard: int | None, shard_size: int | None
    ):
        self.counts = counts.astype(np.int64)
        self.starts = (np.cumsum(self.counts) - self.counts).astype(np.int64)
        self.ends = self.starts + self.counts
        self.total = int(self.counts.sum())
        per_shard = samples_per_shard or max(1, self.total)
        total_bytes = int(tar_bytes.sum())
        if shard_size and total_bytes:
            per_shard = min(per_shard, max(1, round(shard_size * self.total / total_bytes)))
        self.per_shard = per_shard
        self.total_shards = -(-self.total // per_shard)

    def ranks(self, shard: int) -> tuple[int, int]:
        """The global ranks ``[first, end)`` of a shard's samples."""
        return shard * self.per_shard, min((shard + 1) * self.per_shard, self.total)

    def buckets_of(self, shard: int) -> list[int]:
        """The non-empty buckets holding part of a shard, in order."""
        first, end = self.ranks(shard)
        low = int(np.searchsorted(self.ends, first, side="right"))
        high = int(np.searchsorted(self.starts, end, side="left"))
        return [b for b in range(low, high) if self.counts[b] > 0]

    def owner(self, shard: int) -> int:
        """The bucket whose job writes the shard: the last one holding part of it."""
        return self.buckets_of(shard)[-1]


@dataclass
class LoadedRecords:
    """Records of (part of) a bucket in one buffer: their keys, where each payload starts, their units."""

    buffer: mmap.mmap | bytearray
    keys: np.ndarray
    starts: np.ndarray
    units: np.ndarray

    def order(self) -> np.ndarray:
        # Stable: equal keys (practically never) keep input order, so the result is still deterministic.
        return np.argsort(self.keys, kind="stable")

    def release(self) -> None:
        if isinstance(self.buffer, mmap.mmap):
            self.buffer.close()


def _allocate(size: int) -> mmap.mmap | bytearray:
    """A zeroed buffer outside the malloc heap (an anonymous mapping). Freed, it goes straight back to
    the system; a heap block that large may linger, and glibc's adaptive threshold would then keep
    later large blocks on the heap too, so that the process's RSS outgrows its live data."""
    return mmap.mmap(-1, size) if size else bytearray()


class BucketReader:
    """Reads one bucket's records back from every unit's data file."""

    # Memory per record while a bucket is in memory: header arrays, sort order, temporaries.
    PER_RECORD = 64

    def __init__(self, workdir: WorkDir, data_sizes: Sequence[int], bucket: int):
        self.workdir = workdir
        self.bucket = bucket
        self.extents: list[tuple[int, int, int, int]] = []  # (unit, offset, count, length)
        for unit, size in enumerate(data_sizes):
            for offset, count, length in read_extents(workdir.unit_data(unit), bucket, size).tolist():
                self.extents.append((unit, offset, count, length))
        # Records rejected as duplicates of a key after they were scattered here: per unit, their keys.
        duplicates = Duplicates.load(workdir.duplicates)
        self.excluded = duplicates.excluded(bucket) if duplicates is not None else {}

    @property
    def count(self) -> int:
        return sum(extent[2] for extent in self.extents) - sum(len(keys) for keys in self.excluded.values())

    def _kept(self, unit: int, keys: np.ndarray) -> np.ndarray | None:
        """Which of a segment's records are kept (None: all of them)."""
        excluded = self.excluded.get(unit)
        return None if excluded is None else ~np.isin(keys, excluded)

    @property
    def weight(self) -> int:
        """Bytes needed to hold the whole bucket in memory and sort it."""
        return sum(extent[3] for extent in self.extents) + self.PER_RECORD * self.count

    def load(self) -> LoadedRecords:
        """The whole bucket, in one read per segment."""
        total = sum(extent[3] for extent in self.extents)
        buffer = _allocate(total)
        view = memoryview(buffer)
        keys, starts, units = [], [], []
        at = 0
        handle: Any = None
        current = -1
        try:
            for unit, offset, count, length in self.extents:
                if unit != current:
                    if handle is not None:
                        handle.close()
                    handle = open(self.workdir.unit_data(unit), "rb")  # noqa: SIM115 - closed below
                    current = unit
                assert handle is not None
                handle.seek(offset)
                if handle.readinto(view[at : at + length]) != length:
                    raise ConvertError(f"{self.workdir.unit_data(unit)}: truncated scatter data file")
                header = np.frombuffer(buffer, dtype=RECORD_HEADER, count=count, offset=at)
                sizes = header["size"].astype(np.int64)
                segment_keys, segment_starts = header["key"].copy(), at + header.nbytes + np.cumsum(sizes) - sizes
                kept = self._kept(unit, segment_keys)
                if kept is not None:
                    segment_keys, segment_starts = segment_keys[kept], segment_starts[kept]
                keys.append(segment_keys)
                starts.append(segment_starts)
                units.append(np.full(len(segment_keys), unit, dtype=np.int32))
                del header  # a view of the buffer: it must go before the buffer can be unmapped
                at += length
        finally:
            if handle is not None:
                handle.close()
        view.release()
        return LoadedRecords(buffer, _concat(keys, np.uint64), _concat(starts, np.int64), _concat(units, np.int32))

    def headers(self) -> tuple[np.ndarray, np.ndarray]:
        """Only the keys and payload sizes of all records, for a bucket too big to load."""
        keys, sizes = [], []
        for unit, offset, count, _ in self.extents:
            with open(self.workdir.unit_data(unit), "rb") as handle:
                handle.seek(offset)
                header = np.frombuffer(handle.read(count * RECORD_HEADER.itemsize), dtype=RECORD_HEADER)
            kept = self._kept(unit, header["key"])
            if kept is not None:
                header = header[kept]
            keys.append(header["key"].copy())
            sizes.append(header["size"].astype(np.int64))
        return _concat(keys, np.uint64), _concat(sizes, np.int64)

    def locations(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Unit, file offset and size of every record's payload, in sorted (random-key) order: what
        :meth:`load` would give, from the headers alone."""
        keys, units, positions, sizes = [], [], [], []
        for unit, offset, count, _ in self.extents:
            with open(self.workdir.unit_data(unit), "rb") as handle:
                handle.seek(offset)
                header = np.frombuffer(handle.read(count * RECORD_HEADER.itemsize), dtype=RECORD_HEADER)
            size = header["size"].astype(np.int64)
            position = offset + header.nbytes + np.cumsum(size) - size
            kept = self._kept(unit, header["key"])
            if kept is not None:
                header, size, position = header[kept], size[kept], position[kept]
            keys.append(header["key"].copy())
            units.append(np.full(len(header), unit, dtype=np.int32))
            positions.append(position)
            sizes.append(size)
        order = np.argsort(_concat(keys, np.uint64), kind="stable")
        return _concat(units, np.int32)[order], _concat(positions, np.int64)[order], _concat(sizes, np.int64)[order]

    def read_ranks(self, first: int, end: int) -> Iterator[tuple[int, bytes]]:
        """The payloads of the records of sorted ranks ``[first, end)``, with their unit, one read each."""
        units, positions, sizes = (column[first:end].tolist() for column in self.locations())
        descriptors: dict[int, int] = {}
        try:
            for unit, position, size in zip(units, positions, sizes, strict=True):
                if unit not in descriptors:
                    descriptors[unit] = os.open(self.workdir.unit_data(unit), os.O_RDONLY)
                yield unit, os.pread(descriptors[unit], size, position)
        finally:
            for descriptor in descriptors.values():
                os.close(descriptor)

    def load_slice(self, low: int, high: int) -> LoadedRecords:
        """The records whose key lies in ``[low, high]``: headers are re-read, then the selected
        payloads one by one (slower; used only when a bucket does not fit the budget)."""
        selected: list[tuple[int, int, int, int]] = []  # unit, file offset, size, key
        total = 0
        for unit, offset, count, _ in self.extents:
            path = self.workdir.unit_data(unit)
            with open(path, "rb") as handle:
                handle.seek(offset)
                header = np.frombuffer(handle.read(count * RECORD_HEADER.itemsize), dtype=RECORD_HEADER)
            sizes = header["size"].astype(np.int64)
            positions = offset + header.nbytes + np.cumsum(sizes) - sizes
            selected_keys = (header["key"] >= np.uint64(low)) & (header["key"] <= np.uint64(high))
            kept = self._kept(unit, header["key"])
            keep = np.nonzero(selected_keys if kept is None else selected_keys & kept)[0]
            for i in keep.tolist():
                selected.append((unit, int(positions[i]), int(sizes[i]), int(header["key"][i])))
                total += int(sizes[i])
        buffer = _allocate(total)
        view = memoryview(buffer)
        starts = np.empty(len(selected), dtype=np.int64)
        at = 0
        descriptor, current = -1, -1
        try:
            for row, (unit, position, size, _) in enumerate(selected):
                if unit != current:
                    if descriptor >= 0:
                        os.close(descriptor)
                    descriptor, current = os.open(self.workdir.unit_data(unit), os.O_RDONLY), unit
                view[at : at + size] = os.pread(descriptor, size, position)
                starts[row] = at
                at += size
        finally:
            if descriptor >= 0:
                os.close(descriptor)
        view.release()
        keys = np.array([item[3] for item in selected], dtype=np.uint64)
        units = np.array([item[0] for item in selected], dtype=np.int32)
        return LoadedRecords(buffer, keys, starts, units)


def _concat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def key_slices(sorted_keys: np.ndarray, weights: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Split sorted keys into inclusive key ranges whose records weigh at most ``budget`` each
    (a single record heavier than that gets a range of its own); equal keys stay together."""
    slices: list[tuple[int, int]] = []
    count = len(sorted_keys)
    start = 0
    cumulative = np.cumsum(weights)
    while start < count:
        base = cumulative[start - 1] if start else 0
        end = int(np.searchsorted(cumulative, base + budget, side="right"))
        end = max(end, start + 1)
        while end < count and sorted_keys[end] == sorted_keys[end - 1]:
            end += 1
        slices.append((int(sorted_keys[start]), int(sorted_keys[end - 1])))
        start = end
    return slices
