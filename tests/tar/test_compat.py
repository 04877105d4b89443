"""Byte compatibility with webdataset 1.0.2 and GNU tar, in both directions."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import shutil
import subprocess
import tarfile
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import webdataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardutil import corpus_samples, read_wdsraft, read_webdataset, without_positions

import wdsraft
from wdsraft.index.shard_index import ShardIndex

FORMATS = [None, "PAX_FORMAT", "GNU_FORMAT"]


def _long_key(number: int) -> str:
    # Over 100 bytes: needs a GNU L header, a PAX path record, or (ustar) the prefix field.
    return f"deep/{'directory-' * 8}/{'x' * 60}-{number:04d}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_shards_written_by_webdataset_read_identically(tmp_path: Path, corpus_records, fmt) -> None:
    samples = corpus_samples(corpus_records, 120)
    for number in range(0, 120, 7):  # long names, gzipped members, upper-case extensions
        samples[number]["__key__"] = _long_key(number)
        samples[number]["txt.gz"] = gzip.compress(samples[number]["txt"].encode())
        samples[number]["CLS"] = str(number).encode()
    pattern = str(tmp_path / "wds-%03d.tar")
    with webdataset.ShardWriter(pattern, maxcount=25, format=fmt, verbose=0) as sink:
        for sample in samples:
            sink.write(sample)
    urls = sorted(str(p) for p in tmp_path.glob("wds-*.tar"))
    theirs = read_webdataset(urls)
    ours = read_wdsraft(urls)
    assert len(ours) == len(samples) == len(theirs)
    assert without_positions(ours) == theirs
    assert ours[7]["__key__"] == _long_key(7) and ours[7]["cls"] == b"7"


def test_gzipped_shards_from_webdataset(tmp_path: Path, corpus_records) -> None:
    samples = corpus_samples(corpus_records, 60)
    for suffix in ("tar.gz", "tgz"):
        with webdataset.TarWriter(str(tmp_path / f"shard.{suffix}")) as sink:
            for sample in samples:
                sink.write(sample)
        url = str(tmp_path / f"shard.{suffix}")
        assert without_positions(read_wdsraft([url])) == read_webdataset([url])


def test_gzipped_shard_with_plain_tar_name_is_sniffed(tmp_path: Path, corpus_records) -> None:
    url = str(tmp_path / "disguised.tar")
    with open(url, "wb") as raw, webdataset.TarWriter(raw, compress=True) as sink:
        for sample in corpus_samples(corpus_records, 10):
            sink.write(sample)
    assert without_positions(read_wdsraft([url])) == read_webdataset([url])


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar not installed")
@pytest.mark.parametrize("tar_format", ["gnu", "posix", "ustar", "v7"])
def test_archives_made_by_gnu_tar(tmp_path: Path, tar_format: str) -> None:
    tree = tmp_path / "tree"
    (tree / "sub" / "deeper").mkdir(parents=True)
    names = ["a.txt", "a.json", "b.txt", "sub/c.txt", "sub/c.cls", "sub/deeper/d.txt"]
    if tar_format in ("gnu", "posix"):
        names.append("sub/" + "long" * 30 + ".txt")  # a basename over 100 bytes
    if tar_format != "v7":
        names.append("sub/" + "d" * 90 + "/e.txt")  # a path over 100 bytes: the ustar prefix field
    for number, name in enumerate(names):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(f"content {number} of {name}".encode() * (number * 40 + 1))
    os.symlink("a.txt", tree / "link.txt")  # a non-regular member: skipped, like webdataset
    archive = tmp_path / f"gnu-{tar_format}.tar"
    # Members in a fixed order; directories are members too and must be skipped.
    subprocess.run(
        ["tar", f"--format={tar_format}", "-cf", str(archive), "-C", str(tree), "--sort=name", "."],
        check=True,
    )
    theirs = read_webdataset([str(archive)])
    ours = read_wdsraft([str(archive)])
    assert without_positions(ours) == theirs
    assert len(ours) >= 4


def test_shards_written_by_wdsraft_read_identically_by_webdataset(tmp_path: Path, corpus_records) -> None:
    samples = corpus_samples(corpus_records)
    samples[3]["__key__"] = _long_key(3)
    with wdsraft.ShardWriter(str(tmp_path / "ours-%06d.tar"), maxcount=100, verbose=0) as sink:
        for sample in samples:
            sink.write(sample)
    urls = sorted(str(p) for p in tmp_path.glob("ours-*.tar"))
    assert len(urls) == 5
    theirs = webdataset.WebDataset(urls, shardshuffle=False).decode()
    decoded = [(s["__key__"], s["txt"], s["json"]) for s in theirs]
    assert decoded == [(s["__key__"], s["txt"], s["json"]) for s in samples]
    assert without_positions(read_wdsraft(urls)) == read_webdataset(urls)


def test_tar_writer_matches_webdataset_byte_for_byte(tmp_path: Path, corpus_records) -> None:
    samples = corpus_samples(corpus_records, 40)
    samples[5]["__key__"] = _long_key(5)
    samples[6]["__key__"] = "unicode/ключ-документа"
    ours, theirs = tmp_path / "ours.tar", tmp_path / "theirs.tar"
    with wdsraft.TarWriter(str(ours), mtime=1_700_000_000) as sink:
        for sample in samples:
            sink.write(dict(sample))
    with webdataset.TarWriter(str(theirs), mtime=1_700_000_000) as sink:
        for sample in samples:
            sink.write(dict(sample))
    assert ours.read_bytes() == theirs.read_bytes()


def test_default_writer_has_no_per_member_pax_records(tmp_path: Path, corpus_records) -> None:
    """webdataset's float mtimes add a PAX header to every member; ours are plain ustar blocks."""
    samples = corpus_samples(corpus_records, 50)
    ours, theirs = tmp_path / "ours.tar", tmp_path / "theirs.tar"
    with wdsraft.TarWriter(str(ours)) as sink:
        for sample in samples:
            sink.write(dict(sample))
    with webdataset.TarWriter(str(theirs)) as sink:
        for sample in samples:
            sink.write(dict(sample))
    assert b"PaxHeader" not in ours.read_bytes() and b"PaxHeader" in theirs.read_bytes()
    assert ours.stat().st_size < theirs.stat().st_size

    def contents(samples):
        return [{k: v for k, v in s.items() if k != "__url__"} for s in samples]

    assert contents(without_positions(read_wdsraft([str(ours)]))) == contents(read_webdataset([str(theirs)]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_explicit_formats_read_by_both(tmp_path: Path, corpus_records, fmt) -> None:
    samples = corpus_samples(corpus_records, 20)
    samples[4]["__key__"] = _long_key(4)
    url = str(tmp_path / "shard.tar")
    with wdsraft.TarWriter(url, format=fmt) as sink:
        for sample in samples:
            sink.write(sample)
    assert without_positions(read_wdsraft([url])) == read_webdataset([url])
    assert read_wdsraft([url])[4]["__key__"] == _long_key(4)


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar not installed")
def test_gnu_tar_lists_and_extracts_wdsraft_shards(tmp_path: Path, corpus_records) -> None:
    samples = corpus_samples(corpus_records, 30)
    samples[2]["__key__"] = _long_key(2)
    shard = tmp_path / "shard.tar"
    with wdsraft.TarWriter(str(shard), format="PAX_FORMAT") as sink:
        for sample in samples:
            sink.write(sample)
    listing = subprocess.run(["tar", "tvf", str(shard)], check=True, capture_output=True, text=True).stdout
    assert len(listing.splitlines()) == 60
    assert "bigdata/bigdata" in listing and f"{_long_key(2)}.txt" in listing
    out = tmp_path / "extracted"
    out.mkdir()
    subprocess.run(["tar", "xf", str(shard), "-C", str(out)], check=True)
    assert (out / "00000000.txt").read_text() == samples[0]["txt"]
    assert (out / f"{_long_key(2)}.txt").read_text() == samples[2]["txt"]
    with tarfile.open(shard) as archive:  # and Python's own reader agrees
        assert len(archive.getmembers()) == 60


def test_compressed_output_is_readable_by_both(tmp_path: Path, corpus_records) -> None:
    for name in ("shard.tar.gz", "shard.tar.bz2", "shard.tar.xz"):
        url = str(tmp_path / name)
        with wdsraft.TarWriter(url) as sink:
            for sample in corpus_samples(corpus_records, 15):
                sink.write(sample)
        assert without_positions(read_wdsraft([url])) == read_webdataset([url])


_keys = st.lists(
    st.from_regex(r"[a-z0-9]{1,12}(/[a-zA-Z0-9_-]{1,40}){0,3}", fullmatch=True), min_size=1, max_size=25, unique=True
)
_fields = st.dictionaries(
    st.sampled_from(["txt", "json", "bin", "cls", "seg.png", "TXT2"]),
    st.binary(min_size=0, max_size=3000) | st.sampled_from([b"", b"x" * 511, b"y" * 512, b"z" * 513]),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    keys=_keys,
    fields=st.data(),
    fmt=st.sampled_from(FORMATS),
    compress=st.booleans(),
    block_size=st.sampled_from([512, 1024, 4096, 1 << 20]),
)
def test_random_shards_agree_with_webdataset(tmp_path_factory, keys, fields, fmt, compress, block_size) -> None:
    """Any sample set webdataset writes, in any format, reads the same through wdsraft at any buffer size."""
    directory = tmp_path_factory.mktemp("prop")
    url = str(directory / ("shard.tar.gz" if compress else "shard.tar"))
    samples = [{"__key__": f"{n:03d}-{key}", **fields.draw(_fields)} for n, key in enumerate(keys)]
    with webdataset.TarWriter(url, format=fmt, encoder=False) as sink:
        for sample in samples:
            sink.write(sample)
    reader = wdsraft.ShardSampleReader(url, block_size=block_size)
    ours = list(reader)
    assert without_positions(ours) == read_webdataset([url])
    assert [s["__ordinal__"] for s in ours] == list(range(len(samples)))
    assert reader.exhausted


def write_members(url: str, names: Sequence[str]) -> None:
    """A tar of one-byte members with these names, in this order (shapes no writer would make)."""
    from io import BytesIO

    with tarfile.open(url, "w") as archive:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 1
            archive.addfile(info, BytesIO(b"x"))


def assert_resumes_at_every_sample(url: str, **kw: Any) -> list[dict[str, Any]]:
    full = list(wdsraft.ShardSampleReader(url, **kw))
    for number, sample in enumerate(full):
        tail = wdsraft.ShardSampleReader(url, offset=sample["__offset__"], ordinal=sample["__ordinal__"], **kw)
        assert [s["__key__"] for s in tail] == [s["__key__"] for s in full[number:]], number
    return full


def test_rename_files_can_give_extensionless_members_an_extension(tmp_path: Path) -> None:
    url = str(tmp_path / "noext.tar")
    write_members(url, ("a", "a.txt", "b", "c.txt"))

    def rename(name: str) -> str:
        return name if "." in name else name + ".bin"

    theirs = list(webdataset.tarfile_samples([{"url": url}], rename_files=rename))
    ours = list(wdsraft.tarfile_samples([{"url": url}], rename_files=rename))
    assert without_positions(ours) == theirs and [s["__key__"] for s in ours] == ["a", "b", "c"]
    assert_resumes_at_every_sample(url, rename_files=rename)  # (b starts at its own member)


def test_a_rename_that_splits_a_sample_still_resumes(tmp_path: Path) -> None:
    url = str(tmp_path / "split.tar")
    write_members(url, ("k.jpg", "k.txt", "m.txt"))

    def rename(name: str) -> str:
        return "j.txt" if name == "k.txt" else name

    full = assert_resumes_at_every_sample(url, rename_files=rename)
    assert [s["__key__"] for s in full] == ["k", "j", "m"]


@pytest.mark.parametrize("indexed", [False, True])
def test_a_raised_duplicate_does_not_hand_out_the_sample_in_hand(tmp_path: Path, indexed: bool) -> None:
    """A duplicate extension the handler raises for: the sample it belongs to lacks that member and does not
    go out before the error (webdataset's grouping raises before yielding it), with or without an index."""
    url = str(tmp_path / "dup.tar")
    write_members(url, ("a.txt", "b.txt", "b.TXT", "b.json", "c.txt"))
    if indexed:
        offsets = array("Q", [0, 1024, 4096, 5120])  # (a, b, c as the member walk groups them, and the end)
        ShardIndex("dup.tar", offsets, Path(url).stat().st_size, None, None).save(url)
    with pytest.raises(ValueError, match="duplicate file name"):
        list(webdataset.tarfile_samples([{"url": url}]))
    theirs = []
    with contextlib.suppress(ValueError):
        theirs.extend(webdataset.tarfile_samples([{"url": url}]))
    ours = []
    with pytest.raises(ValueError, match="duplicate file name"):
        for sample in wdsraft.ShardSampleReader(url, index="auto" if indexed else None):
            ours.append(sample)
    assert without_positions(ours) == [{k: v for k, v in s.items() if k != "__local_path__"} for s in theirs]
    assert [s["__key__"] for s in ours] == ["a"]


def test_stop_handler_on_duplicate_stops_everything_like_webdataset(tmp_path: Path) -> None:
    url = str(tmp_path / "dup.tar")
    write_members(url, ("a.txt", "a.txt", "b.txt"))
    sources = [{"url": url}, {"url": url}]
    theirs = list(webdataset.tarfile_samples(sources, handler=webdataset.ignore_and_stop))
    ours = list(wdsraft.tarfile_samples(sources, handler=wdsraft.ignore_and_stop))
    assert without_positions(ours) == theirs and len(ours) == 1


def test_tar_file_iterator_reads_compressed_streams_like_webdataset(tmp_path: Path) -> None:
    url = str(tmp_path / "plain.tar")
    write_members(url, ("a.txt", "b.txt"))
    packed = tmp_path / "packed.tar.gz"
    packed.write_bytes(gzip.compress(Path(url).read_bytes()))
    with open(packed, "rb") as theirs_file, open(packed, "rb") as ours_file:
        theirs = [(m["fname"], m["data"]) for m in webdataset.tariterators.tar_file_iterator(theirs_file)]
        ours = [(m["fname"], m["data"]) for m in wdsraft.tariterators.tar_file_iterator(ours_file)]
    assert ours == theirs == [("a.txt", b"x"), ("b.txt", b"x")]


def test_odd_member_names_group_as_webdataset_groups_them(tmp_path: Path) -> None:
    """Keys and extensions of names with and without directories, dots where the inline split must hand over to
    ``split_key``: no dot, a leading dot, an empty extension, several dots, dots in directory names; and names
    starting with underscores, metadata (skipped) or not."""
    names = [
        "README", "a.txt", "a.JSON", "a.", "a.b.c", ".hidden", "..x", "x..y", "x..z", "d.e/f.txt", "d.e/f.cls",
        "d.e/g", "dir/.h.txt", "./k.txt", "./k.json", "k.txt", "s/t/u.v.w", "s/t/u.x", "ü.txt", "ü.json",
        "__meta__", "_u.txt", "__v__/w.txt", "_x_.txt", "__y.txt",
    ]  # fmt: skip
    url = str(tmp_path / "names.tar")
    with tarfile.open(url, "w", format=tarfile.USTAR_FORMAT) as archive:
        for number, name in enumerate(names):
            info = tarfile.TarInfo(name)
            payload = f"{number}:{name}".encode()
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    ours, theirs = read_wdsraft([url]), read_webdataset([url])
    assert without_positions(ours) == theirs
    assert [s["__key__"] for s in theirs] == ["a", "x", "d.e/f", "dir/", "./k", "k", "s/t/u", "ü", "_u", "_x_", "__y"]
