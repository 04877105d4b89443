"""The scatter phase: one job per input (a *unit*) reads its records, gives each a random key and
spills them, bucket by bucket, into the unit's data file (segments, then an extent table saying
where each bucket's segments lie); bad records go to the unit's rejects file.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import IO, Any

import numpy as np

from wdsraft.convert.duplicates import KeySpiller, key_digests
from wdsraft.convert.events import BYTES_READ, SPILL, UNIT_DONE, emit
from wdsraft.convert.extents import write_extent_table
from wdsraft.convert.inputs import local_version
from wdsraft.convert.keys import ShuffleKeys
from wdsraft.convert.lines import InputDamaged, LineReader
from wdsraft.convert.options import ConvertError
from wdsraft.convert.records import BadRecord, PayloadCodec, SampleEncoder
from wdsraft.convert.workdir import Plan, WorkDir
from wdsraft.io.storage import abandon_write, open_atomic

RECORD_HEADER = np.dtype([("key", "<u8"), ("size", "<u4")])  # 12 bytes per record


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
        return write_extent_table(self.stream, self.extents, self.buckets, self.offset)


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
        keys_path = self.workdir.unit_keys(self.unit)
        for path in (data_path, self.workdir.unit_rejects(self.unit), keys_path):
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
        # With --id-field, keys may repeat: their digests go to the keys file (a 16th of the budget), to be
        # compared once every input is scattered. Without it, keys are input name and line: unique.
        key_stream = key_spiller = None
        if settings["id_field"] is not None:
            key_stream = open_atomic(keys_path, fsync=False)
            key_spiller = KeySpiller(key_stream, self.plan.buckets, threshold // 16)
            threshold -= threshold // 16
        spiller = BucketSpiller(stream, self.plan.buckets, threshold, codec)
        spiller_budget_set = False
        spiller.on_spill = lambda: emit(SPILL, unit=self.unit)
        stored = 0  # the stored (compressed) bytes read, as the plan's size counts them

        def advance(count: int) -> None:
            nonlocal stored
            stored += count
            emit(BYTES_READ, count)

        reader = LineReader(source, advance)
        lines = blank = 0
        skip = self.on_bad_record == "skip"
        try:
            self._check_unchanged(None)
            try:
                for first, batch in reader.batches():
                    if not spiller_budget_set:  # the reader now knows its decompression window
                        spiller.budget = max(threshold - reader.window, threshold // 2)
                        spiller_budget_set = True
                    lines += len(batch)
                    random_keys = keys.keys(first, len(batch))
                    buckets = keys.bucket_of(random_keys).tolist()
                    random_keys_list = random_keys.tolist()
                    sample_keys: list[bytes] = []
                    key_lines: list[int] = []
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
                        if key_spiller is not None:
                            sample_keys.append(key)
                            key_lines.append(first + i)
                    if key_spiller is not None:
                        key_spiller.add(key_digests(sample_keys), key_lines)
                self._check_unchanged(stored)
            except InputDamaged as damage:
                if not skip:
                    raise ConvertError(f"{source.url}: line {damage.line}: {damage.reason}") from None
                # The partial line (possibly empty) stands for everything the damage made unreadable.
                lines += 1
                rejects.add(damage.line, damage.partial, damage.reason + "; the rest of the file is unreadable")
                self._check_unchanged(None)  # (reading stopped at the damage: no whole size to compare)
            data_size = spiller.close()
            stream.close()
            keys_size = None
            if key_spiller is not None and key_stream is not None:
                keys_size = key_spiller.close()
                key_stream.close()
            rejects.commit()
        except BaseException as exn:
            abandon_write(stream)
            if key_stream is not None:
                abandon_write(key_stream)
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
            "keys_size": keys_size,
            "spills": spiller.spills,
            "bucket_counts": spiller.counts.tolist(),
            "bucket_tar_bytes": spiller.tar_bytes.tolist(),
            "bucket_payload_bytes": spiller.payload_bytes.tolist(),
        }
        WorkDir.write_json(self.workdir.unit_done(self.unit), done)
        emit(UNIT_DONE, unit=self.unit)
        return done

    def _check_unchanged(self, stored: int | None) -> None:
        """Refuse an input changed since it was planned: read to its end (``stored`` bytes) at another size
        than planned, or (local) with another modification time. Its records would not be the planned
        input's, and the plan, every task's, says what the conversion is."""
        source = self.plan.inputs[self.unit]
        now = local_version(source.url)
        if stored is not None and stored != source.size:
            change = f"{stored} bytes read, {source.size} planned"
        elif source.version is not None and now is not None and now != source.version:
            change = "another modification time than planned"
        else:
            return
        raise ConvertError(
            f"{source.url}: the input changed since the conversion was planned ({change}): remove the work "
            f"directory {self.workdir.root} and rerun"
        )


def run_scatter(plan: Plan, workdir: WorkDir, unit: int, budget: int, on_bad_record: str) -> dict[str, Any]:
    """Scatter one unit (what the job runner sends to a worker process); returns its done-record."""
    return ScatterJob(plan, workdir, unit, budget, on_bad_record).run()
