"""The conversion: one task's run of the phases (plan, scatter, write, finalize), with the checks that
make reruns, resubmitted tasks and the tasks of a SLURM array safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from wdsraft.convert.buckets import ShardLayout
from wdsraft.convert.duplicates import Duplicates, find_duplicates
from wdsraft.convert.finalizer import REJECTS_NAME, Finalizer
from wdsraft.convert.inputs import InputFile, expand_inputs
from wdsraft.convert.jobs import JobRunner
from wdsraft.convert.options import ConvertError, ConvertOptions
from wdsraft.convert.report import ConvertReport, InputReport
from wdsraft.convert.scatter import run_scatter
from wdsraft.convert.shards import run_bucket
from wdsraft.convert.workdir import Plan, WorkDir, choose_buckets, fingerprint, plan_settings
from wdsraft.core.errors import IndexFormatError
from wdsraft.index.manifest import MANIFEST_NAME, Manifest
from wdsraft.io.s3 import list_objects
from wdsraft.io.storage import is_s3, local_path, remove, write_bytes_atomic

logger = logging.getLogger(__name__)


class Converter:
    """Runs the phases of one task of a conversion (all tasks and phases when alone)."""

    def __init__(self, options: ConvertOptions):
        options.check()
        self.options = options
        self.workdir = WorkDir(options.work_directory)
        self.runner = JobRunner(options.workers, options.progress)
        self.report = ConvertReport(
            output=options.output,
            workdir=self.workdir.root,
            task_index=options.task_index,
            task_count=options.task_count,
        )

    @property
    def budget(self) -> int:
        """Memory for the data of one worker process."""
        return self.options.memory // self.options.workers

    # -- plan ------------------------------------------------------------------------------

    def _plan(self) -> Plan | None:
        """Load the plan, or make it (first run); None when the output already is this conversion."""
        options = self.options
        existing = WorkDir.read_json(self.workdir.plan)
        own = (options.output, self.workdir.root)  # (never inputs, where they lie inside an input directory)
        inputs = expand_inputs(options.inputs, excluded=own) if options.inputs else None
        settings = plan_settings(options)
        plan = Plan.from_json(json.dumps(existing).encode(), self.workdir.plan) if existing is not None else None
        if plan is not None and inputs is not None:
            self._check_same(plan, inputs, settings)
        if plan is not None and plan.output != options.output:
            raise ConvertError(
                f"the work directory {self.workdir.root} belongs to a conversion into {plan.output}, "
                f"not {options.output}"
            )
        if plan is None and inputs is None:
            finished = self._converted_manifest()
            if finished is not None and options.phase in ("write", "finalize"):
                # A resubmitted write/finalize task of a conversion that finished (and removed its plan).
                self._report_from_manifest(finished)
                return None
            raise ConvertError(f"no plan in {self.workdir.root}: run the scatter phase first (or pass the inputs)")
        wanted = plan.fingerprint if plan is not None else fingerprint(inputs or [], settings)
        finished = self._finished_manifest(wanted)
        if finished is not None:
            self._report_from_manifest(finished)
            if not options.keep_workdir and os.path.isdir(self.workdir.root):
                self.workdir.remove()  # (killed after the manifest, before the work directory was removed)
            return None
        if plan is not None:
            return plan
        assert inputs is not None
        if options.phase in ("write", "finalize"):
            raise ConvertError(f"no plan in {self.workdir.root}: run the scatter phase first")
        self._check_output_free()
        buckets = options.buckets or choose_buckets(inputs, options.memory, options.workers, options.task_count)
        plan = Plan(inputs, options.output, settings, buckets)
        os.makedirs(self.workdir.root, exist_ok=True)
        if not self.workdir.create_plan(plan.to_json()):
            # Another task of the array planned first (its --workers or --memory may give another bucket
            # count): every task must work from one plan, the one on disk.
            existing = WorkDir.read_json(self.workdir.plan)
            if existing is None:  # (and removed since: that conversion finished, or was cleared)
                raise ConvertError(f"{self.workdir.plan}: another task's plan came and went: rerun")
            plan = Plan.from_json(json.dumps(existing).encode(), self.workdir.plan)
            self._check_same(plan, inputs, settings)
            logger.info("plan: using the plan another task wrote first in %s", self.workdir.root)
            return plan
        logger.info("plan: %d inputs, %d buckets, workdir %s", len(inputs), buckets, self.workdir.root)
        return plan

    def _check_same(self, plan: Plan, inputs: list[InputFile], settings: dict[str, Any]) -> None:
        differences = [
            f"{key}: {plan.settings.get(key)!r} then, {value!r} now"
            for key, value in settings.items()
            if plan.settings.get(key) != value
        ]
        before = {item.url: item.size for item in plan.inputs}
        now = {item.url: item.size for item in inputs}
        if before != now:
            changed = sorted(set(before.items()) ^ set(now.items()))
            differences.append("inputs differ: " + ", ".join(f"{url} ({size} bytes)" for url, size in changed[:4]))
        if differences:
            raise ConvertError(
                f"the work directory {self.workdir.root} holds a conversion with other inputs or settings ("
                + "; ".join(differences)
                + "): pass another --workdir, or remove it to start over"
            )
        self._check_unchanged(plan, inputs)

    def _check_unchanged(self, plan: Plan, inputs: list[InputFile]) -> None:
        """Refuse inputs changed in place since they were planned (same URL and size, another
        modification time or ETag): what was scattered from them, and the duplicates found in it, would
        be used as if it were theirs."""
        planned = {item.url: item.version for item in plan.inputs}
        changed = [
            item.url
            for item in inputs
            if item.version is not None and planned.get(item.url) not in (None, item.version)
        ]
        if changed:
            more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
            raise ConvertError(
                f"{changed[0]}{more} changed since the work directory {self.workdir.root} was planned (another "
                "modification time or ETag): what was read from it there is stale. Remove the work directory "
                "(or pass another --workdir) and rerun"
            )

    def _manifest_url(self) -> str:
        return f"{self.options.output}/{MANIFEST_NAME}"

    def _finished_manifest(self, wanted: str) -> Manifest | None:
        manifest = self._converted_manifest()
        conversion = (manifest.conversion or {}) if manifest is not None else {}
        return manifest if conversion.get("fingerprint") == wanted else None

    def _converted_manifest(self) -> Manifest | None:
        """The output's manifest, if a conversion wrote one."""
        try:
            manifest = Manifest.load(self._manifest_url())
        except (FileNotFoundError, IndexFormatError, OSError, ValueError):
            return None
        except Exception as exn:  # S3 clients raise their own kinds for a missing key
            logger.debug("no finished manifest at %s (%s)", self._manifest_url(), exn)
            return None
        return manifest if (manifest.conversion or {}).get("fingerprint") else None

    def _report_from_manifest(self, manifest: Manifest) -> None:
        report = self.report
        report.already_done = True
        report.manifest_url = self._manifest_url()
        report.inputs = [InputReport.from_dict(item) for item in manifest.inputs or []]
        report.num_shards, report.num_samples, report.size = len(manifest.shards), manifest.num_samples, manifest.size
        rejects = (manifest.conversion or {}).get("rejects")
        report.rejects_url = f"{self.options.output}/{rejects}" if rejects else None

    def _existing_outputs(self) -> list[str]:
        """Files in the output that a conversion named like this one would write (or a manifest)."""
        name = self.options.dataset_name
        pattern = re.compile(rf"({re.escape(name)}-\d+\.tar(\.idx)?|{MANIFEST_NAME}|{REJECTS_NAME})")
        output = self.options.output
        if is_s3(output):
            return [item.url for item in list_objects(output + "/", delimiter="/") if pattern.fullmatch(item.name)]
        path = local_path(output) or output
        if not os.path.isdir(path):
            return []
        return sorted(os.path.join(path, n) for n in os.listdir(path) if pattern.fullmatch(n))

    def _check_output_free(self) -> None:
        existing = self._existing_outputs()
        if not existing:
            return
        if not self.options.overwrite:
            raise ConvertError(
                f"{self.options.output} already holds a dataset ({len(existing)} files such as "
                f"{posixpath.basename(existing[0])}): pass --overwrite to replace it"
            )
        logger.warning("removing %d files of the previous dataset in %s", len(existing), self.options.output)
        for url in existing:
            with contextlib.suppress(FileNotFoundError):  # (the other tasks of an array remove them too)
                remove(url)

    # -- phases ----------------------------------------------------------------------------

    def run(self) -> ConvertReport:
        started = time.perf_counter()
        plan = self._plan()
        self.report.seconds["plan"] = time.perf_counter() - started
        if plan is None:
            return self.report
        phase = self.options.phase
        if phase in ("all", "scatter"):
            self._timed("scatter", lambda: self._scatter(plan))
        if phase in ("all", "write"):
            if not self._all_units_done(plan, wait_for_others=phase == "all"):
                raise ConvertError(f"the scatter phase has not finished: {self._missing_units(plan)}")
            self._timed("write", lambda: self._write(plan))
        if phase == "finalize" or (phase == "all" and self._all_buckets_done(plan)):
            self._timed("finalize", lambda: self._finalize_once(plan, forced=phase == "finalize"))
        return self.report

    def _timed(self, name: str, step: Callable[[], None]) -> None:
        started = time.perf_counter()
        step()
        self.report.seconds[name] = time.perf_counter() - started

    def _my_units(self, plan: Plan) -> list[int]:
        """This task's inputs: largest first, each to the least loaded task (deterministic)."""
        count = self.options.task_count
        if count == 1:
            return list(range(len(plan.inputs)))
        loads = [0] * count
        mine = []
        for unit in sorted(range(len(plan.inputs)), key=lambda u: (-plan.inputs[u].size, u)):
            task = min(range(count), key=lambda t: (loads[t], t))
            loads[task] += plan.inputs[unit].size + 1
            if task == self.options.task_index:
                mine.append(unit)
        return sorted(mine)

    def _scatter(self, plan: Plan) -> None:
        todo = [unit for unit in self._my_units(plan) if not os.path.exists(self.workdir.unit_done(unit))]
        if not todo:
            return
        os.makedirs(os.path.dirname(self.workdir.unit_data(0)), exist_ok=True)
        budget = self.budget
        jobs = [(plan, self.workdir, unit, budget, self.options.on_bad_record) for unit in todo]
        total = sum(plan.inputs[unit].size for unit in todo)

        def done(result: dict[str, Any]) -> None:
            self.report.units_done += 1
            self.report.bytes_in += result["bytes_in"]

        self.runner.run(run_scatter, jobs, "scatter", total, "B", on_done=done)

    def _missing_units(self, plan: Plan) -> str:
        missing = [u for u in range(len(plan.inputs)) if not os.path.exists(self.workdir.unit_done(u))]
        shown = ", ".join(plan.inputs[u].url for u in missing[:5])
        return f"{len(missing)} inputs not scattered yet ({shown}{', ...' if len(missing) > 5 else ''})"

    def _all_units_done(self, plan: Plan, wait_for_others: bool) -> bool:
        def missing() -> list[int]:
            return [u for u in range(len(plan.inputs)) if not os.path.exists(self.workdir.unit_done(u))]

        left = missing()
        if not left or not wait_for_others or self.options.task_count == 1:
            return not left
        from tqdm import tqdm

        logger.info("waiting for other tasks to scatter %d inputs", len(left))
        deadline = None if self.options.wait_timeout is None else time.monotonic() + self.options.wait_timeout
        total = len(plan.inputs)
        with tqdm(
            total=total,
            desc="waiting for other tasks",
            unit="input",
            disable=not self.options.progress,
            file=sys.stderr,
        ) as bar:
            bar.update(total - len(left))
            while left:
                for unit in left:
                    failure = self._failure(unit)
                    if failure is not None:
                        hint = " (rerun once it is fixed)" if failure.get("transient") else ""
                        raise ConvertError(f"another task failed on {plan.inputs[unit].url}: {failure['error']}{hint}")
                if deadline is not None and time.monotonic() > deadline:
                    raise ConvertError(f"gave up waiting for other tasks: {self._missing_units(plan)}")
                time.sleep(self.options.poll_interval)
                now = missing()
                bar.update(len(left) - len(now))
                left = now
        return True

    def _failure(self, unit: int) -> dict[str, Any] | None:
        """The failure another task recorded for a unit: waiting on would be forever. A bad record fails
        on every attempt under the same --on-bad-record (one recorded under the other policy is from an
        earlier attempt, which the unit's owner clears when it retries). Any other failure also stops
        the waiters, even one an earlier attempt left (quitting early is recoverable by a rerun; waiting
        for an input nobody is converting is not)."""
        failure = WorkDir.read_json(self.workdir.unit_failed(unit))
        if failure is None or failure.get("on_bad_record") != self.options.on_bad_record:
            return None
        return failure

    def _layout(self, plan: Plan) -> tuple[ShardLayout, list[int]]:
        """The shard layout, and each unit's data size. Done-files are summed as they are read, not kept:
        each holds two counts per bucket (inputs x buckets of them would not fit in any budget)."""
        counts = np.zeros(plan.buckets, dtype=np.int64)
        tar_bytes = np.zeros(plan.buckets, dtype=np.int64)
        sizes = []
        for unit in range(len(plan.inputs)):
            done = WorkDir.read_json(self.workdir.unit_done(unit))
            if done is None:
                raise ConvertError(f"the scatter phase has not finished: {self._missing_units(plan)}")
            if len(done["bucket_counts"]) != plan.buckets or len(done["bucket_tar_bytes"]) != plan.buckets:
                raise ConvertError(
                    f"{self.workdir.unit_done(unit)}: {plan.inputs[unit].url} was scattered into "
                    f"{len(done['bucket_counts'])} buckets, the plan has {plan.buckets} (written by another "
                    f"plan): remove the work directory {self.workdir.root} and rerun"
                )
            counts += np.asarray(done["bucket_counts"], dtype=np.int64)
            tar_bytes += np.asarray(done["bucket_tar_bytes"], dtype=np.int64)
            sizes.append(int(done["data_size"]))
        duplicates = self._duplicates(plan)
        if duplicates is not None:
            counts -= duplicates.per_bucket(plan.buckets)  # (rejected: left out of their buckets)
        settings = plan.settings
        return ShardLayout(counts, tar_bytes, settings["samples_per_shard"], settings["shard_size"]), sizes

    def _duplicates(self, plan: Plan) -> Duplicates | None:
        """The records that repeat an earlier record's key (only ``--id-field`` keys can), found once after
        the scatter phase; in ``error`` mode, the first of them stops the conversion."""
        if plan.settings.get("id_field") is None:
            return None
        duplicates = Duplicates.load(self.workdir.duplicates)
        if duplicates is None:
            sizes = []
            for unit, source in enumerate(plan.inputs):
                size = (WorkDir.read_json(self.workdir.unit_done(unit)) or {}).get("keys_size")
                if size is None:
                    raise ConvertError(
                        f"{source.url} was scattered by an older wdsraft, without the digests of its keys that "
                        f"duplicate keys are found with: remove {os.path.dirname(self.workdir.unit_done(unit))} "
                        "and rerun (the scatter phase is done again)"
                    )
                sizes.append(int(size))
            jobs = [(self.workdir, sizes, partition) for partition in range(plan.buckets)]
            found = self.runner.run(find_duplicates, jobs, "duplicate keys", 0, "bucket")
            duplicates = Duplicates.build(plan, np.concatenate(found))
            if len(duplicates.rows):  # (the rejects first: the duplicates file says both are there)
                write_bytes_atomic(self.workdir.duplicate_rejects, duplicates.rejects(plan))
            duplicates.save(self.workdir.duplicates)
        if len(duplicates.rows) and self.options.on_bad_record == "error":
            raise duplicates.error(plan, self.workdir.root)
        return duplicates

    def _my_buckets(self, plan: Plan) -> list[int]:
        return list(range(self.options.task_index, plan.buckets, self.options.task_count))

    def _write(self, plan: Plan) -> None:
        layout, sizes = self._layout(plan)
        todo = [b for b in self._my_buckets(plan) if not os.path.exists(self.workdir.bucket_done(b))]
        if not todo:
            return
        os.makedirs(os.path.dirname(self.workdir.bucket_done(0)), exist_ok=True)
        if not is_s3(plan.output):
            os.makedirs(local_path(plan.output) or plan.output, exist_ok=True)
        jobs = [(plan, self.workdir, b, layout, sizes, self.budget) for b in todo]
        total = int(sum(layout.counts[b] for b in todo))

        def done(result: dict[str, Any]) -> None:
            self.report.buckets_done += 1

        self.runner.run(run_bucket, jobs, "write", total, "sample", on_done=done)

    def _all_buckets_done(self, plan: Plan) -> bool:
        return all(os.path.exists(self.workdir.bucket_done(b)) for b in range(plan.buckets))

    # -- finalize --------------------------------------------------------------------------

    def _finalize_once(self, plan: Plan, forced: bool) -> None:
        """Only one task of an array finalizes (the first to take the lock); ``--phase finalize`` always does."""
        if not forced and not self._take_finalize_lock():
            return
        try:
            layout, _ = self._layout(plan)
            Finalizer(plan, self.workdir, layout, self.options, self.report).run()
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.workdir.finalize_lock)
            raise

    def _take_finalize_lock(self) -> bool:
        """The finalize lock, naming the task that holds it. A lock held by this task's own index was
        left by an earlier run of this task killed while finalizing (SLURM runs one process per array
        index at a time: a requeue or a rerun of the command): it is taken over. So is an empty one
        (killed between creating and writing it); finalizing twice is harmless, it is deterministic
        and every write is atomic."""
        path = self.workdir.finalize_lock
        task = self.options.task_index
        for _ in range(2):
            try:
                descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileNotFoundError:  # the work directory is gone: finalized already
                return False
            except FileExistsError:
                with open(path, "rb") as lock:
                    owner = lock.read()
                holder = json.loads(owner).get("task") if owner else None
                if owner and holder != task:
                    logger.info("task %s is finalizing", holder)
                    return False
                logger.warning("taking over the finalize lock left by an earlier run of task %d", task)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            with os.fdopen(descriptor, "wb") as lock:
                lock.write(json.dumps({"task": task, "pid": os.getpid()}).encode())
            return True
        return False


def convert(options: ConvertOptions) -> ConvertReport:
    """Run (this task's share of) a conversion; see the module docstring and ``wdsraft convert --help``."""
    return Converter(options).run()
