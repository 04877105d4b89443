"""Bad shards give errors that name the shard and the byte offset; handlers decide; nothing hangs."""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import boto3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardutil import corpus_samples

import wdsraft
from wdsraft.tar.members import TarMemberReader


@pytest.fixture(scope="module")
def good_shard(tmp_path_factory, corpus_records) -> tuple[bytes, list[dict]]:
    """The bytes of a valid 12-sample shard and its samples (one sample with a PAX long name)."""
    directory = tmp_path_factory.mktemp("good")
    samples = corpus_samples(corpus_records, 12)
    samples[4]["__key__"] = "long/" + "k" * 140
    url = str(directory / "good.tar")
    with wdsraft.TarWriter(url) as sink:
        for sample in samples:
            sink.write(sample)
    return Path(url).read_bytes(), list(wdsraft.ShardSampleReader(url))


def _write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def _header_offsets(data: bytes) -> list[int]:
    from io import BytesIO

    return [member.offset for member in TarMemberReader(BytesIO(data), "mem")]


def test_bad_header_checksum_names_shard_and_offset(tmp_path: Path, good_shard) -> None:
    data, full = good_shard
    target = full[6]["__offset__"]
    corrupt = bytearray(data)
    corrupt[target + 3] ^= 0x20  # one bit of the name of sample 6's first member
    url = _write(tmp_path, "corrupt.tar", bytes(corrupt))
    seen = []
    with pytest.raises(wdsraft.TarFormatError) as caught:
        for sample in wdsraft.ShardSampleReader(url):
            seen.append(sample)
    assert caught.value.url == url and caught.value.offset == target
    assert url in str(caught.value) and f"byte offset {target}" in str(caught.value)
    assert "checksum" in str(caught.value)
    assert [s["__key__"] for s in seen] == [s["__key__"] for s in full[:6]]  # nothing before it is lost


def test_truncated_member_data(tmp_path: Path, good_shard) -> None:
    data, full = good_shard
    cut = full[8]["__offset__"] + 512 + 10
    url = _write(tmp_path, "truncated.tar", data[:cut])
    with pytest.raises(wdsraft.TarFormatError, match="truncated member data") as caught:
        list(wdsraft.ShardSampleReader(url))
    assert caught.value.offset == full[8]["__offset__"]


def test_truncated_header(tmp_path: Path, good_shard) -> None:
    data, full = good_shard
    cut = full[3]["__offset__"] + 100
    url = _write(tmp_path, "truncated.tar", data[:cut])
    with pytest.raises(wdsraft.TarFormatError, match="truncated header") as caught:
        list(wdsraft.ShardSampleReader(url))
    assert caught.value.offset == full[3]["__offset__"]


def test_shard_cut_between_members_is_reported(tmp_path: Path, good_shard) -> None:
    data, full = good_shard
    url = _write(tmp_path, "cut.tar", data[: full[5]["__offset__"]])
    seen = []
    with pytest.raises(wdsraft.TarFormatError, match="without end-of-archive") as caught:
        for sample in wdsraft.ShardSampleReader(url):
            seen.append(sample)
    assert len(seen) == 5 and caught.value.offset == full[5]["__offset__"]


@pytest.mark.parametrize("content", [b"", b"this is not a tar file at all\n" * 100, os.urandom(5000)])
def test_garbage_and_empty_files(tmp_path: Path, content: bytes) -> None:
    url = _write(tmp_path, "garbage.tar", content)
    with pytest.raises(wdsraft.TarFormatError) as caught:
        list(wdsraft.ShardSampleReader(url))
    assert caught.value.offset == 0 and url in str(caught.value)


def test_corrupt_size_field_does_not_hang(tmp_path: Path, good_shard) -> None:
    data, full = good_shard
    corrupt = bytearray(data)
    offset = full[2]["__offset__"]
    corrupt[offset + 124 : offset + 135] = b"77777777777"  # an 8 GB member, checksum now wrong
    url = _write(tmp_path, "size.tar", bytes(corrupt))
    for block in (4096, 1 << 20):
        # The checksum catches it before the size is trusted (a truncation error at the same offset would
        # mean the 8 GB size was believed and read towards).
        with pytest.raises(wdsraft.TarFormatError, match="bad header checksum") as caught:
            list(wdsraft.ShardSampleReader(url, block_size=block))
        assert caught.value.offset == offset


