"""An input that changes under a conversion is refused, never silently used half-old: changed in place
between two runs (same size: only its modification time or ETag tells), or while it is being planned and
scattered (its stored size read differs from the planned one)."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from wdsraft.convert import ConvertError, ConvertOptions, convert


def _write(path: Path, lines: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _options(inputs: list[str], out: Path, work: Path, **extra) -> ConvertOptions:
    return ConvertOptions(inputs, str(out), name="ds", workdir=str(work), id_field="id", workers=1, **extra)


def _touch_later(path: Path) -> None:
    """A new modification time, whatever the filesystem's timestamp granularity."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))


def _fix_in_place(path: Path) -> None:
    """The second record's repeated id 1 becomes 2: the same size, as `sed -i` leaves it."""
    before = path.stat().st_size
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = lines[1].replace('"id": 1', '"id": 2')
    path.write_text("".join(lines))
    _touch_later(path)
    assert path.stat().st_size == before


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_an_input_fixed_in_place_is_refused_on_rerun(tmp_path: Path, policy: str) -> None:
    source = _write(tmp_path / "in" / "a.jsonl", [{"id": 1, "text": "one"}, {"id": 1, "text": "two"}])
    out, work = tmp_path / "out", tmp_path / "work"
    with pytest.raises(ConvertError) as first:
        convert(_options([str(source)], out, work))
    assert "again" in str(first.value) and f"remove the work directory {work}" in str(first.value)
    _fix_in_place(source)
    # Before: the stale scatter data and duplicates were reused (error again, or the fixed record rejected).
    with pytest.raises(ConvertError) as rerun:
        convert(_options([str(source)], out, work, on_bad_record=policy))
    message = str(rerun.value)
    assert str(source) in message and "changed since the work directory" in message
    assert "Remove the work directory" in message
    assert not (out / "manifest.json").exists()
    # As it says: without the stale work directory, the fixed input converts whole.
    for path in sorted(work.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    report = convert(_options([str(source)], out, work, on_bad_record=policy))
    assert report.num_samples == 2 and report.rejects_url is None


def test_the_output_does_not_depend_on_modification_times(tmp_path: Path) -> None:
    source = _write(tmp_path / "in" / "a.jsonl", [{"id": n, "text": f"t{n}"} for n in range(30)])
    first = tmp_path / "first"
    convert(_options([str(source)], first, tmp_path / "w1", samples_per_shard=7))
    _touch_later(source)
    second = tmp_path / "second"
    report = convert(_options([str(source)], second, tmp_path / "w2", samples_per_shard=7))
    assert report.num_samples == 30
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir()) and "manifest.json" in files
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (first, second)]
    assert manifests[0]["conversion"]["fingerprint"] == manifests[1]["conversion"]["fingerprint"]
    for name in files:
        if name != "manifest.json":
            assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_an_s3_object_rewritten_at_the_same_size_is_refused(tmp_path: Path, s3_bucket: str) -> None:
    import boto3

    client = boto3.client("s3")
    lines = [{"id": 1, "text": "one"}, {"id": 1, "text": "two"}]
    client.put_object(Bucket=s3_bucket, Key="raw/a.jsonl", Body=_write(tmp_path / "a.jsonl", lines).read_bytes())
    url = f"s3://{s3_bucket}/raw/a.jsonl"
    out, work = tmp_path / "out", tmp_path / "work"
    for spec in (url, f"s3://{s3_bucket}/raw/"):  # (a key is sized by a HEAD, a prefix by its listing)
        with pytest.raises(ConvertError, match="again"):
            convert(_options([spec], out, work))
    lines[1]["id"] = 2
    client.put_object(Bucket=s3_bucket, Key="raw/a.jsonl", Body=_write(tmp_path / "a.jsonl", lines).read_bytes())
    for spec in (url, f"s3://{s3_bucket}/raw/"):
        with pytest.raises(ConvertError, match=re.escape(f"{url} changed since the work directory")):
            convert(_options([spec], out, work, on_bad_record="skip"))


@pytest.mark.parametrize("change", ["appended", "cut", "rewritten", "gzip-member-added"])
def test_an_input_changed_between_planning_and_scattering_is_refused(tmp_path, monkeypatch, change: str) -> None:
    from wdsraft.convert import converter, inputs

    records = [{"id": n, "text": f"t{n}"} for n in range(50)]
    source = _write(tmp_path / "in" / "a.jsonl", records)
    if change == "gzip-member-added":
        source = tmp_path / "in" / "a.jsonl.gz"
        source.write_bytes(gzip.compress((tmp_path / "in" / "a.jsonl").read_bytes()))

    def listed_then_changed(specs: list[str], **kw: Any) -> list[inputs.InputFile]:
        """The input changes just after it is listed, sized and planned (another writer at work)."""
        found = inputs.expand_inputs(specs, **kw)
        data, planned = source.read_bytes(), source.stat()
        if change == "appended":
            source.write_bytes(data + b'{"id": 50, "text": "late"}\n')
        elif change == "cut":
            source.write_bytes(data[: data.rindex(b"{")])
        elif change == "rewritten":
            source.write_bytes(data.replace(b'"t7"', b'"T7"'))
            _touch_later(source)
        else:
            source.write_bytes(data + gzip.compress(b'{"id": 50, "text": "late"}\n'))
        if change != "rewritten":  # (times kept, as cp -p or rsync -t keep them: only the size tells)
            os.utime(source, ns=(planned.st_atime_ns, planned.st_mtime_ns))
        return found

    monkeypatch.setattr(converter, "expand_inputs", listed_then_changed)
    out, work = tmp_path / "out", tmp_path / "work"
    with pytest.raises(ConvertError) as error:
        convert(_options([str(source)], out, work))
    message = str(error.value)
    assert message.startswith(f"{source}: the input changed since the conversion was planned")
    assert ("modification time" if change == "rewritten" else "bytes read") in message
    assert f"remove the work directory {work}" in message
    assert not list(work.glob("scatter/*.done")) and not (out / "manifest.json").exists()
