"""A damaged tar header is never trusted, whatever the member's size: the reader raises a
TarFormatError naming the shard and the header's offset, and never hands out a sample under a
name it read from a header whose checksum is wrong.

The reader walks members in large read blocks and takes another path for a member larger than
the block (1 MiB by default, ``ShardSampleReader(block_size=...)``), so every check here runs
with members smaller and larger than the block.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

import wdsraft as wds

DEFAULT_BLOCK = 1 << 20  # ShardSampleReader's default block_size

# (block_size given to the reader or None for the default, payload bytes of the member under test)
SIZES = [
    pytest.param(None, 2 * DEFAULT_BLOCK + 123, id="2MiB-member-default-block"),
    pytest.param(None, 3000, id="small-member-default-block"),
    pytest.param(4096, 20_000, id="20KB-member-4KiB-block"),
    pytest.param(4096, 700, id="small-member-4KiB-block"),
]


def _write_shard(path: Path, payload_size: int, position: str) -> tuple[list[dict], int]:
    """A shard with ``bigsample`` (a .bin of ``payload_size`` bytes and a small .txt) first, in the
    middle or last among small samples. Returns the samples as read back and bigsample's offset."""
    rng = os.urandom
    small = [{"__key__": f"small{n:03d}", "txt": f"document {n} " * 20} for n in range(6)]
    big = {"__key__": "bigsample", "bin": rng(payload_size), "txt": "the big one"}
    samples = {"first": [big, *small], "middle": [*small[:3], big, *small[3:]], "last": [*small, big]}[position]
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)
    read = list(wds.ShardSampleReader(str(path)))
    assert [s["__key__"] for s in read] == [s["__key__"] for s in samples]
    (target,) = [s["__offset__"] for s in read if s["__key__"] == "bigsample"]
    return read, target


def _reader(url: str, block: int | None) -> wds.ShardSampleReader:
    return wds.ShardSampleReader(url) if block is None else wds.ShardSampleReader(url, block_size=block)


def _read_until_error(url: str, block: int | None) -> tuple[list[dict], wds.TarFormatError]:
    seen: list[dict] = []
    with pytest.raises(wds.TarFormatError) as caught:
        for sample in _reader(url, block):
            seen.append(sample)
    return seen, caught.value


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize(("block", "size"), SIZES)
def test_a_flipped_bit_in_a_member_name_is_never_delivered(tmp_path: Path, block, size, position) -> None:
    """``bigsample`` with one bit flipped in its header name reads as ``bhgsample``: the header's
    checksum is wrong, so the reader must stop there with an error naming the URL and the offset."""
    url = str(tmp_path / "flipped.tar")
    original, target = _write_shard(Path(url), size, position)
    data = bytearray(Path(url).read_bytes())
    assert data[target : target + 9] == b"bigsample"  # (a plain ustar header: the name at its first byte)
    data[target + 1] ^= 0x01  # "i" -> "h"
    Path(url).write_bytes(bytes(data))

    seen, error = _read_until_error(url, block)
    assert error.url == url and error.offset == target
    assert url in str(error) and f"byte offset {target}" in str(error)
    assert "checksum" in error.reason
    assert all(not s["__key__"].startswith("bh") for s in seen)
    before = [s for s in original if s["__offset__"] < target]
    assert seen == before  # everything before the damage, intact; nothing from or after it


@pytest.mark.parametrize(("block", "size"), SIZES)
def test_a_flipped_bit_in_a_compressed_shard_header_is_never_delivered(tmp_path: Path, block, size) -> None:
    """The same through a stream that cannot seek (a .tar.gz is decompressed on the fly)."""
    plain = tmp_path / "plain.tar"
    original, target = _write_shard(plain, size, "middle")
    data = bytearray(plain.read_bytes())
    data[target + 1] ^= 0x01
    url = str(tmp_path / "flipped.tar.gz")
    Path(url).write_bytes(gzip.compress(bytes(data), mtime=0))

    seen, error = _read_until_error(url, block)
    assert error.url == url and error.offset == target and "checksum" in error.reason
    assert seen == [{**s, "__url__": url} for s in original if s["__offset__"] < target]


@pytest.mark.parametrize("size", [2 * DEFAULT_BLOCK + 123, 3000], ids=["2MiB-member", "small-member"])
def test_a_flipped_bit_in_a_member_name_fails_the_pipelines_too(tmp_path: Path, size) -> None:
    """What users iterate (tarfile_samples, WebDataset; the default block) raises the same error: no
    wrong key reaches them."""
    url = str(tmp_path / "flipped.tar")
    _original, target = _write_shard(Path(url), size, "middle")
    data = bytearray(Path(url).read_bytes())
    data[target + 1] ^= 0x01
    Path(url).write_bytes(bytes(data))
    for samples in (wds.tarfile_samples([{"url": url}]), iter(wds.WebDataset([url], shardshuffle=False))):
        keys = []
        with pytest.raises(wds.TarFormatError) as caught:
            for sample in samples:
                keys.append(sample["__key__"])
        assert caught.value.offset == target and "checksum" in caught.value.reason
        assert "bhgsample" not in keys and "bigsample" not in keys


@pytest.mark.parametrize(("block", "size"), SIZES)
@pytest.mark.parametrize("new_size", [b"77777777777", b"00000000001", b"00000000000"])
def test_a_corrupt_size_field_is_a_checksum_error(tmp_path: Path, block, size, new_size) -> None:
    """A size field damaged in place must be caught by the checksum before the size is trusted -- not by
    whatever error the wrong size happens to cause later (a truncation at the same offset, say)."""
    url = str(tmp_path / "size.tar")
    _original, target = _write_shard(Path(url), size, "middle")
    data = bytearray(Path(url).read_bytes())
    header = target  # bigsample's first member: the .bin
    assert bytes(data[header + 124 : header + 135]) != new_size
    data[header + 124 : header + 135] = new_size
    Path(url).write_bytes(bytes(data))
    _seen, error = _read_until_error(url, block)
    assert error.offset == header and error.url == url
    assert "checksum" in error.reason, error.reason
