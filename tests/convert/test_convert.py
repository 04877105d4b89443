"""`wdsraft convert`: JSONL -> globally shuffled shards (round trip, determinism, SLURM arrays,
resume after SIGKILL, bad input, compression, S3, shuffle quality, memory bound)."""

from __future__ import annotations

import base64
import gzip
import itertools
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import webdataset
import zstandard
from shardutil import without_positions

import wdsraft
from wdsraft import cli
from wdsraft.convert import (
    ConvertError,
    ConvertOptions,
    ConvertReport,
    HeaderBuilder,
    ShardAssembler,
    ShardLayout,
    convert,
    expand_inputs,
    parse_size,
    tar_safe_key,
)
from wdsraft.index.shard_index import ShardIndex

PYTHON = sys.executable


# ---------------------------------------------------------------------------------------------
# helpers


def write_jsonl(path: Path, lines: Sequence[bytes | str | dict]) -> Path:
    """Write lines (dicts are JSON-encoded) as JSONL, compressed by the name's suffix."""
    raw = b"".join(
        (json.dumps(line).encode() if isinstance(line, dict) else line.encode() if isinstance(line, str) else line)
        + b"\n"
        for line in lines
    )
    if path.name.endswith(".gz"):
        raw = gzip.compress(raw, mtime=0)
    elif path.name.endswith(".zst"):
        raw = zstandard.ZstdCompressor().compress(raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    return path


def synthetic(count: int, seed: int, words: int = 30, prefix: str = "doc") -> list[dict]:
    rng = random.Random(seed)
    vocabulary = [f"w{n}" for n in range(500)]
    return [
        {"id": f"{prefix}-{n}", "text": " ".join(rng.choices(vocabulary, k=words)), "source": prefix, "n": n}
        for n in range(count)
    ]


def run(inputs: Sequence[Path | str], output: Path | str, **options: Any) -> ConvertReport:
    """Convert in this process; shards are named ds-NNNNNN.tar wherever they go (comparable outputs)."""
    options.setdefault("name", "ds")
    return convert(ConvertOptions(inputs=[str(i) for i in inputs], output=str(output), **options))


def dataset_files(directory: Path) -> dict[str, bytes]:
    """Every file of a finished dataset (shards, indexes, manifest, rejects)."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def shard_urls(directory: Path | str) -> list[str]:
    manifest_url = f"{directory}/manifest.json"
    return wdsraft.Manifest.load(manifest_url).urls(manifest_url)


def read_samples(directory: Path | str) -> list[dict[str, Any]]:
    return list(wdsraft.tarfile_samples([{"url": url} for url in shard_urls(directory)]))


def cli_command(*args: str) -> list[str]:
    return [PYTHON, "-m", "wdsraft.cli", "convert", "-q", "--name", "ds", *args]


@pytest.fixture
def corpus(tmp_path: Path, corpus_records) -> tuple[list[Path], list[list[dict]]]:
    """The bundled kernel-docs slice split over a plain, a .gz and a .zst input."""
    parts = [list(corpus_records[i::3]) for i in range(3)]
    names = ["part-a.jsonl", "part-b.jsonl.gz", "part-c.jsonl.zst"]
    paths = [write_jsonl(tmp_path / "in" / name, part) for name, part in zip(names, parts, strict=True)]
    return paths, parts


# ---------------------------------------------------------------------------------------------
# round trip and layout


def test_round_trip_every_record_once(tmp_path: Path, corpus) -> None:
    paths, parts = corpus
    out = tmp_path / "out"
    report = run(paths, out, samples_per_shard=40, buckets=4)
    assert report.finalized and report.num_samples == sum(map(len, parts))

    samples = read_samples(out)
    # webdataset reads the same samples (wdsraft adds only the position fields)
    assert without_positions(samples) == list(webdataset.tarfile_samples([{"url": u} for u in shard_urls(out)]))
    by_key = {s["__key__"]: s for s in samples}
    assert len(by_key) == len(samples) == sum(map(len, parts))
    for path, part in zip(paths, parts, strict=True):
        stem = path.name.split(".")[0]
        for line, record in enumerate(part, start=1):
            sample = by_key.pop(f"{stem}-{line:09d}")
            assert sample["txt"].decode("utf-8") == record["text"]
            assert json.loads(sample["json"]) == {k: v for k, v in record.items() if k != "text"}
    assert not by_key  # nothing that was not an input record

    manifest = wdsraft.Manifest.load(str(out / "manifest.json"))
    assert manifest.num_samples == len(samples)
    assert [e.num_samples for e in manifest.shards] == [40] * 10 + [34]  # rolls over like ShardWriter
    assert [i["records"] for i in manifest.inputs or []] == [len(p) for p in parts]
    assert all(i["samples"] == i["records"] and i["rejected"] == 0 for i in manifest.inputs or [])
    assert manifest.conversion is not None and manifest.conversion["seed"] == 0
    for url in shard_urls(out):  # every shard's index agrees with the positions a reader sees
        index = ShardIndex.load(url)
        read = list(wdsraft.tarfile_samples([{"url": url}]))
        assert [s["__offset__"] for s in read] == list(index.offsets[:-1])
    assert not (out / ".wdsraft-work").exists()  # the work directory is gone once finalized


def test_msgpack_format_and_id_keys(tmp_path: Path) -> None:
    records = [{"id": f"dir/name.{n}.txt", "text": f"text {n}", "meta": {"n": n, "tags": ["a", n]}} for n in range(60)]
    records.append({"id": 12345, "text": "an integer id"})
    path = write_jsonl(tmp_path / "docs.jsonl", records)
    out = tmp_path / "out"
    run([path], out, format="msgpack", id_field="id", samples_per_shard=25)
    samples = read_samples(out)
    assert {tuple(k for k in s if not k.startswith("__")) for s in samples} == {("msgpack",)}
    got = {s["__key__"]: msgpack.unpackb(s["msgpack"], raw=False) for s in samples}
    assert got == {tar_safe_key(str(r["id"])): r for r in records}
    assert all("." not in key and "/" not in key for key in got)
    assert "dir%2Fname%2E7%2Etxt" in got and "12345" in got


def test_tar_safe_key() -> None:
    assert tar_safe_key("plain-Key_09") == "plain-Key_09"
    assert tar_safe_key("a.b/c d%") == "a%2Eb%2Fc%20d%25"
    assert tar_safe_key("ü") == "%C3%BC"
    # injective where naive replacement is not
    assert len({tar_safe_key(k) for k in ("a.b", "a_b", "a/b", "a%2Eb")}) == 4


def test_input_names_are_unique_and_tar_safe(tmp_path: Path) -> None:
    for name in ("a/x.jsonl", "b/x.jsonl", "b/y.jsonl", "b/y.jsonl.gz", "b/z.v2.ndjson.zst"):
        write_jsonl(tmp_path / name, [{"text": name}])
    inputs = expand_inputs([str(tmp_path / "{a,b}" / "*")])
    assert [i.name for i in inputs] == ["a%2Fx", "b%2Fx", "b%2Fy%2Ejsonl", "b%2Fy%2Ejsonl%2Egz", "b%2Fz%2Ev2"]
    assert [i.compression for i in inputs] == [None, None, None, "gzip", "zstd"]
    with pytest.raises(ConvertError, match="given twice"):
        expand_inputs([str(tmp_path / "a" / "x.jsonl"), str(tmp_path / "a" / "*.jsonl")])
    # The same file spelled another way would be converted twice, every record duplicated.
    spelled = str(tmp_path / "a" / "x.jsonl")
    for other in (str(tmp_path / "a" / "." / "x.jsonl"), str(tmp_path) + "//a/x.jsonl", f"file://{spelled}"):
        with pytest.raises(ConvertError, match="given twice"):
            expand_inputs([spelled, other])
    with pytest.raises(ConvertError, match="no input matches"):
        expand_inputs([str(tmp_path / "c" / "*.jsonl")])


def test_parse_size() -> None:
    assert parse_size("256M") == 256 << 20
    assert parse_size("2G") == 2 << 30
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("lots")


def test_shard_layout_spans_buckets() -> None:
    layout = ShardLayout(np.array([5, 0, 12, 3]), np.array([5000, 0, 12000, 3000]), 4, None)
    assert (layout.per_shard, layout.total, layout.total_shards) == (4, 20, 5)
    assert [layout.buckets_of(k) for k in range(5)] == [[0], [0, 2], [2], [2], [2, 3]]
    assert [layout.owner(k) for k in range(5)] == [0, 2, 2, 2, 3]
    assert layout.ranks(4) == (16, 20)
    # --shard-size: the size over the mean tar bytes of a sample (here 1000)
    assert ShardLayout(np.array([20]), np.array([20_000]), None, 5_000).per_shard == 5
    assert ShardLayout(np.array([20]), np.array([20_000]), 3, 5_000).per_shard == 3


def test_shard_size_rolls_over(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", synthetic(400, seed=3, words=200))
    out = tmp_path / "out"
    report = run([path], out, shard_size=100_000, buckets=3)
    manifest = wdsraft.Manifest.load(str(out / "manifest.json"))
    assert report.num_samples == 400 and len(manifest.shards) >= 10
    counts = [e.num_samples for e in manifest.shards]
    assert len(set(counts[:-1])) == 1 and counts[-1] <= counts[0]  # rolls over at a fixed count
    sizes = [e.size for e in manifest.shards[:-1]]
    assert min(sizes) > 0.9 * 100_000 and max(sizes) < 1.1 * 100_000  # close to the size asked for


def test_shard_assembler_writes_tarwriter_bytes(tmp_path: Path) -> None:
    samples = [
        {"__key__": "short", "json": b'{"a": 1}', "txt": b"hello"},
        {"__key__": "k" * 120, "json": b"{}", "txt": b"x" * 1000},  # a name that needs a PAX header
        {"__key__": "empty", "json": b"{}", "txt": b""},
    ]
    with wdsraft.TarWriter(str(tmp_path / "a.tar"), encoder=False, mtime=0) as sink:
        for sample in samples:
            sink.write(sample)
    assembler = ShardAssembler(str(tmp_path / "b.tar"), HeaderBuilder("bigdata", "bigdata", 0o444))
    for sample in samples:
        assembler.add(sample["__key__"], [(ext, memoryview(sample[ext])) for ext in ("json", "txt")])
    index = assembler.close()
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    expected = ShardIndex.load(str(tmp_path / "a.tar"))
    assert (list(index.offsets), index.size, index.sha256) == (list(expected.offsets), expected.size, expected.sha256)
    assert ShardIndex.load(str(tmp_path / "b.tar")).to_bytes().replace(b"b.tar", b"a.tar") == expected.to_bytes()


# ---------------------------------------------------------------------------------------------
# determinism, shuffle quality


def test_identical_bytes_whatever_the_workers(tmp_path: Path, corpus) -> None:
    paths, _ = corpus
    one = tmp_path / "one"
    two = tmp_path / "two"
    run(paths, one, samples_per_shard=30, seed=7, workers=1, memory=4 << 20)
    run(paths, two, samples_per_shard=30, seed=7, workers=2, memory=4 << 20)
    files = dataset_files(one)
    assert len([n for n in files if n.endswith(".tar")]) > 4
    assert files == dataset_files(two)
    # Nor does the bucket count (--memory) change anything: shards straddling buckets are
    # written in pieces and concatenated, here with shards spanning up to 4 buckets.
    other = tmp_path / "other"
    run(paths, other, samples_per_shard=30, seed=7, buckets=1)
    assert dataset_files(other) == files
    for buckets in (1, 13):
        wide = tmp_path / f"wide-{buckets}"
        run(paths, wide, samples_per_shard=150, seed=7, buckets=buckets, workers=2)
        assert [s["__key__"] for s in read_samples(wide)] == [s["__key__"] for s in read_samples(one)]
    assert dataset_files(tmp_path / "wide-1") == dataset_files(tmp_path / "wide-13")
    # Another seed, another order.
    reseeded = tmp_path / "reseeded"
    run(paths, reseeded, samples_per_shard=30, seed=8, memory=4 << 20)
    assert [s["__key__"] for s in read_samples(reseeded)] != [s["__key__"] for s in read_samples(one)]


def test_shuffle_spreads_each_input_over_shards_and_positions(tmp_path: Path) -> None:
    sizes = (600, 600)
    paths = [write_jsonl(tmp_path / f"f{i}.jsonl", synthetic(n, seed=i, prefix=f"f{i}")) for i, n in enumerate(sizes)]
    out = tmp_path / "out"
    run(paths, out, samples_per_shard=100, seed=1234, buckets=3)
    samples = read_samples(out)
    origin = [(s["__key__"].rsplit("-", 1)[0], int(s["__key__"].rsplit("-", 1)[1])) for s in samples]
    shards = [s["__url__"] for s in samples]
    assert len(set(shards)) == 12
    for name in ("f0", "f1"):
        # every shard holds a fair share of each input (hypergeometric: mean 0.5, sd 0.05)
        for url in set(shards):
            share = sum(1 for o, u in zip(origin, shards, strict=True) if u == url and o[0] == name) / shards.count(url)
            assert 0.3 < share < 0.7, (name, url, share)
        # no trace of the input order in the output order
        positions = [pos for pos, o in enumerate(origin) if o[0] == name]
        lines = [o[1] for o in origin if o[0] == name]
        rho = np.corrcoef(np.argsort(np.argsort(positions)), np.argsort(np.argsort(lines)))[0, 1]
        assert abs(rho) < 0.15, rho
        ascending = np.mean(np.diff(lines) > 0)
        assert 0.4 < ascending < 0.6, ascending
    # the two inputs are interleaved, not one after the other
    runs = sum(1 for a, b in itertools.pairwise(origin) if a[0] != b[0])
    assert runs > 400
    # each input is shuffled on its own: line n of one input lands nowhere near line n of the other
    # (keys from the seed and the line alone would move both inputs' lines in lockstep)
    where = {o: pos for pos, o in enumerate(origin)}
    lines = range(1, sizes[0] + 1)
    rho = np.corrcoef([where["f0", n] for n in lines], [where["f1", n] for n in lines])[0, 1]
    assert abs(rho) < 0.15, rho


# ---------------------------------------------------------------------------------------------
# bad input


BAD_CASES = {
    "invalid JSON": (b'{"text": "unterminated', "invalid JSON"),
    "non-UTF-8 bytes": (b'{"text": "caf\xe9"}', "not valid UTF-8"),
    "missing text field": (b'{"body": "no text here"}', "no text field 'text'"),
    "text not a string": (b'{"text": ["a", "list"]}', "is a JSON array, not a string"),
    "not an object": (b'["text", "in an array"]', "not a JSON object"),
    "lone surrogate": (b'{"text": "\\ud800"}', "lone surrogate"),
    # JSON that Python's json reads but that would not come out as it went in
    "NaN": (b'{"text": "a", "x": NaN}', "NaN is not JSON"),
    "-Infinity": (b'{"text": "a", "x": [-Infinity]}', "-Infinity is not JSON"),
    "a number too large for a float": (b'{"text": "a", "x": 1e400}', "too large for a 64-bit float"),
    "a repeated key": (b'{"text": "first", "text": "second"}', "the key 'text' appears twice"),
    "a repeated nested key": (b'{"text": "a", "m": {"k": 1, "k": 2}}', "the key 'k' appears twice"),
    "an integer of 5000 digits": (b'{"text": "a", "n": ' + b"1" * 5000 + b"}", "invalid JSON (Exceeds the limit"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_record_stops_with_file_and_line(tmp_path: Path, case: str) -> None:
    bad, reason = BAD_CASES[case]
    path = write_jsonl(tmp_path / "in" / "docs.jsonl", [{"text": "one"}, "", {"text": "two"}, bad, {"text": "four"}])
    out = tmp_path / "out"
    with pytest.raises(ConvertError) as error:
        run([path], out)
    assert f"{path}: line 4: " in str(error.value) and reason in str(error.value)
    assert not (out / "manifest.json").exists()
    assert not list(out.glob("*.tar"))

    # The same conversion with --on-bad-record skip resumes in the same work directory.
    report = run([path], out, on_bad_record="skip")
    assert report.finalized and report.num_samples == 3 and report.rejected == 1
    (item,) = report.inputs
    assert (item.lines, item.blank_lines, item.records, item.samples, item.rejected) == (5, 1, 4, 3, 1)
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert reject["input"] == str(path) and reject["line"] == 4 and reason in reject["reason"]
    raw = reject["raw"].encode("utf-8") if "raw" in reject else base64.b64decode(reject["raw_base64"])
    assert raw == bad  # verbatim
    manifest = wdsraft.Manifest.load(str(out / "manifest.json"))
    assert manifest.inputs == [item.to_dict()]
    assert manifest.conversion is not None and manifest.conversion["rejects"] == "rejects.jsonl"


def test_blank_lines_are_not_records(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", ["", {"text": "a"}, "   ", "\r", {"text": "b"}, ""])
    report = run([path], tmp_path / "out")
    (item,) = report.inputs
    assert (item.lines, item.blank_lines, item.records, item.samples, item.rejected) == (6, 4, 2, 2, 0)
    assert not (tmp_path / "out" / "rejects.jsonl").exists()


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_truncated_compressed_input(tmp_path: Path, suffix: str) -> None:
    records = synthetic(3000, seed=5)  # several zstd blocks: a cut one loses only its last block
    whole = write_jsonl(tmp_path / f"whole.jsonl{suffix}", records).read_bytes()
    path = tmp_path / "in" / f"cut.jsonl{suffix}"
    path.parent.mkdir()
    path.write_bytes(whole[: len(whole) * 2 // 3])
    out = tmp_path / "out"
    with pytest.raises(ConvertError) as error:
        run([path], out)
    assert f"{path}: line " in str(error.value) and ("truncated" in str(error.value) or "corrupt" in str(error.value))

    report = run([path], out, on_bad_record="skip")
    (item,) = report.inputs
    assert item.rejected == 1 and item.samples > 1000 and item.records == item.samples + item.rejected
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert reject["line"] == item.samples + 1 and "unreadable" in reject["reason"]
    # what was read before the damage is exact: whole records, the partial one verbatim in the rejects
    texts = sorted(s["txt"].decode() for s in read_samples(out))
    assert texts == sorted(r["text"] for r in records[: item.samples])
    assert json.dumps(records[item.samples]).startswith(reject["raw"])


def test_lines_before_damage_inside_a_gzip_stream_are_kept(tmp_path: Path) -> None:
    """A good first gzip member then a damaged one: every line of the first is converted and the reject
    names the first line of the second (the output the failing decompress call had made was lost, with
    the line number shifted back onto a good line)."""
    records = synthetic(1000, seed=7)
    first = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in records), mtime=0)
    second = bytearray(gzip.compress(b'{"text": "never read"}\n', mtime=0))
    second[3] = 0xE0  # reserved header flags: the second member is unreadable from its first byte
    path = tmp_path / "in" / "two.jsonl.gz"
    path.parent.mkdir()
    path.write_bytes(first + bytes(second))
    with pytest.raises(ConvertError, match="line 1001"):
        run([path], tmp_path / "strict")
    report = run([path], tmp_path / "out", on_bad_record="skip")
    (item,) = report.inputs
    assert (item.samples, item.rejected) == (1000, 1)
    assert sorted(s["txt"].decode() for s in read_samples(tmp_path / "out")) == sorted(r["text"] for r in records)


def test_multi_member_gzip_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl.gz"
    first = b"".join(json.dumps(r).encode() + b"\r\n" for r in synthetic(10, seed=1))
    second = b"".join(json.dumps(r).encode() + b"\n" for r in synthetic(10, seed=2))
    path.write_bytes(gzip.compress(first) + gzip.compress(second))
    report = run([path], tmp_path / "out")
    assert report.inputs[0].samples == 20 and report.inputs[0].rejected == 0


@pytest.mark.parametrize("between", ["end", "middle"])
def test_zero_padding_after_a_gzip_member_reads_as_pythons_gzip_reads_it(tmp_path: Path, between: str) -> None:
    """Zeros after a member (tape-style padding) are skipped, however far they run: here past the reader's
    64 KiB pieces, so they reach a decoder of their own. What follows them, another member, is read too.
    Python's gzip module reads the same lines from the same file."""
    path = tmp_path / "docs.jsonl.gz"
    first = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in synthetic(10, seed=1)))
    padding = bytes(-len(first) % (1 << 16) + (1 << 16) + 512)  # (to the next piece, over one more, and on)
    second = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in synthetic(5, seed=2)))
    path.write_bytes(first + padding + (second if between == "middle" else b""))
    expected = len(gzip.decompress(path.read_bytes()).splitlines())
    report = run([path], tmp_path / "out", on_bad_record="skip")
    assert expected == (15 if between == "middle" else 10)
    assert (report.inputs[0].lines, report.inputs[0].samples, report.inputs[0].rejected) == (expected, expected, 0)


