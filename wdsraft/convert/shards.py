"""The write phase: one job per bucket sorts the bucket's records by random key and cuts them into
shards (``ShardCutter``), which go to a local directory or to S3 (the shard sinks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from wdsraft.convert.buckets import BucketReader, LoadedRecords, ShardLayout, key_slices
from wdsraft.convert.events import BUCKET_DONE, SAMPLES_WRITTEN, SHARD_WRITTEN, emit
from wdsraft.convert.options import ConvertError
from wdsraft.convert.records import PayloadCodec, extensions_of
from wdsraft.convert.workdir import Plan, WorkDir
from wdsraft.index.shard_index import INDEX_SUFFIX
from wdsraft.io.s3 import s5cmd_binary, s5cmd_command
from wdsraft.io.storage import is_s3, local_path
from wdsraft.tar.assembler import ShardAssembler
from wdsraft.tar.format import HeaderBuilder

logger = logging.getLogger(__name__)


class ShardSink:
    """Where a bucket's shards go: a local directory (written in place, atomically)."""

    def __init__(self, output: str):
        self.output = output
        self.headers = HeaderBuilder("bigdata", "bigdata", 0o444)  # TarWriter's defaults

    def url(self, name: str) -> str:
        return os.path.join(self.output, name)

    def open(self, name: str) -> ShardAssembler:
        WorkDir.clear_leftovers(self.url(name))
        WorkDir.clear_leftovers(self.url(name) + INDEX_SUFFIX)
        return ShardAssembler(self.url(name), self.headers)

    def commit(self) -> None:
        """Called once all the bucket's shards are written."""


class SmartOpenShardSink(ShardSink):
    """An ``s3://`` prefix, streamed through smart_open (an object appears when its upload completes)."""

    def url(self, name: str) -> str:
        return f"{self.output}/{name}"

    def open(self, name: str) -> ShardAssembler:
        return ShardAssembler(self.url(name), self.headers)


class S5cmdShardSink(ShardSink):
    """An ``s3://`` prefix: shards are written to a local staging directory, then uploaded together by
    ``s5cmd cp`` (parallel multipart uploads; an object appears only when complete)."""

    def __init__(self, output: str, staging: str, binary: str):
        super().__init__(output)
        self.staging = staging
        self.binary = binary
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)

    def open(self, name: str) -> ShardAssembler:
        return ShardAssembler(os.path.join(self.staging, name), self.headers, fsync=False)

    def commit(self) -> None:
        if not os.listdir(self.staging):
            return
        command = s5cmd_command(self.binary, "cp", os.path.join(self.staging, "*"), self.output + "/")
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ConvertError(
                f"s5cmd upload to {self.output} failed: {result.stderr.strip() or result.stdout.strip()}"
            )
        shutil.rmtree(self.staging, ignore_errors=True)


def s3_uploader() -> str | None:
    """The s5cmd binary to upload with, or None for smart_open (``WDSRAFT_S3_WRITER=auto|s5cmd|smart_open``)."""
    try:
        return s5cmd_binary("WDSRAFT_S3_WRITER")
    except FileNotFoundError as missing:
        raise ConvertError(str(missing)) from None


def shard_sink(output: str, staging: str) -> ShardSink:
    if not is_s3(output):
        return ShardSink(local_path(output) or output)
    binary = s3_uploader()
    return S5cmdShardSink(output, staging, binary) if binary else SmartOpenShardSink(output)


