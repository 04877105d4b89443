"""Damaged copies of an indexed shard, read with and without verify=: a run either raises an error
naming the shard and a byte offset, or hands out exactly the samples written; what it hands out
before an error is always whole; with verify=True no altered sample ever goes out and none is lost
silently. Without verify, damage that begins inside a payload (a changed byte, or a tear whose zeros
start there and run to the end of the last sample) is the one thing that can pass, as the free checks
look at sample boundaries, not at payload bytes: then only that sample differs, in payload only."""

from __future__ import annotations

import contextlib
import shutil
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wdsraft as wds
from wdsraft.index.shard_index import ShardIndex


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> tuple[Path, list[dict], ShardIndex, list[tuple[int, int]]]:
    """An indexed shard written by TarWriter, its samples, its index and the data span of each member."""
    path = tmp_path_factory.mktemp("fuzz") / "orig.tar"
    with wds.TarWriter(str(path)) as sink:
        for n in range(8):
            sink.write({"__key__": f"k{n}", "txt": b"t" * (n * 300 + 5), "bin": bytes(range(256)) * (n % 3 + 1)})
    with tarfile.open(path) as tar:
        data_spans = [(member.offset_data, member.offset_data + member.size) for member in tar.getmembers()]
    return path, list(wds.ShardSampleReader(str(path))), ShardIndex.load(str(path)), data_spans


def _damage(data: bytearray, kind: str, where: int, bit: int) -> None:
    if kind == "truncate":
        del data[where:]
    elif kind == "zero-tail":
        data[where:] = bytes(len(data) - where)
    else:
        data[where] ^= 1 << bit


def _read(url: str, verify: bool, via: str, index: ShardIndex, block: int) -> tuple[list[dict], Exception | None]:
    seen: list[dict] = []
    with contextlib.ExitStack() as stack:
        kw = {}
        if via == "stream":  # a stream handed in: no size check, so the reader meets the damage itself
            kw = {"stream": stack.enter_context(open(url, "rb")), "index": index}
        try:
            for sample in wds.ShardSampleReader(url, verify=verify, block_size=block, **kw):
                seen.append(sample)
        except Exception as exn:  # (asserted by the caller: it must name the shard and an offset)
            return seen, exn
    return seen, None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["truncate", "zero-tail", "flip-header", "flip-data", "flip-anywhere"]),
    choice=st.integers(0, 10**9),
    bit=st.integers(0, 7),
    via=st.sampled_from(["path", "stream"]),
    block=st.sampled_from([1024, 1 << 20]),
)
def test_damage_is_named_or_harmless(original, tmp_path: Path, kind: str, choice: int, bit: int, via: str, block: int):
    path, samples, index, data_spans = original
    raw = bytearray(path.read_bytes())
    headers = [start - 512 for start, _ in data_spans]
    if kind == "flip-header":
        where = headers[choice % len(headers)] + (choice // len(headers)) % 512
    elif kind == "flip-data":
        start, end = data_spans[choice % len(data_spans)]
        where = start + (choice // len(data_spans)) % (end - start)
    else:
        where = choice % len(raw)
    before = bytes(raw)
    _damage(raw, kind, where, bit)
    end = index.offsets[-1]
    spans_changed = raw[:end] != before[:end]  # (a tear in the last padding, already zeros, changes nothing)
    url = str(tmp_path / f"damaged-{choice}.tar")
    Path(url).write_bytes(bytes(raw))
    shutil.copyfile(str(path) + ".idx", url + ".idx")
    # Damage that starts in a payload (a flipped byte, or a tear whose zeros begin there) can pass the
    # free checks in that one sample; only its CRC (verify=True) shows it.
    # (A tear's zeros may begin over bytes that were zeros already, a header's unused fields: the damage
    # then starts where the first byte changed.)
    first_change = next((i for i in range(where, len(raw)) if raw[i] != before[i]), where)
    in_data = kind != "truncate" and any(start <= first_change < end for start, end in data_spans)
    expected = [dict(sample, __url__=url) for sample in samples]

    for verify in (False, True):
        seen, error = _read(url, verify, via, index, block)
        if error is not None:
            assert url in str(error) and "byte offset" in str(error), error
            offset = getattr(error, "offset", None)
            assert offset is None or 0 <= offset <= len(before), error  # (a place in the shard as written)
        else:
            assert len(seen) == index.num_samples  # nothing lost silently
        if verify or not in_data:
            assert seen == expected[: len(seen)]  # whole and unaltered, in order
        else:  # an unverified payload byte: that one sample may differ, in payload only
            assert [s["__key__"] for s in seen] == [s["__key__"] for s in expected[: len(seen)]]
            assert sum(s != e for s, e in zip(seen, expected, strict=False)) <= 1
        if verify and spans_changed:
            assert error is not None  # a changed byte inside the samples' spans never passes verify
