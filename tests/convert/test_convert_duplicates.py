"""`wdsraft convert --id-field`: keys that repeat (equal values, or 7 and "7") are bad records: an error naming
both input lines, or (--on-bad-record skip) the first kept and the others rejected, leaving exactly the
shards that the inputs without those lines give."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

import wdsraft
from wdsraft.convert import ConvertError, ConvertOptions, convert


def _write(path: Path, records: list[dict | None]) -> Path:
    """JSONL; None is a blank line (a line that is no record, so the others keep their line numbers)."""
    path.write_text("".join(("" if r is None else json.dumps(r)) + "\n" for r in records))
    return path


def _records(count: int, first: int, words: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"id": n, "text": " ".join(f"w{rng.randrange(999)}" for _ in range(words))} for n in range(first, first + count)
    ]


def _convert(inputs: list[Path], out: Path, **options) -> wdsraft.convert.ConvertReport:
    options.setdefault("samples_per_shard", 90)
    return convert(ConvertOptions([str(p) for p in inputs], str(out), name="ds", id_field="id", **options))


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("ds-*"))}


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[list[Path], list[Path], dict[tuple[str, int], tuple[str, int]]]:
    """Two inputs in which some lines repeat an earlier key (int 7 then "7", within and across inputs), the
    same inputs with those lines blank, and each repeated (input, line) -> the (input, line) kept."""
    a = _records(400, 0, 800, seed=1)  # (3 MB in all: over the budget of 4M of memory)
    b = _records(300, 400, 800, seed=2)
    repeats = {("a", 250): ("a", 8), ("b", 11): ("a", 8), ("b", 120): ("b", 31), ("b", 299): ("a", 400)}
    for (name, line), (kept_name, kept_line) in repeats.items():
        target, kept = (a if name == "a" else b), (a if kept_name == "a" else b)[kept_line - 1]
        target[line - 1] = {"id": str(kept["id"]) if line % 2 else kept["id"], "text": f"again {line}"}
    with_repeats = [_write(tmp_path / "a.jsonl", a), _write(tmp_path / "b.jsonl", b)]
    blanks = tmp_path / "blank"
    blanks.mkdir()
    cleared = [
        _write(blanks / "a.jsonl", [None if ("a", n) in repeats else r for n, r in enumerate(a, 1)]),
        _write(blanks / "b.jsonl", [None if ("b", n) in repeats else r for n, r in enumerate(b, 1)]),
    ]
    return with_repeats, cleared, repeats


def test_a_repeated_key_stops_the_conversion_naming_both_lines(tmp_path: Path, inputs) -> None:
    with_repeats, _, _ = inputs
    out = tmp_path / "out"
    with pytest.raises(ConvertError) as error:
        _convert(with_repeats, out)
    message = str(error.value)
    assert f"{with_repeats[0]}: line 250: the sample key of {with_repeats[0]} line 8" in message
    assert "4 records repeat a key" in message and "--on-bad-record skip" in message
    assert not list(out.glob("ds-*")) and not (out / "manifest.json").exists()


@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"buckets": 7, "workers": 2},  # shards straddle buckets: their heads are read back by sorted rank
        {"buckets": 1, "memory": 4 << 20},  # a bucket over the budget, written in key slices
    ],
    ids=["one-bucket", "straddling", "key-slices"],
)
def test_skip_keeps_the_first_and_rejects_the_others(tmp_path: Path, inputs, layout, caplog) -> None:
    with_repeats, cleared, repeats = inputs
    reference = tmp_path / "reference"
    _convert(cleared, reference, **layout)
    out = tmp_path / "out"
    # The same work directory after the error: the rerun with skip goes on from the scatter phase.
    with pytest.raises(ConvertError):
        _convert(with_repeats, out, **layout)
    caplog.set_level(logging.INFO, logger="wdsraft.convert")
    report = _convert(with_repeats, out, on_bad_record="skip", **layout)
    if "memory" in layout:
        assert "exceeds the memory budget: writing it in" in caplog.text
    # Exactly the shards of the inputs without the repeated lines, byte for byte.
    assert _shards(out) == _shards(reference)
    assert report.num_samples == 696 and report.rejected == 4
    assert [(i.records, i.samples, i.rejected) for i in report.inputs] == [(400, 399, 1), (300, 297, 3)]
    rejected = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    by_place = {(Path(r["input"]).stem, r["line"]): r["reason"] for r in rejected}
    assert set(by_place) == set(repeats)
    for (name, line), (kept_name, kept_line) in repeats.items():
        assert f"{kept_name}.jsonl line {kept_line} (kept)" in by_place[name, line]
    keys = [s["__key__"] for s in wdsraft.tarfile_samples([{"url": str(p)} for p in sorted(out.glob("ds-*.tar"))])]
    assert len(keys) == len(set(keys)) == 696


def test_keys_without_an_id_field_are_not_collected(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.jsonl", _records(50, 0, 5, seed=3))
    out = tmp_path / "out"
    convert(ConvertOptions([str(path)], str(out), name="ds", keep_workdir=True))
    assert not list(out.glob(".wdsraft-work/scatter/*.keys"))


def test_a_work_directory_scattered_without_key_digests_is_refused(tmp_path: Path, inputs) -> None:
    with_repeats, _, _ = inputs
    out, work = tmp_path / "out", tmp_path / "work"
    _convert(with_repeats, out, workdir=str(work), phase="scatter", on_bad_record="skip")
    done = work / "scatter" / "unit-000001.done"
    record = json.loads(done.read_text())
    del record["keys_size"]  # as an older wdsraft scattered it
    done.write_text(json.dumps(record))
    with pytest.raises(ConvertError, match=r"b\.jsonl was scattered by an older wdsraft.*remove .*scatter"):
        _convert(with_repeats, out, workdir=str(work), on_bad_record="skip")
    assert not list(out.glob("ds-*"))


def test_array_tasks_find_the_same_duplicates(tmp_path: Path, inputs) -> None:
    """Two array tasks, phase by phase: each write task finds the duplicates for itself; the result is
    the single task's, byte for byte."""
    with_repeats, _, _ = inputs
    single = tmp_path / "single"
    _convert(with_repeats, single, on_bad_record="skip", buckets=5)
    out, work = tmp_path / "out", tmp_path / "work"
    for phase in ("scatter", "write"):
        for task in (0, 1):
            _convert(
                with_repeats, out, workdir=str(work), phase=phase, task_index=task, task_count=2,
                on_bad_record="skip", buckets=5,
            )  # fmt: skip
    report = _convert(with_repeats, out, workdir=str(work), phase="finalize", on_bad_record="skip", buckets=5)
    assert report.finalized and report.rejected == 4
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == {
        p.name: p.read_bytes() for p in single.iterdir() if p.is_file()
    }