class ShardCutter:
    """Feeds one bucket's records, in sorted order, into the shards its job writes.

    The record of global rank ``r`` belongs to shard ``r // per_shard``. The job writes the
    shards whose last bucket is its own: a shard that began in earlier buckets is opened with
    their records (read from their scatter data), and the records of a shard that goes on into
    later buckets are left to the job of the bucket where it ends.
    """

    def __init__(
        self,
        layout: ShardLayout,
        bucket: int,
        sink: ShardSink,
        names: Callable[[int], str],
        earlier: Callable[[int], BucketReader],
        codec: PayloadCodec,
        per_unit: np.ndarray,
    ):
        self.layout = layout
        self.bucket = bucket
        self.sink = sink
        self.names = names
        self.earlier = earlier
        self.codec = codec
        self.per_unit = per_unit
        self.per_shard = layout.per_shard
        self.rank = int(layout.starts[bucket])
        self.shard = -1
        self.writer: ShardAssembler | None = None
        self.written: list[dict[str, Any]] = []

    def take(self) -> ShardAssembler | None:
        """The shard writer for the next record, or None when a later bucket's job writes it."""
        shard = self.rank // self.per_shard
        self.rank += 1
        if shard != self.shard:
            self._finish()
            self.shard = shard
            if self.layout.owner(shard) == self.bucket:
                self._open(shard)
        return self.writer

    def _open(self, shard: int) -> None:
        self.writer = self.sink.open(self.names(shard))
        first, end = self.layout.ranks(shard)
        for bucket in self.layout.buckets_of(shard)[:-1]:  # the head of a shard straddling buckets
            start = int(self.layout.starts[bucket])
            reader = self.earlier(bucket)
            for unit, payload in reader.read_ranks(max(first, start) - start, min(end, start + reader.count) - start):
                self.writer.add(*self.codec.decode(memoryview(payload), 0))
                self.per_unit[unit] += 1

    def _finish(self) -> None:
        if self.writer is None:
            return
        writer, self.writer = self.writer, None
        try:
            index = writer.close()
        except BaseException:
            # (detached above: abort() would not see it) Its temporary files go; a shard already renamed
            # into place whose index could not be written goes too (no shard without its index is left).
            writer.abort()
            local = local_path(writer.url)
            if local is not None and not os.path.exists(local + INDEX_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(local)
            raise
        self.written.append(
            {"name": self.names(self.shard), "samples": index.num_samples, "size": index.size, "sha256": index.sha256}
        )
        emit(SHARD_WRITTEN, shard=self.shard)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> list[dict[str, Any]]:
        self._finish()
        return self.written

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


class BucketJob:
    """Writes one bucket: loads it (or key slices of it, when it exceeds the budget), sorts it by
    random key, and writes its records into their shards, then the bucket's done-file."""

    def __init__(
        self,
        plan: Plan,
        workdir: WorkDir,
        bucket: int,
        layout: ShardLayout,
        data_sizes: Sequence[int],
        budget: int,
    ):
        self.plan = plan
        self.workdir = workdir
        self.bucket = bucket
        self.layout = layout
        self.data_sizes = data_sizes
        self.budget = budget

    def run(self) -> dict[str, Any]:
        codec = PayloadCodec(extensions_of(self.plan.settings["format"]))
        reader = BucketReader(self.workdir, self.data_sizes, self.bucket)
        count = reader.count
        expected = int(self.layout.counts[self.bucket])
        if count != expected:
            raise ConvertError(f"bucket {self.bucket}: {count} records in the data files, {expected} in the done-files")
        sink = shard_sink(self.plan.output, self.workdir.staging(self.bucket))
        per_unit = np.zeros(len(self.plan.inputs), dtype=np.int64)
        cutter = ShardCutter(
            self.layout,
            self.bucket,
            sink,
            self.plan.shard_name,
            lambda bucket: BucketReader(self.workdir, self.data_sizes, bucket),
            codec,
            per_unit,
        )
        # The shard being assembled holds up to two blocks besides the records.
        budget = max(self.budget - 2 * ShardAssembler.BLOCK, self.budget // 2)
        try:
            if reader.weight <= budget:
                loaded = reader.load()
                _write_sorted(cutter, codec, loaded, loaded.order(), per_unit)
                del loaded
            else:
                # Too big for the budget (compressed inputs expanded more than assumed, or many
                # workers share a small budget): sort the headers alone, then load and write the
                # records one key slice at a time.
                keys, sizes = reader.headers()
                order = np.argsort(keys, kind="stable")
                slices = key_slices(keys[order], sizes[order] + BucketReader.PER_RECORD, budget // 2)
                del keys, sizes, order
                logger.info("bucket %d exceeds the memory budget: writing it in %d slices", self.bucket, len(slices))
                for low, high in slices:
                    part = reader.load_slice(low, high)
                    _write_sorted(cutter, codec, part, part.order(), per_unit)
                    del part
            written = cutter.close()
        except BaseException:
            cutter.abort()
            raise
        sink.commit()
        done = {
            "bucket": self.bucket,
            "shards": written,
            "per_unit": [[unit, int(n)] for unit, n in enumerate(per_unit.tolist()) if n],
        }
        WorkDir.write_json(self.workdir.bucket_done(self.bucket), done)
        emit(BUCKET_DONE, bucket=self.bucket)
        return done


def _write_sorted(
    cutter: ShardCutter, codec: PayloadCodec, loaded: LoadedRecords, order: np.ndarray, per_unit: np.ndarray
) -> None:
    view = memoryview(loaded.buffer)
    try:
        starts = loaded.starts[order].tolist()
        units = loaded.units[order].tolist()
        for count, (start, unit) in enumerate(zip(starts, units, strict=True), start=1):
            writer = cutter.take()
            if writer is not None:
                writer.add(*codec.decode(view, start))
                per_unit[unit] += 1
            if count % 1024 == 0:
                emit(SAMPLES_WRITTEN, 1024)
        emit(SAMPLES_WRITTEN, len(starts) % 1024)
    except BaseException:
        # The traceback's frames hold views of the buffer, so it cannot be unmapped yet (it is once they
        # go), and the flush may fail again (a full disk): the error to report is the one raised.
        with contextlib.suppress(BufferError, OSError):
            _release(cutter, view, loaded)
        raise
    _release(cutter, view, loaded)


def _release(cutter: ShardCutter, view: memoryview, loaded: LoadedRecords) -> None:
    cutter.flush()  # the shard being written holds views of the buffer
    view.release()
    loaded.release()


def run_bucket(
    plan: Plan, workdir: WorkDir, bucket: int, layout: ShardLayout, sizes: list[int], budget: int
) -> dict[str, Any]:
    """Write one bucket (what the job runner sends to a worker process); returns its done-record."""
    return BucketJob(plan, workdir, bucket, layout, sizes, budget).run()