def test_handlers_skip_bad_shards_and_keep_the_rest(tmp_path: Path, good_shard) -> None:
    data, full = good_shard
    good = _write(tmp_path, "good.tar", data)
    bad = _write(tmp_path, "bad.tar", data[:1000])
    missing = str(tmp_path / "missing.tar")
    sources = [{"url": u} for u in (good, bad, missing, good)]
    with pytest.warns(UserWarning):
        samples = list(wdsraft.tarfile_samples(sources, handler=wdsraft.warn_and_continue))
    # The bad shard's first sample is delivered with the member that was read whole (as webdataset does).
    assert len(samples) == 2 * len(full) + 1
    assert samples[len(full)]["__url__"] == bad and "txt" not in samples[len(full)]
    stopped = list(wdsraft.tarfile_samples(sources, handler=wdsraft.ignore_and_stop))
    assert stopped[: len(full)] == [{**s, "__url__": good} for s in full] and len(stopped) == len(full) + 1
    with pytest.raises(wdsraft.TarFormatError, match=r"bad\.tar"):
        list(wdsraft.tarfile_samples(sources))
    with pytest.raises(FileNotFoundError, match=r"missing\.tar"):
        list(wdsraft.tarfile_samples([{"url": missing}]))


def test_duplicate_extension_goes_to_the_handler(tmp_path: Path) -> None:
    import tarfile
    from io import BytesIO

    url = str(tmp_path / "dup.tar")
    with tarfile.open(url, "w") as archive:
        for name in ("a.txt", "a.txt", "b.txt"):
            info = tarfile.TarInfo(name)
            info.size = 3
            archive.addfile(info, BytesIO(b"abc"))
    with pytest.raises(ValueError, match=r"a\.txt: duplicate file name in tar file txt"):
        list(wdsraft.ShardSampleReader(url))
    samples = list(wdsraft.ShardSampleReader(url, handler=wdsraft.ignore_and_continue))
    assert [s["__key__"] for s in samples] == ["a", "b"]


def test_missing_s3_object_names_the_url(s3_bucket, monkeypatch) -> None:
    monkeypatch.setenv("WDSRAFT_S3_READER", "smart_open")
    url = f"s3://{s3_bucket}/nope/shard.tar"
    with pytest.raises(OSError, match=r"nope/shard\.tar"):
        list(wdsraft.tarfile_samples([{"url": url}]))


def test_truncated_s3_object(s3_bucket, good_shard, monkeypatch) -> None:
    data, full = good_shard
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="cut.tar", Body=data[: full[7]["__offset__"] + 520])
    for reader in ("smart_open", "s5cmd"):
        monkeypatch.setenv("WDSRAFT_S3_READER", reader)
        with pytest.raises(wdsraft.TarFormatError, match="truncated member data") as caught:
            list(wdsraft.ShardSampleReader(f"s3://{s3_bucket}/cut.tar"))
        assert caught.value.offset == full[7]["__offset__"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(["flip", "truncate"]), block=st.sampled_from([512, 8192]))
