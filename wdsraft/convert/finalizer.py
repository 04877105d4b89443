"""The finalize phase: check the books, write the manifest and the rejects file, remove the work directory."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from wdsraft.convert.buckets import ShardLayout
from wdsraft.convert.duplicates import Duplicates
from wdsraft.convert.options import ConvertError, ConvertOptions
from wdsraft.convert.report import ConvertReport, InputReport
from wdsraft.convert.workdir import Plan, WorkDir
from wdsraft.index.manifest import MANIFEST_NAME, Manifest, ManifestEntry
from wdsraft.index.shard_index import INDEX_SUFFIX
from wdsraft.io.s3 import list_objects
from wdsraft.io.storage import abandon_write, is_s3, local_path, open_atomic

logger = logging.getLogger(__name__)

REJECTS_NAME = "rejects.jsonl"


class Finalizer:
    """Checks the books, writes the manifest and the rejects file, and removes the work directory.

    The books: for every input, the records read (non-blank lines) must equal the samples found in
    the shards (counted by the write phase, per input) plus the records rejected, and every shard
    must exist with the size its index records.
    """

    def __init__(
        self, plan: Plan, workdir: WorkDir, layout: ShardLayout, options: ConvertOptions, report: ConvertReport
    ):
        self.plan = plan
        self.workdir = workdir
        self.layout = layout
        self.options = options
        self.report = report

    def run(self) -> None:
        plan = self.plan
        missing = [b for b in range(plan.buckets) if not os.path.exists(self.workdir.bucket_done(b))]
        if missing:
            owners = sorted({b % self.options.task_count for b in missing})
            raise ConvertError(
                f"the write phase has not finished: {len(missing)} buckets left (e.g. {missing[:5]}; "
                f"tasks {owners[:10]} of {self.options.task_count})"
            )
        inputs = []
        for unit, source in enumerate(plan.inputs):
            done = WorkDir.read_json(self.workdir.unit_done(unit))
            if done is None:
                raise ConvertError(f"no scatter record for {source.url}")
            inputs.append(
                InputReport(source.url, done["lines"], done["blank_lines"], done["records"], 0, done["rejected"])
            )
        duplicates = Duplicates.load(self.workdir.duplicates)
        if duplicates is not None:
            for unit, count in enumerate(duplicates.per_unit(len(inputs)).tolist()):
                inputs[unit].rejected += count
        shards: list[dict[str, Any]] = []
        for bucket in range(plan.buckets):
            done = WorkDir.read_json(self.workdir.bucket_done(bucket))
            assert done is not None
            shards.extend(done["shards"])
            for unit, count in done["per_unit"]:
                inputs[unit].samples += count
        expected = [plan.shard_name(shard) for shard in range(self.layout.total_shards)]
        if [shard["name"] for shard in shards] != expected:
            raise ConvertError(f"the buckets wrote {len(shards)} shards, {len(expected)} expected")
        unbalanced = [item for item in inputs if not item.balanced]
        if unbalanced:
            raise ConvertError(
                "records lost: "
                + "; ".join(
                    f"{i.url}: {i.records} read, {i.samples} written, {i.rejected} rejected" for i in unbalanced
                )
            )
        self._check_shards(shards)
        rejects = self._merge_rejects()
        conversion = {
            "tool": "wdsraft convert",
            "fingerprint": plan.fingerprint,
            **plan.settings,
            "samples_per_shard_used": self.layout.per_shard,
            "rejects": REJECTS_NAME if rejects else None,
        }
        manifest = Manifest(name=plan.name, inputs=[item.to_dict() for item in inputs], conversion=conversion)
        for shard in shards:
            manifest.shards.append(ManifestEntry(shard["name"], shard["samples"], shard["size"], shard["sha256"]))
        if manifest.num_samples != sum(item.samples for item in inputs):
            raise ConvertError(
                f"the shards hold {manifest.num_samples} samples, the buckets wrote {sum(i.samples for i in inputs)}"
            )
        manifest_url = f"{plan.output}/{MANIFEST_NAME}"
        manifest.save(manifest_url)
        report = self.report
        report.finalized = True
        report.inputs = inputs
        report.num_shards, report.num_samples, report.size = len(shards), manifest.num_samples, manifest.size
        report.manifest_url = manifest_url
        report.rejects_url = f"{plan.output}/{REJECTS_NAME}" if rejects else None
        logger.info("finalized %s: %d shards, %d samples", manifest_url, len(shards), manifest.num_samples)
        if not self.options.keep_workdir:
            self.workdir.remove()

    def _check_shards(self, shards: list[dict[str, Any]]) -> None:
        output = self.plan.output
        if is_s3(output):
            sizes = {item.name: item.size for item in list_objects(output + "/")}
        else:
            directory = local_path(output) or output
            sizes = {n: os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)}
        wrong = [
            shard["name"]
            for shard in shards
            if sizes.get(shard["name"]) != shard["size"] or shard["name"] + INDEX_SUFFIX not in sizes
        ]
        if wrong:
            raise ConvertError(f"shards missing or of the wrong size in {output}: {', '.join(wrong[:5])}")

    def _merge_rejects(self) -> bool:
        parts = [self.workdir.unit_rejects(u) for u in range(len(self.plan.inputs))]
        parts.append(self.workdir.duplicate_rejects)
        parts = [path for path in parts if os.path.exists(path)]
        target = f"{self.plan.output}/{REJECTS_NAME}"
        if not parts:
            return False
        stream = open_atomic(target)
        try:
            for path in parts:
                with open(path, "rb") as handle:
                    shutil.copyfileobj(handle, stream, 1 << 20)
        except BaseException:
            abandon_write(stream)
            raise
        stream.close()
        return True
