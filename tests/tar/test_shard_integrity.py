"""A shard read beside its index is checked against it: a torn copy (zero-filled tail), a truncated
file, a sample not where the index puts it, or (with verify=True) a changed byte raises a
ShardIntegrityError naming shard, byte offset and ordinal, and no partial or altered sample goes
out before it. Indexes carry a CRC-32 per sample from every writer; older indexes still load."""

from __future__ import annotations

import tarfile
import zlib
from pathlib import Path

import msgpack
import pytest

import wdsraft as wds
from wdsraft.core.errors import ShardIntegrityError
from wdsraft.index.shard_index import ShardIndex


def _shard(path: Path, count: int = 12) -> tuple[str, list[dict], ShardIndex]:
    url = str(path)
    with wds.TarWriter(url) as sink:
        for n in range(count):
            sink.write({"__key__": f"s{n:03d}", "txt": f"text {n} " * (n * 40 + 1), "json": b'{"n": %d}' % n})
    samples = list(wds.ShardSampleReader(url))
    return url, samples, ShardIndex.load(url)


def _read(url: str, **kw) -> tuple[list[dict], BaseException | None]:
    seen: list[dict] = []
    try:
        for sample in wds.ShardSampleReader(url, **kw):
            seen.append(sample)
    except Exception as exn:  # (the caller asserts which)
        return seen, exn
    return seen, None


def _damage(url: str, edit) -> None:
    data = bytearray(Path(url).read_bytes())
    edit(data)
    Path(url).write_bytes(bytes(data))


def test_every_writer_records_the_crc32_of_each_sample_span(tmp_path: Path) -> None:
    url, _, index = _shard(tmp_path / "a.tar")
    data = Path(url).read_bytes()
    spans = [zlib.crc32(data[index.offsets[i] : index.offsets[i + 1]]) for i in range(index.num_samples)]
    assert index.crc32 is not None and list(index.crc32) == spans
    assert list(wds.build_index(url).crc32) == spans  # type: ignore[arg-type]
    assert ShardIndex.from_bytes(index.to_bytes()) == index


def test_an_index_written_before_digests_still_loads_and_reads(tmp_path: Path) -> None:
    url, samples, index = _shard(tmp_path / "old.tar")
    record = msgpack.unpackb(index.to_bytes())
    del record["crc32"]  # what wdsraft wrote before digests
    Path(url + ".idx").write_bytes(msgpack.packb(record, use_bin_type=True))
    old = ShardIndex.load(url)
    assert old.crc32 is None and list(old.offsets) == list(index.offsets)
    assert [s["__key__"] for s in wds.ShardSampleReader(url)] == [s["__key__"] for s in samples]
    with pytest.raises(wds.IndexFormatError, match="predates them"):
        list(wds.ShardSampleReader(url, verify=True))


@pytest.mark.parametrize("at", ["boundary", "inside"])
def test_a_zero_filled_tail_is_an_error_not_fewer_samples(tmp_path: Path, at: str) -> None:
    url, samples, index = _shard(tmp_path / "torn.tar")
    tear = index.offsets[7] + (0 if at == "boundary" else 700)
    _damage(url, lambda data: data.__setitem__(slice(tear, None), bytes(len(data) - tear)))
    seen, error = _read(url)
    assert isinstance(error, ShardIntegrityError), error
    assert url in str(error) and index.offsets[7] <= error.offset < index.offsets[8] and error.ordinal == 7
    # Whole samples only: sample 7 (cut short when torn inside it) never goes out; nor does sample 6 when the
    # archive ends right after it, as its payload may hold the first zeros of the tear. Its CRC can clear it.
    assert seen == samples[: 7 if at == "inside" else 6]
    verified, error = _read(url, verify=True)
    assert isinstance(error, ShardIntegrityError) and verified == samples[:7]


def test_a_truncated_local_file_is_an_error_before_any_sample(tmp_path: Path) -> None:
    url, _, index = _shard(tmp_path / "short.tar")
    _damage(url, lambda data: data.__delitem__(slice(index.offsets[9], None)))
    seen, error = _read(url)
    assert isinstance(error, ShardIntegrityError) and "its index says" in str(error)
    assert seen == []


def test_a_truncated_s3_shard_delivers_whole_samples_then_names_the_place(tmp_path: Path, s3_bucket) -> None:
    import boto3

    url, samples, index = _shard(tmp_path / "s3.tar")
    cut = index.offsets[5] + 1000
    client = boto3.client("s3")
    client.put_object(Bucket=s3_bucket, Key="s3.tar", Body=Path(url).read_bytes()[:cut])
    client.put_object(Bucket=s3_bucket, Key="s3.tar.idx", Body=Path(url + ".idx").read_bytes())
    seen, error = _read(f"s3://{s3_bucket}/s3.tar")
    assert isinstance(error, wds.TarFormatError) and f"s3://{s3_bucket}/s3.tar" in str(error)
    assert seen == [dict(s, __url__=f"s3://{s3_bucket}/s3.tar") for s in samples[:5]]


def _rename_member(data: bytearray, offset: int, old: bytes, new: bytes) -> None:
    """Rename the member whose header is at ``offset``, with a correct checksum (a rewritten shard)."""
    header = data[offset : offset + 512]
    assert header.startswith(old)
    header[: len(new)] = new
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % sum(header)
    data[offset : offset + 512] = header