# ---------------------------------------------------------------------------------------------
# resume, re-runs, the command line


def test_rerun_is_a_no_op_and_output_is_protected(tmp_path: Path, corpus) -> None:
    paths, _ = corpus
    out = tmp_path / "out"
    run(paths, out, samples_per_shard=100)
    before = dataset_files(out)
    again = run(paths, out, samples_per_shard=100)
    assert again.already_done and not again.finalized and dataset_files(out) == before
    with pytest.raises(ConvertError, match="--overwrite"):
        run(paths, out, samples_per_shard=100, seed=1)
    run(paths, out, samples_per_shard=50, seed=1, overwrite=True)
    assert dataset_files(out) != before
    assert len(read_samples(out)) == sum(len(p) for p in corpus[1])


def test_workdir_of_another_conversion_is_refused(tmp_path: Path, corpus) -> None:
    paths, _ = corpus
    work = tmp_path / "work"
    with pytest.raises(ConvertError):
        run([*paths, tmp_path / "missing.jsonl"], tmp_path / "out", workdir=str(work))
    run(paths, tmp_path / "out", workdir=str(work), phase="scatter")
    with pytest.raises(ConvertError, match="seed: 0 then, 3 now"):
        run(paths, tmp_path / "out", workdir=str(work), seed=3)


