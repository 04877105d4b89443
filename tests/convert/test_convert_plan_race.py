"""Tasks of an array that plan at the same moment with other --workers or --memory (so other bucket counts)
all work from one plan, the first written; scatter data of another plan is refused, naming its file."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest

from wdsraft.convert import ConvertError, ConvertOptions, InputFile, convert, converter
from wdsraft.convert import workdir as workdir_module


def _inputs(tmp_path: Path) -> list[str]:
    paths = []
    for n in range(3):
        path = tmp_path / "in" / f"part-{n}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"text": f"doc {n} {line}"}) + "\n" for line in range(40 + 7 * n)))
        paths.append(str(path))
    return paths


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _options(inputs: list[str], out: Path, work: Path, **extra) -> ConvertOptions:
    return ConvertOptions(inputs, str(out), name="ds", workdir=str(work), samples_per_shard=11, **extra)


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_tasks_planning_at_once_with_other_workers_share_the_first_plan(tmp_path: Path, monkeypatch, links) -> None:
    """...also where the work directory's file system has no hard links (s3fs, gcsfuse): a claim file decides."""
    if not links:

        def no_link(source: str, target: str) -> None:
            raise OSError(errno.ENOTSUP, "Operation not supported", target)

        monkeypatch.setattr(workdir_module.os, "link", no_link)
    inputs = _inputs(tmp_path)
    reference = tmp_path / "reference"
    convert(_options(inputs, reference, tmp_path / "w0", workers=1))
    out, work = tmp_path / "out", tmp_path / "work"
    first = converter.Converter(_options(inputs, out, work, workers=1, task_index=0, task_count=2, phase="scatter"))
    second = converter.Converter(_options(inputs, out, work, workers=3, task_index=1, task_count=2, phase="scatter"))
    expand = converter.expand_inputs
    raced = []

    def racing(specs: list[str], **kw: Any) -> list[InputFile]:
        """The second task found no plan; the first plans (and scatters) before it writes its own."""
        if not raced:
            raced.append(True)
            first.run()
        return expand(specs, **kw)

    monkeypatch.setattr(converter, "expand_inputs", racing)
    second.run()
    assert raced and json.loads((work / "plan.json").read_text())["buckets"] == 2  # (the first task's: 1 worker x 2)
    assert second.report.units_done > 0  # (the second task did scatter, into the first task's plan)
    report = convert(_options(inputs, out, work, workers=2))
    assert report.finalized and report.num_samples == 3 * 40 + 7 + 14
    assert _files(out) == _files(reference)


def test_scatter_data_of_another_bucket_count_is_refused_naming_its_file(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path)
    out, work = tmp_path / "out", tmp_path / "work"
    convert(_options(inputs, out, work, workers=1, buckets=4, phase="scatter"))
    done = work / "scatter" / "unit-000001.done"
    record = json.loads(done.read_text())
    record["bucket_counts"], record["bucket_tar_bytes"] = record["bucket_counts"][:3], record["bucket_tar_bytes"][:3]
    done.write_text(json.dumps(record))
    with pytest.raises(ConvertError) as error:
        convert(_options(inputs, out, work, workers=1, phase="write"))
    message = str(error.value)
    assert message.startswith(f"{done}: {inputs[1]} was scattered into 3 buckets, the plan has 4")
    assert f"remove the work directory {work}" in message