def test_a_sample_not_where_the_index_puts_it_is_not_handed_out(tmp_path: Path) -> None:
    url, samples, index = _shard(tmp_path / "moved.tar")
    # Sample 4's second member (.txt, after .json) now names another key: sample 4 looks whole but is
    # not, and a sample starts where the index has none.
    second = index.offsets[4] + 512 + 512  # header, 12 bytes of json padded to 512
    _damage(url, lambda data: _rename_member(data, second, b"s004.txt", b"x004.txt"))
    seen, error = _read(url)
    assert isinstance(error, ShardIntegrityError) and error.offset == second and error.ordinal == 5
    assert seen == samples[:4]
    unchecked, _ = _read(url, index=None)  # without the index, the partial sample goes out (as webdataset)
    assert unchecked[4]["__key__"] == "s004" and "txt" not in unchecked[4]


def test_verify_catches_a_changed_byte_and_hands_out_nothing_altered(tmp_path: Path) -> None:
    url, samples, index = _shard(tmp_path / "flip.tar")
    where = index.offsets[6] + 512 + 3  # inside sample 6's first member's data
    _damage(url, lambda data: data.__setitem__(where, data[where] ^ 0x01))
    unchecked, error = _read(url)
    assert error is None and len(unchecked) == len(samples)  # the free checks cannot see data bytes
    seen, error = _read(url, verify=True)
    assert isinstance(error, ShardIntegrityError) and "CRC-32" in str(error)
    assert error.ordinal == 6 and error.offset == index.offsets[6] and url in str(error)
    assert seen == samples[:6]


def test_a_rename_that_splits_a_sample_holds_both_parts_until_the_span_checks(tmp_path: Path) -> None:
    url, _, index = _shard(tmp_path / "split.tar")
    where = index.offsets[3] + 512 + 512 + 512 + 5  # sample 3's .txt data (after its .json member)
    _damage(url, lambda data: data.__setitem__(where, data[where] ^ 0x40))

    def split(name: str) -> str:
        return name.replace("s003.json", "z003.json")  # sample 3 becomes two samples: z003, s003

    seen, error = _read(url, verify=True, rename_files=split)
    assert isinstance(error, ShardIntegrityError) and error.ordinal == 3
    assert [s["__key__"] for s in seen] == ["s000", "s001", "s002"]  # not z003, though it came first
    whole, error = _read(str(tmp_path / "split.tar"), rename_files=split)
    assert error is None and [s["__key__"] for s in whole][3:5] == ["z003", "s003"]


def test_resumes_and_seeks_inside_a_checked_shard(tmp_path: Path) -> None:
    url, samples, index = _shard(tmp_path / "seek.tar")
    for ordinal in (0, 5, 11, 12):
        tail = list(wds.ShardSampleReader(url, offset=index.offsets[ordinal], ordinal=ordinal, verify=True))
        assert tail == samples[ordinal:]
    # An offset without its ordinal takes it from the index; an offset that starts no sample is refused.
    (sample,) = list(wds.tarfile_samples([{"url": url, "offset": index.offsets[11]}]))
    assert sample["__ordinal__"] == 11
    with pytest.raises(ShardIntegrityError, match="no sample of the index starts"):
        list(wds.ShardSampleReader(url, offset=index.offsets[3] + 512, ordinal=None))
    with pytest.raises(ShardIntegrityError, match="index puts sample 2"):
        list(wds.ShardSampleReader(url, offset=index.offsets[3], ordinal=2))


def test_more_samples_than_the_index_is_an_error(tmp_path: Path) -> None:
    url, samples, _ = _shard(tmp_path / "longer.tar")
    short, _, _ = _shard(tmp_path / "shorter.tar", count=8)
    Path(url + ".idx").write_bytes(Path(short + ".idx").read_bytes())  # a stale index from another shard
    seen, error = _read(url)
    assert isinstance(error, ShardIntegrityError)
    assert "bytes, its index says" in str(error) and seen == []  # (the size differs first)
    with open(url, "rb") as stream:  # a stream handed in has no size check: the count check speaks
        seen, error = _read(url, stream=stream, index=ShardIndex.load(short))
    assert isinstance(error, ShardIntegrityError) and "beyond the index's 8 samples" in str(error)
    assert error.ordinal == 8 and seen == samples[:7]  # (sample 7 ends where sample 8 starts: unlisted)


def test_errors_keep_their_fields_across_processes() -> None:
    import pickle

    error = ShardIntegrityError("s3://b/x.tar", 1024, "what differs", 7)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.url, copy.offset, copy.reason, copy.ordinal, str(copy)) == (
        "s3://b/x.tar",
        1024,
        "what differs",
        7,
        str(error),
    )
    assert isinstance(copy, wds.TarFormatError) and isinstance(copy, tarfile.ReadError)


def test_build_index_refuses_a_torn_zero_tail_unless_told(tmp_path: Path) -> None:
    url, _, index = _shard(tmp_path / "torn.tar", count=40)
    tear = index.offsets[10]
    _damage(url, lambda data: data.__setitem__(slice(tear, None), bytes(len(data) - tear)))
    with pytest.raises(ShardIntegrityError, match="torn copy") as caught:
        wds.build_index(url)
    assert caught.value.offset == tear and url in str(caught.value)
    assert wds.build_index(url, strict=False).num_samples == 10