def test_cli_convert(tmp_path: Path, corpus, capsys: pytest.CaptureFixture[str]) -> None:
    _, parts = corpus
    pattern = str(tmp_path / "in" / "part-{a,b,c}.jsonl*")
    status = cli.main(["convert", pattern, "-o", str(tmp_path / "out"), "--samples-per-shard", "64", "-q"])
    printed = capsys.readouterr().out
    assert status == 0
    assert "total" in printed and f"{sum(map(len, parts)):,}" in printed and "ok" in printed
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, b"{oops"])
    assert cli.main(["convert", str(bad), "-o", str(tmp_path / "bad-out"), "-q"]) == 1
    assert f"{bad}: line 2: invalid JSON" in capsys.readouterr().err
    script = subprocess.run(
        [PYTHON, "scripts/preshuffle.py", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    assert "--samples-per-shard" in script.stdout and "SLURM" in script.stdout


def test_big_bucket_is_written_in_key_slices(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    paths = [write_jsonl(tmp_path / f"p{i}.jsonl", synthetic(1500, seed=i, words=400)) for i in range(3)]
    assert sum(p.stat().st_size for p in paths) > 8 << 20
    roomy, tight = tmp_path / "roomy", tmp_path / "tight"
    run(paths, roomy, buckets=1, memory=256 << 20, samples_per_shard=1000)
    caplog.set_level(logging.INFO, logger="wdsraft.convert")
    run(paths, tight, buckets=1, memory=4 << 20, samples_per_shard=1000)  # 9 MB bucket, 4 MB budget
    assert "exceeds the memory budget: writing it in" in caplog.text
    assert dataset_files(roomy) == dataset_files(tight)


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the converter never reached the kill point"
        time.sleep(0.05)


@pytest.mark.parametrize(("kill_at", "phase"), [("spill-unit1:1", "scatter"), ("shard:2", "write")])
def test_resume_after_sigkill(tmp_path: Path, kill_at: str, phase: str) -> None:
    # 3 inputs of 3.3 MB; with --memory 4M the scatter spills several times per input
    paths = [write_jsonl(tmp_path / "in" / f"p{i}.jsonl", synthetic(1800, seed=i, words=400)) for i in range(3)]
    args = ["--memory", "4M", "--workers", "1", "--buckets", "2", "--samples-per-shard", "300"]
    reference = tmp_path / "reference"
    run(paths, reference, memory=4 << 20, workers=1, buckets=2, samples_per_shard=300)

    out = tmp_path / "out"
    marker = tmp_path / "paused"
    env = {**os.environ, "WDSRAFT_CONVERT_PAUSE_AT": kill_at, "WDSRAFT_CONVERT_PAUSE_MARKER": str(marker)}
    command = cli_command(*map(str, paths), "-o", str(out), *args)
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(marker, process)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()

    # Nothing partial under a final name: each shard present is whole and matches its index.
    assert not (out / "manifest.json").exists()
    work = out / ".wdsraft-work"
    done_units = sorted(work.glob("scatter/*.done"))
    committed = sorted(out.glob("*.tar"))
    for shard in committed:
        index = ShardIndex.load(str(shard))
        assert index.size == shard.stat().st_size
        assert len(list(wdsraft.tarfile_samples([{"url": str(shard)}]))) == index.num_samples
    if phase == "scatter":
        assert len(done_units) == 1 and not committed
        assert list(work.glob("scatter/.unit-000001.data.tmp-*"))  # the killed unit's partial data, under a temp name
        assert not (work / "scatter" / "unit-000001.data").exists()
    else:
        assert len(done_units) == 3 and len(committed) == 2 and not list(work.glob("write/*.done"))

    report = run(paths, out, memory=4 << 20, workers=1, buckets=2, samples_per_shard=300)
    assert report.units_done == (2 if phase == "scatter" else 0)  # finished inputs are not read again
    assert report.buckets_done == 2
    assert dataset_files(out) == dataset_files(reference)
    assert not work.exists()


def test_slurm_array_tasks(tmp_path: Path, corpus) -> None:
    paths, _ = corpus
    reference = tmp_path / "reference"
    run(paths, reference, samples_per_shard=40, buckets=5)
    inputs = [str(p) for p in paths]

    # One array, every task running the whole job: the last one to finish writes the manifest.
    out = tmp_path / "array"
    work = tmp_path / "array-work"
    args = cli_command(*inputs, "-o", str(out), "--workdir", str(work), "--samples-per-shard", "40", "--buckets", "5")
    processes = [
        subprocess.Popen(
            args,
            env={**os.environ, "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": "3"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for task in range(3)
    ]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], outputs
    assert sum("manifest" in stdout for stdout, _ in outputs) == 1  # exactly one task finalized
    assert dataset_files(out) == dataset_files(reference)
    assert not work.exists()

    # Three dependent jobs: scatter array, write array, finalize.
    out = tmp_path / "phases"
    work = tmp_path / "phases-work"
    args = cli_command(*inputs, "-o", str(out), "--workdir", str(work), "--samples-per-shard", "40", "--buckets", "5")
    processes = [
        subprocess.Popen(
            [*args, "--phase", "scatter"],
            env={
                **os.environ,
                "SLURM_ARRAY_TASK_ID": str(task + 1),
                "SLURM_ARRAY_TASK_MIN": "1",
                "SLURM_ARRAY_TASK_COUNT": "2",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for task in range(2)
    ]
    assert [p.wait(timeout=120) for p in processes] == [0, 0]
    assert len(list(work.glob("scatter/*.done"))) == 3 and not (out / "manifest.json").exists()
    with pytest.raises(ConvertError, match="write phase has not finished"):
        run([], out, workdir=str(work), phase="finalize")
    for task in range(2):
        options = {"workdir": str(work), "phase": "write", "task_index": task, "task_count": 2}
        run([], out, **options)
    run([], out, workdir=str(work), phase="finalize")
    assert dataset_files(out) == dataset_files(reference)


def test_failed_task_stops_the_others(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "in" / "a.jsonl", synthetic(50, seed=1))
    bad = write_jsonl(tmp_path / "in" / "b.jsonl", [{"text": "x"}, b"not json"])
    work = tmp_path / "work"
    run([good, bad], tmp_path / "out", workdir=str(work), task_index=0, task_count=2, phase="scatter")
    with pytest.raises(ConvertError, match="line 2"):
        run([good, bad], tmp_path / "out", workdir=str(work), task_index=1, task_count=2, phase="scatter")
    with pytest.raises(ConvertError, match=r"another task failed on .*b\.jsonl: .*line 2"):
        run([good, bad], tmp_path / "out", workdir=str(work), task_index=0, task_count=2, poll_interval=0.05)


def test_a_task_failing_otherwise_than_on_a_bad_record_also_stops_the_others(tmp_path, monkeypatch) -> None:
    """A full disk, a permission, a vanished mount: the failing task leaves a marker too, else the other
    tasks of the array would wait for its input forever (without --wait-timeout)."""
    good = write_jsonl(tmp_path / "in" / "a.jsonl", synthetic(50, seed=1))
    other = write_jsonl(tmp_path / "in" / "b.jsonl", synthetic(50, seed=2))
    work = tmp_path / "work"
    run([good, other], tmp_path / "out", workdir=str(work), task_index=0, task_count=2, phase="scatter")
    original = wdsraft.convert.LineReader.batches

    def failing(self):
        if self.source.url.endswith("b.jsonl"):
            raise OSError(28, "No space left on device")
        return original(self)

    monkeypatch.setattr(wdsraft.convert.LineReader, "batches", failing)
    with pytest.raises(OSError):
        run([good, other], tmp_path / "out", workdir=str(work), task_index=1, task_count=2, phase="scatter")
    monkeypatch.setattr(wdsraft.convert.LineReader, "batches", original)
    with pytest.raises(ConvertError, match=r"another task failed on .*b\.jsonl: OSError.*space.*rerun"):
        run(  # (a regression waits: the timeout turns it into a failure with another message)
            [good, other],
            tmp_path / "out",
            workdir=str(work),
            task_index=0,
            task_count=2,
            poll_interval=0.05,
            wait_timeout=20,
        )
    # The owner's retry clears it, and the conversion completes.
    run([good, other], tmp_path / "out", workdir=str(work), task_index=1, task_count=2, phase="scatter")
    assert not list((work / "scatter").glob("*.failed"))
    assert run([good, other], tmp_path / "out", workdir=str(work)).num_samples == 100


# ---------------------------------------------------------------------------------------------
# S3


@pytest.mark.parametrize("uploader", ["s5cmd", "smart_open"])
def test_s3_input_and_output(tmp_path: Path, s3_bucket: str, uploader: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    if uploader == "s5cmd" and shutil.which("s5cmd") is None:
        pytest.skip("s5cmd binary not installed")
    monkeypatch.setenv("WDSRAFT_S3_WRITER", uploader)
    local = [
        write_jsonl(tmp_path / "in" / "x.jsonl.gz", synthetic(150, seed=1)),
        write_jsonl(tmp_path / "in" / "y.jsonl", synthetic(120, seed=2)),
    ]
    client = boto3.client("s3")
    for path in local:
        client.upload_file(str(path), s3_bucket, f"raw/{path.name}")
    output = f"s3://{s3_bucket}/shards/train"
    work = tmp_path / "work"
    report = run([f"s3://{s3_bucket}/raw/"], output, workdir=str(work), samples_per_shard=50, buckets=2)
    assert report.finalized and report.num_samples == 270
    samples = read_samples(output)
    assert len({s["__key__"] for s in samples}) == 270
    # The same files converted locally give the same shards, byte for byte.
    reference = tmp_path / "reference"
    run(local, reference, samples_per_shard=50, buckets=2)
    for name, data in dataset_files(reference).items():
        if name.endswith((".tar", ".idx")):
            assert client.get_object(Bucket=s3_bucket, Key=f"shards/train/{name}")["Body"].read() == data
    assert not work.exists()


# ---------------------------------------------------------------------------------------------
# memory


_MEASURE = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def _peak_rss(command: list[str]) -> int:
    """Peak RSS of ``command`` (its largest process), from a fresh parent so no other child counts."""
    result = subprocess.run([PYTHON, "-c", _MEASURE, *command], capture_output=True, text=True, check=True)
    return int(result.stdout.split()[-1])


@pytest.mark.parametrize("buckets", [None, 1], ids=["planned-buckets", "one-48MB-bucket"])
def test_memory_stays_within_budget(tmp_path: Path, buckets: int | None) -> None:
    rng = random.Random(0)
    paths = []
    for i in range(4):  # 4 x 12 MB of JSONL (48 MB); budget 8 MB
        records = [{"id": n, "text": base64.b64encode(rng.randbytes(3000)).decode() * 1} for n in range(3000)]
        paths.append(write_jsonl(tmp_path / "big" / f"p{i}.jsonl", records))
    corpus_bytes = sum(p.stat().st_size for p in paths)
    assert corpus_bytes > 45 << 20
    tiny = write_jsonl(tmp_path / "tiny" / "t.jsonl", [{"text": "x"}])
    budget = 8 << 20
    common = ["--memory", str(budget), "--workers", "1", *(["--buckets", str(buckets)] if buckets else [])]
    baseline = _peak_rss([*cli_command(str(tiny), "-o", str(tmp_path / "tiny-out")), *common])
    peak = _peak_rss([*cli_command(*map(str, paths), "-o", str(tmp_path / "big-out")), *common])
    assert len(read_samples(tmp_path / "big-out")) == 12000
    # The fixed overhead is what converting one record costs; the data adds at most the budget
    # (2 MiB of tolerance for the allocator), far less than the 48 MB corpus.
    print(
        f"peak RSS {peak / 2**20:.1f} MiB, fixed overhead {baseline / 2**20:.1f} MiB, budget {budget / 2**20:.0f} MiB"
    )
    assert peak - baseline < budget + (2 << 20), (peak - baseline) / 2**20


def test_lock_left_by_a_task_killed_while_finalizing(tmp_path: Path, corpus) -> None:
    """A rerun of the task that held the finalize lock (SIGKILL, preemption, time limit) takes it over;
    another task defers to a lock held by a live one."""
    paths, _ = corpus
    reference = tmp_path / "reference"
    run(paths, reference, samples_per_shard=40, buckets=3)
    out, work = tmp_path / "out", tmp_path / "work"
    options = {"samples_per_shard": 40, "buckets": 3, "workdir": str(work), "task_count": 2}
    for task in range(2):
        run(paths, out, task_index=task, phase="scatter", **options)
    run(paths, out, task_index=0, phase="write", **options)
    (work / "finalize.lock").write_text(json.dumps({"task": 1, "pid": 1}))  # task 1 died while finalizing
    assert not run(paths, out, task_index=0, **options).finalized  # task 1's, and task 1 may be alive
    assert run(paths, out, task_index=1, **options).finalized  # task 1 again: its own lock, taken over
    assert dataset_files(out) == dataset_files(reference) and not work.exists()


def test_slurm_array_with_a_step(monkeypatch) -> None:
    from wdsraft.convert import slurm_array_task

    env = {"SLURM_ARRAY_TASK_ID": "14", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "8"}
    for key, value in {**env, "SLURM_ARRAY_TASK_STEP": "2"}.items():
        monkeypatch.setenv(key, value)
    assert slurm_array_task() == (7, 8)  # --array=0-14:2


def test_input_names_stay_unique() -> None:
    from wdsraft.convert import InputFile, _name_inputs

    inputs = [InputFile(url, 1, None) for url in ("/d/x.jsonl", "/d/x.jsonl.jsonl", "/d/x.ndjson", "/d/y.jsonl")]
    _name_inputs(inputs)
    names = [item.name for item in inputs]
    assert len(set(names)) == len(names) and names[-1] == "y"


def test_multi_member_gzip_size_estimate(tmp_path: Path) -> None:
    from wdsraft.convert import InputFile

    path = tmp_path / "multi.jsonl.gz"
    with open(path, "wb") as out:  # bgzip/pigz -i style: several members, the last one empty
        for part in range(20):
            out.write(gzip.compress(b"".join(b'{"text": "%d"}\n' % (part * 1000 + n) for n in range(1000))))
        out.write(gzip.compress(b""))
    estimate = InputFile(str(path), path.stat().st_size, "gzip").estimated_bytes()
    assert path.stat().st_size < estimate < 100 * path.stat().st_size  # not 4 GiB


def test_finishing_removes_only_what_it_wrote_in_the_work_directory(tmp_path: Path) -> None:
    """A work directory may be shared scratch, or the output itself: finishing removes the conversion's own
    files only (it removed the whole directory, with the output or unrelated files in it). A rerun after a
    kill between the manifest and that removal finishes it."""
    source = write_jsonl(tmp_path / "in" / "a.jsonl", synthetic(40, seed=1))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "results.csv").write_text("someone else's")
    run([source], tmp_path / "out", workdir=str(scratch))
    assert [p.name for p in scratch.iterdir()] == ["results.csv"]
    run([source], tmp_path / "same", workdir=str(tmp_path / "same"))
    assert len(read_samples(tmp_path / "same")) == 40 and not (tmp_path / "same" / "scatter").exists()
    run([source], tmp_path / "kept", workdir=str(tmp_path / "work"), keep_workdir=True)  # (stands for the kill)
    assert (tmp_path / "work" / "plan.json").exists()
    run([source], tmp_path / "kept", workdir=str(tmp_path / "work"))
    assert not (tmp_path / "work").exists()


def test_a_resubmitted_finalize_of_a_finished_conversion_is_a_no_op(tmp_path: Path) -> None:
    """write/finalize tasks take no inputs; resubmitted after the conversion finished (its plan removed),
    they report the finished dataset instead of failing with 'no plan'."""
    source = write_jsonl(tmp_path / "in" / "a.jsonl", synthetic(30, seed=2))
    run([source], tmp_path / "out")
    for phase in ("write", "finalize"):
        report = run([], tmp_path / "out", phase=phase)
        assert report.already_done and report.num_samples == 30
    with pytest.raises(ConvertError, match="no plan"):
        run([], tmp_path / "elsewhere", phase="finalize")


@pytest.mark.parametrize("name_length", range(8))
def test_a_bom_split_across_the_first_decoded_pieces_is_stripped(tmp_path: Path, name_length: int) -> None:
    """The first 18 bytes read (the magic sniff) can end inside a stored-deflate BOM, so the decoder
    hands it out in two pieces: it is still a BOM, not 'invalid JSON' on line 1."""
    data = b'\xef\xbb\xbf{"text": "a"}\n{"text": "b"}\n'
    packer = zlib.compressobj(0, zlib.DEFLATED, -15)  # stored: the BOM's bytes sit at fixed offsets
    body = packer.compress(data) + packer.flush()
    name = b"x" * name_length + b"\0" if name_length else b""
    header = b"\x1f\x8b\x08" + bytes([0x08 if name_length else 0]) + b"\0\0\0\0\0\xff" + name
    path = tmp_path / "in" / "bom.jsonl.gz"
    path.parent.mkdir()
    path.write_bytes(header + body + zlib.crc32(data).to_bytes(4, "little") + len(data).to_bytes(4, "little"))
    run([path], tmp_path / "out")
    assert sorted(s["txt"].decode() for s in read_samples(tmp_path / "out")) == ["a", "b"]


def test_shard_names_from_the_output_name_are_plain_url_paths(tmp_path: Path) -> None:
    """An output named like a version (``v1.0``) names its shards ``v1.0-*.tar``: they were ``v1%2E0-*.tar``
    (sample-key escaping), which a manifest's URLs over HTTP read as an escape, and missed."""
    corpus = Path(__file__).resolve().parents[2] / "examples" / "data" / "kernel-docs-sample.jsonl.zst"
    for output, prefix in (("v1.0", "v1.0"), ("my data", "my_data")):
        assert cli.main(["convert", str(corpus), "--output", str(tmp_path / output), "-q"]) == 0
        manifest_url = str(tmp_path / output / "manifest.json")
        urls = wdsraft.Manifest.load(manifest_url).urls(manifest_url)
        assert [Path(url).name for url in urls] == [f"{prefix}-000000.tar"]
        assert all(Path(url).exists() for url in urls)
