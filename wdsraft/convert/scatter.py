"""The scatter phase: one job per input (a *unit*) reads its records, gives each a random key and
spills them, bucket by bucket, into the unit's data file (segments, then an extent table saying
where each bucket's segments lie); bad records go to the unit's rejects file.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import IO, Any

import numpy as np

from wdsraft.convert.events import BYTES_READ, SPILL, UNIT_DONE, emit
from wdsraft.convert.keys import ShuffleKeys
from wdsraft.convert.lines import InputDamaged, LineReader
from wdsraft.convert.options import ConvertError
from wdsraft.convert.records import BadRecord, PayloadCodec, SampleEncoder
from wdsraft.convert.workdir import Plan, WorkDir
from wdsraft.io.storage import abandon_write, open_atomic

RECORD_HEADER = np.dtype([("key", "<u8"), ("size", "<u4")])  # 12 bytes per record
_FOOTER = struct.Struct("<QQ8s")  # extent table offset, bucket count, magic
_FOOTER_MAGIC = b"WDSRSCT1"
_EXTENT = np.dtype([("offset", "<u8"), ("count", "<u8"), ("length", "<u8")])


class BucketSpiller:
    """Buffers records per bucket and appends them to a unit's data file when the budget is used up.

    Each spill writes, for every bucket holding records, one *segment*: the records' headers
    (random key, payload size) and then their payloads, in input order. ``close``
    appends the extent table (for each bucket, the offset, record count and length of each of
    its segments) and a footer pointing at it.
    """

    # Python's cost of holding one record's two bytes objects in a list, counted against the budget.
    PER_RECORD = 2 * (sys.getsizeof(b"") + 8) + RECORD_HEADER.itemsize

    def __init__(self, stream: IO[bytes], buckets: int, budget: int, codec: PayloadCodec):
        self.stream = stream
        self.buckets = buckets
        self.budget = budget
        self.codec = codec
        self.offset = 0
        self.buffered = 0
        # Per bucket: payload pieces (kept as the bytes objects they are: appending to one growing
        # bytearray would copy the data several times over) and the header columns.
        self._parts: dict[int, list[bytes]] = {}
        self._headers: dict[int, tuple[array, array]] = {}
        self._tar: dict[int, int] = {}
        self.extents: list[tuple[int, int, int, int]] = []  # (bucket, offset, count, length)
        self.counts = np.zeros(buckets, dtype=np.int64)
        self.payload_bytes = np.zeros(buckets, dtype=np.int64)
        self.tar_bytes = np.zeros(buckets, dtype=np.int64)
        self.spills = 0
        self.on_spill: Callable[[], None] | None = None

    def add(self, bucket: int, key: int, sample_key: bytes, members: Sequence[bytes]) -> None:
        parts = self._parts.get(bucket)
        if parts is None:
            parts = self._parts[bucket] = []
            self._headers[bucket] = (array("Q"), array("I"))
            self._tar[bucket] = 0
        keys, sizes = self._headers[bucket]
        head = self.codec.header.pack(len(sample_key), *map(len, members)) + sample_key
        size = len(head)
        if len(members) == 2 and len(members[0]) < 4096:  # txt+json: the small .json rides with the head
            head += members[0]
            parts.append(head)
            parts.append(members[1])
        else:
            parts.append(head)
            parts.extend(members)
        for member in members:
            size += len(member)
        keys.append(key)
        sizes.append(size)
        self._tar[bucket] += self.codec.tar_size(sample_key, members)
        self.buffered += size + self.PER_RECORD
        if self.buffered >= self.budget:
            self.spill()

    def spill(self) -> None:
        if not self.buffered:
            return
        for bucket in sorted(self._headers):
            keys, sizes = self._headers[bucket]
            header = np.empty(len(keys), dtype=RECORD_HEADER)
            header["key"] = np.frombuffer(keys, dtype=np.uint64)
            header["size"] = np.frombuffer(sizes, dtype=np.uint32)
            self.counts[bucket] += len(keys)
            self.payload_bytes[bucket] += int(header["size"].sum(dtype=np.int64))
            self.tar_bytes[bucket] += self._tar[bucket]
            self.stream.write(header.tobytes())
            for part in self._parts[bucket]:
                self.stream.write(part)
            length = header.nbytes + int(header["size"].sum(dtype=np.int64))
            self.extents.append((bucket, self.offset, len(keys), length))
            self.offset += length
        self._headers.clear()
        self._parts.clear()
        self._tar.clear()
        self.buffered = 0
        self.spills += 1
        if self.on_spill is not None:
            self.on_spill()

    def close(self) -> int:
        """Spill what is left and write the extent table and footer; returns the file's size."""
        self.spill()
        order = sorted(range(len(self.extents)), key=lambda i: self.extents[i][0])  # stable: spill order kept
        table = np.zeros(len(order), dtype=_EXTENT)
        starts = np.zeros(self.buckets + 1, dtype=np.uint64)
        for row, i in enumerate(order):
            bucket, offset, count, length = self.extents[i]
            table[row] = (offset, count, length)
            starts[bucket + 1] += 1
        starts = np.cumsum(starts, dtype=np.uint64)
        self.stream.write(starts.astype("<u8").tobytes())
        self.stream.write(table.tobytes())
        self.stream.write(_FOOTER.pack(self.offset, self.buckets, _FOOTER_MAGIC))
        return self.offset + starts.nbytes + table.nbytes + _FOOTER.size