def test_random_damage_is_reported_or_harmless(tmp_path_factory, good_shard, seed, mode, block) -> None:
    """Any flipped byte or cut: the read completes or raises TarFormatError/ValueError at or before the damage.
    Either way the damage reaches no sample but the one it hit (every other sample delivered is the
    original, and a read that completes delivers all of them), and a flipped bit in a header block
    (checksummed, but for the checksum field itself) is never read past."""
    import tarfile as _tarfile
    from io import BytesIO

    data, full = good_shard
    rng = random.Random(seed)
    where = rng.randrange(len(data))
    damaged = bytearray(data)
    if mode == "flip":
        damaged[where] ^= 1 << rng.randrange(8)
    else:
        del damaged[where:]
    url = _write(tmp_path_factory.mktemp("dmg"), "damaged.tar", bytes(damaged))
    seen = []
    try:
        for sample in wdsraft.ShardSampleReader(url, block_size=block):
            seen.append(sample)
    except wdsraft.TarFormatError as error:
        assert error.url == url and error.offset <= where
        completed = False
    except ValueError as error:  # a corrupt PAX record naming a duplicate member
        assert "duplicate" in str(error)
        completed = False
    else:
        assert len(seen) == len(full) or mode == "flip"
        completed = True
    if mode == "truncate":
        assert [s["__key__"] for s in seen] == [s["__key__"] for s in full[: len(seen)]]

    with _tarfile.open(fileobj=BytesIO(data)) as archive:
        members = archive.getmembers()
    end = members[-1].offset_data + -(-members[-1].size // 512) * 512  # where the end-of-archive blocks start
    starts = [s["__offset__"] for s in full] + [end]
    # The damaged sample's span (a damaged PAX name may split it in two, both starting inside it).
    hit = next(((a, b) for a, b in itertools.pairwise(starts) if a <= where < b), (end, end))

    def undamaged(samples: list[dict]) -> list[dict]:
        kept = [s for s in samples if not hit[0] <= s["__offset__"] < hit[1]]
        return [{k: v for k, v in s.items() if k != "__ordinal__"} for s in kept]  # (ordinals shift after a split)

    assert [s["__ordinal__"] for s in seen] == list(range(len(seen)))
    if completed:
        assert undamaged(seen) == [{**s, "__url__": url} for s in undamaged(full)]
        headers = {m.offset for m in members} | {m.offset_data - 512 for m in members} | {end}
        in_header = [h for h in headers if h <= where < h + 512 and not 148 <= where - h < 156]
        assert not (mode == "flip" and in_header), f"a flipped bit at {where} in a header at {in_header} read past"
    else:
        expected = [{**s, "__url__": url} for s in undamaged(full)]
        assert undamaged(seen) == expected[: len(undamaged(seen))]


# -- hostile headers and streams (found in review) -------------------------------------------------


def _raw_header(name: str, size_field: bytes, typeflag: bytes = b"0") -> bytes:
    """A ustar header with an arbitrary size field and a valid checksum."""
    import tarfile as _tarfile

    block = bytearray(_tarfile.TarInfo(name).tobuf(_tarfile.USTAR_FORMAT))
    block[124:136] = size_field
    block[156:157] = typeflag
    block[148:156] = b" " * 8
    block[148:155] = b"%06o\0" % sum(block)
    return bytes(block)


@pytest.mark.parametrize(
    "size_field",
    [b"\xff" * 10 + b"\xfc\x18", b"\x80" + (2**40).to_bytes(11, "big"), b"\x80" + (2**80 % 2**88).to_bytes(11, "big")],
    ids=["negative", "1TB", "huge"],
)
def test_absurd_sizes_are_format_errors(tmp_path: Path, good_shard, size_field: bytes) -> None:
    data, _ = good_shard
    url = _write(tmp_path, "absurd.tar", _raw_header("x.txt", size_field) + bytes(512) + data)
    for block in (512, 1 << 20):
        with pytest.raises(wdsraft.TarFormatError) as caught:
            list(wdsraft.ShardSampleReader(url, block_size=block))
        assert caught.value.offset == 0


@pytest.mark.parametrize(
    "size_field",
    [b"%011o\0" % 700, b"  %09o\0" % 700, b"%011o " % 700, b"%012o" % 700, b"\x80" + (700).to_bytes(11, "big")],
    ids=["octal-nul", "leading-spaces", "octal-space", "12-digits", "base-256"],
)
def test_every_size_field_layout_reads_as_tarfile_reads_it(tmp_path: Path, size_field: bytes) -> None:
    """The size field is parsed in one place (the common layout inline, the others by ``parse_number``): every
    layout a writer may use gives tarfile's member, whether it lies in the read block or runs past it."""
    import tarfile as _tarfile

    payload = bytes(range(256)) * 2 + b"x" * 188  # 700 bytes
    tail = _tarfile.TarInfo("b.txt")
    tail.size = 3
    body = _raw_header("a.txt", size_field) + payload + bytes(324) + tail.tobuf(_tarfile.USTAR_FORMAT) + b"abc"
    url = _write(tmp_path, "sizes.tar", body + bytes(509) + bytes(1024))
    with _tarfile.open(url) as archive:
        expected = [(m.name, archive.extractfile(m).read()) for m in archive.getmembers()]  # type: ignore[union-attr]
    assert [len(data) for _, data in expected] == [700, 3]
    for block in (1024, 1 << 20):  # (1024: a.txt runs past the block, read on its own)
        with open(url, "rb") as stream:
            members = [(m.name, m.data) for m in TarMemberReader(stream, url, block_size=block)]
        assert members == expected


def test_a_pax_size_record_wins_over_the_members_own_size_field(tmp_path: Path) -> None:
    """tarfile writes a member over 8 GiB with its size in a PAX record and 0 in its own size field: the
    record is the size (here a small member written so, its field set to 0 as tarfile would)."""
    import tarfile as _tarfile
    from io import BytesIO

    stream = BytesIO()
    with _tarfile.open(fileobj=stream, mode="w", format=_tarfile.PAX_FORMAT) as archive:
        info = _tarfile.TarInfo("a.txt")
        info.size = 700
        info.pax_headers = {"size": "700"}
        archive.addfile(info, BytesIO(b"y" * 700))
    archive_bytes = bytearray(stream.getvalue())
    records = int(archive_bytes[124:135], 8)  # the PAX header's data, then the member's own header
    own = 512 + (records + 511) // 512 * 512
    archive_bytes[own + 124 : own + 136] = b"%011o\0" % 0
    archive_bytes[own + 148 : own + 156] = b" " * 8
    archive_bytes[own + 148 : own + 155] = b"%06o\0" % sum(archive_bytes[own : own + 512])
    url = _write(tmp_path, "pax-size.tar", bytes(archive_bytes))
    with _tarfile.open(url) as archive:
        assert [m.size for m in archive.getmembers()] == [700]
    for block in (1024, 1 << 20):
        with open(url, "rb") as source:
            assert [(m.name, m.data) for m in TarMemberReader(source, url, block_size=block)] == [("a.txt", b"y" * 700)]


def test_bad_pax_records_are_format_errors(tmp_path: Path) -> None:
    import tarfile as _tarfile
    from io import BytesIO

    for records, message in (({"size": "abc"}, "PAX size"), ({"GNU.sparse.major": "1"}, "sparse")):
        url = str(tmp_path / "pax.tar")
        with _tarfile.open(url, "w", format=_tarfile.PAX_FORMAT) as archive:
            info = _tarfile.TarInfo("a.txt")
            info.size = 3
            info.pax_headers = records
            archive.addfile(info, BytesIO(b"abc"))
        with pytest.raises(wdsraft.TarFormatError, match=message):
            list(wdsraft.ShardSampleReader(url))


@pytest.mark.parametrize("suffix", ["tar.gz", "tar.bz2", "tar.xz"])
def test_damaged_compressed_shards_are_format_errors(tmp_path: Path, good_shard, suffix: str) -> None:
    _data, _ = good_shard
    source = str(tmp_path / f"source.{suffix}")
    with wdsraft.TarWriter(source) as sink:
        for sample in corpus_samples([{"id": str(n), "text": "t" * 3000} for n in range(30)]):
            sink.write(sample)
    stored = Path(source).read_bytes()
    truncated = _write(tmp_path, f"cut.{suffix}", stored[: len(stored) // 2])
    with pytest.raises(wdsraft.TarFormatError, match=r"cannot read the stream|truncated|end"):
        list(wdsraft.ShardSampleReader(truncated))
    garbled = bytearray(stored)
    garbled[len(garbled) // 2 : len(garbled) // 2 + 64] = bytes(64)
    url = _write(tmp_path, f"garbled.{suffix}", bytes(garbled))
    with pytest.raises(wdsraft.TarFormatError):
        list(wdsraft.ShardSampleReader(url))
    with pytest.raises(wdsraft.TarFormatError, match="before offset"):
        list(wdsraft.ShardSampleReader(source, offset=10**9, ordinal=0))