def read_extents(path: str, bucket: int, size: int | None = None) -> np.ndarray:
    """The segments of ``bucket`` in a unit data file (an array of offset, count, length)."""
    if size is not None and os.path.getsize(path) != size:
        raise ConvertError(
            f"{path}: {os.path.getsize(path)} bytes, {size} expected (torn by a crash?): remove it and its "
            ".done file, and rerun the scatter phase"
        )
    with open(path, "rb") as handle:
        handle.seek(-_FOOTER.size, os.SEEK_END)
        table_offset, buckets, magic = _FOOTER.unpack(handle.read(_FOOTER.size))
        if magic != _FOOTER_MAGIC or not 0 <= bucket < buckets:
            raise ConvertError(f"{path}: not a scatter data file of this conversion (torn or foreign)")
        handle.seek(table_offset + 8 * bucket)
        first, last = struct.unpack("<QQ", handle.read(16))
        handle.seek(table_offset + 8 * (buckets + 1) + _EXTENT.itemsize * first)
        return np.frombuffer(handle.read(_EXTENT.itemsize * (last - first)), dtype=_EXTENT)


class RejectsWriter:
    """Bad records, verbatim, one JSON line each: input, line, reason and the raw bytes (as ``raw``
    when they are UTF-8, else as ``raw_base64``). The file is created on the first reject."""

    def __init__(self, path: str, url: str):
        self.path = path
        self.url = url
        self.count = 0
        self._stream: IO[bytes] | None = None

    def add(self, line: int, raw: bytes, reason: str) -> None:
        record: dict[str, Any] = {"input": self.url, "line": line, "reason": reason}
        try:
            record["raw"] = raw.decode("utf-8")
        except UnicodeDecodeError:
            record["raw_base64"] = base64.b64encode(raw).decode("ascii")
        if self._stream is None:
            self._stream = open_atomic(self.path)
        self._stream.write(json.dumps(record, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
        self.count += 1

    def commit(self) -> None:
        if self._stream is not None:
            self._stream.close()

    def abort(self) -> None:
        if self._stream is not None:
            abandon_write(self._stream)


class ScatterJob:
    """Scatters one input (a unit): reads its lines, turns records into samples, spreads them over the
    buckets into the unit's data file, writes its rejects, and then its done-file."""

    def __init__(self, plan: Plan, workdir: WorkDir, unit: int, budget: int, on_bad_record: str):
        self.plan = plan
        self.workdir = workdir
        self.unit = unit
        self.budget = budget
        self.on_bad_record = on_bad_record

    def run(self) -> dict[str, Any]:
        source = self.plan.inputs[self.unit]
        settings = self.plan.settings
        encoder = SampleEncoder(settings["format"], settings["text_field"], settings["id_field"])
        codec = PayloadCodec(encoder.extensions)
        keys = ShuffleKeys(self.plan.seed, source.name, self.plan.buckets)
        data_path = self.workdir.unit_data(self.unit)
        for path in (data_path, self.workdir.unit_rejects(self.unit)):
            WorkDir.clear_leftovers(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.workdir.unit_failed(self.unit))
        # No fsync: scratch data. A killed process loses nothing written; a machine crash that tears
        # the file is caught by the size check of the write phase.
        stream = open_atomic(data_path, fsync=False)
        rejects = RejectsWriter(self.workdir.unit_rejects(self.unit), source.url)
        # Leave room for what the reader holds besides the buffers (a chunk, its lines, a decoded
        # record) and for the allocator's slack (measured: about 1/8 and 6 MB).
        threshold = max(self.budget * 7 // 8 - (6 << 20), self.budget // 3)
        spiller = BucketSpiller(stream, self.plan.buckets, threshold, codec)
        spiller_budget_set = False
        spiller.on_spill = lambda: emit(SPILL, unit=self.unit)
        reader = LineReader(source, lambda n: emit(BYTES_READ, n))
        lines = blank = 0
        skip = self.on_bad_record == "skip"
        try:
            try:
                for first, batch in reader.batches():
                    if not spiller_budget_set:  # the reader now knows its decompression window
                        spiller.budget = max(threshold - reader.window, threshold // 2)
                        spiller_budget_set = True
                    lines += len(batch)
                    random_keys = keys.keys(first, len(batch))
                    buckets = keys.bucket_of(random_keys).tolist()
                    random_keys_list = random_keys.tolist()
                    for i, raw in enumerate(batch):
                        if not raw or raw.isspace():
                            blank += 1
                            continue
                        try:
                            key, members = encoder.encode(raw, source.name, first + i)
                        except BadRecord as bad:
                            if not skip:
                                raise ConvertError(f"{source.url}: line {first + i}: {bad.reason}") from None
                            rejects.add(first + i, raw, bad.reason)
                            continue
                        spiller.add(buckets[i], random_keys_list[i], key, members)
            except InputDamaged as damage:
                if not skip:
                    raise ConvertError(f"{source.url}: line {damage.line}: {damage.reason}") from None
                # The partial line (possibly empty) stands for everything the damage made unreadable.
                lines += 1
                rejects.add(damage.line, damage.partial, damage.reason + "; the rest of the file is unreadable")
            data_size = spiller.close()
            stream.close()
            rejects.commit()
        except BaseException as exn:
            abandon_write(stream)
            rejects.abort()
            if isinstance(exn, Exception):  # (not an interrupt: a preempted task is requeued and retries)
                # Tells the other tasks of an array, which would otherwise wait for this input forever. A
                # bad record fails again on every attempt; anything else (a permission, a full disk) may not.
                marker = {
                    "error": f"{exn}" if isinstance(exn, ConvertError) else f"{type(exn).__name__}: {exn}",
                    "on_bad_record": self.on_bad_record,
                    "transient": not isinstance(exn, ConvertError),
                }
                with contextlib.suppress(OSError):  # (the failure being reported may be the disk itself)
                    WorkDir.write_json(self.workdir.unit_failed(self.unit), marker)
            raise
        done = {
            "unit": self.unit,
            "url": source.url,
            "lines": lines,
            "blank_lines": blank,
            "records": lines - blank,
            "accepted": int(spiller.counts.sum()),
            "rejected": rejects.count,
            "bytes_in": reader.bytes_out,
            "data_size": data_size,
            "spills": spiller.spills,
            "bucket_counts": spiller.counts.tolist(),
            "bucket_tar_bytes": spiller.tar_bytes.tolist(),
            "bucket_payload_bytes": spiller.payload_bytes.tolist(),
        }
        WorkDir.write_json(self.workdir.unit_done(self.unit), done)
        emit(UNIT_DONE, unit=self.unit)
        return done


def run_scatter(plan: Plan, workdir: WorkDir, unit: int, budget: int, on_bad_record: str) -> dict[str, Any]:
    """Scatter one unit (what the job runner sends to a worker process); returns its done-record."""
    return ScatterJob(plan, workdir, unit, budget, on_bad_record).run()
