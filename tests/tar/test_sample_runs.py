"""Runs of whole samples (``wdsraft.tar.runs``) against the member-by-member walk, which is the oracle:
over shards with odd members among plain ones, damaged copies, small and large read buffers, starts at
any sample and streams handed in, a reader taking runs hands out the same samples, the same positions
after each one, and the same error at the same point, as a reader that walks every member."""

from __future__ import annotations

import contextlib
import gzip
import io
import random
import tarfile
from array import array
from pathlib import Path
from typing import Any

import pytest
import webdataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardutil import without_positions

import wdsraft as wds
from wdsraft.core.fields import OFFSET_FIELD
from wdsraft.index.shard_index import ShardIndex
from wdsraft.tar import reader as reader_module
from wdsraft.tar import runs as runs_module
from wdsraft.tar.indexer import build_index

#: Odd members a shard may hold among the plain ones, each handled by the general walk's own rules;
#: the "stale" ones are read against the index of a twin shard that differs there (a key, a size).
ODD = [
    "upper", "dup", "dir", "dotdir", "meta", "dotmeta", "long", "unicode", "control", "noext", "hidden",
    "emptyext", "samekey", "three", "stalekey", "stalesize", "stalemeta",
]  # fmt: skip


def _members(number: int, odd: str | None, size: int, twin: bool = False) -> list[tuple[str, bytes]]:
    key = f"s{number:05d}"
    text, meta = bytes([97 + number % 26]) * size, b'{"n": %d}' % number
    plain = [(f"{key}.txt", text), (f"{key}.json", meta)]
    if odd == "stalekey":  # the previous sample's key here, its own in the twin the index comes from
        other = f"{'t' if twin else 's'}{number - 1:05d}"
        return [(f"{other}.bin", text), (f"{other}.cls", meta)]
    if odd == "stalemeta":  # a meta file alone, a sample of its own in the twin (its name not a meta file's there)
        return [("t_info.x__" if twin else "__info.x__", meta)]
    if odd == "stalesize":
        return [(f"{key}.txt", text + bytes(700) if twin else text), (f"{key}.json", meta)]
    return {
        None: plain,
        "upper": [(f"{key}.TXT", text), (f"{key}.Json", meta)],
        "dup": [(f"{key}.txt", text), (f"{key}.TXT", meta)],
        "dir": [(f"d/{key}.txt", text), (f"d/{key}.json", meta)],
        "dotdir": [(f"v1.0/{key}.txt", text), (f"v1.0/{key}.json", meta)],
        "meta": [("__meta__", b"m"), *plain],
        "dotmeta": [("__info.x__", b"m"), *plain],
        "control": [(f"{key}.t\x01xt", text), (f"{key}\x01.json", meta)],
        "long": [(f"{key}{'x' * 120}.txt", text), (f"{key}{'x' * 120}.json", meta)],
        "unicode": [(f"{key}é.txt", text), (f"{key}é.json", meta)],
        "noext": [(key, text), (f"{key}.json", meta)],
        "hidden": [(f".{key}.txt", text), (f"{key}.json", meta)],
        "emptyext": [(f"{key}.", text), (f"{key}.json", meta)],
        "samekey": [(f"s{number - 1:05d}.bin", text)],  # the previous sample's key again
        "three": [*plain, (f"{key}.seg.cls", b"%d" % number)],
    }[odd]


def _write(path: Path, shapes: list[tuple[str | None, int]], twin: bool = False, gnu: bool = False) -> None:
    """The shard (PAX format: extended headers for long and non-ASCII names; GNU: long-name headers, and
    non-ASCII names as UTF-8 bytes in the header itself)."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT if gnu else tarfile.PAX_FORMAT) as tar:
        for number, (odd, size) in enumerate(shapes):
            for name, data in _members(number, odd, size, twin):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))


def _index(path: Path) -> ShardIndex:
    """The shard's index as the general walk sees its samples, members it refuses skipped (a duplicate
    extension: the readers under test meet it with the default handler and raise)."""
    offsets = array("Q")
    with open(path, "rb") as stream:
        reader = wds.ShardSampleReader(str(path), stream=stream, handler=lambda exn: True)
        offsets.extend(sample[OFFSET_FIELD] for sample in reader)
        offsets.append(reader.next_offset)
    return ShardIndex(path.name, offsets, path.stat().st_size, None, None)


def _events(url: str, start: int | None, via: str, block: int, index: ShardIndex, opener: Any = open) -> list[Any]:
    """What a reader hands out, and its positions after each sample, then how it ends."""
    events: list[Any] = []
    with contextlib.ExitStack() as stack:
        kw: dict[str, Any] = {"index": index}
        if via == "stream":  # not a plain local file: buffers are bytes objects, not the reused window
            kw["stream"] = stack.enter_context(opener(url, "rb"))
            if start:
                kw["stream"].seek(start)
        reader = wds.ShardSampleReader(url, offset=start or 0, ordinal=None, block_size=block, **kw)
        try:
            for sample in reader:
                events.append((sample, reader.next_offset, reader.next_ordinal))
        except Exception as exn:
            events.append(("error", type(exn).__name__, str(exn)))
        events.append(("end", reader.exhausted, reader.next_offset, reader.next_ordinal))
    return events


@pytest.fixture
def eager_runs(monkeypatch):
    """Runs from two samples on, never given up: the fast path takes whatever it can."""
    monkeypatch.setattr(runs_module, "MIN_RUN", 2)
    monkeypatch.setattr(runs_module, "MAX_MISSES", 10**9)


def _without_runs(monkeypatch) -> None:
    monkeypatch.setattr(reader_module.ShardSampleReader, "_runs", lambda self, index, digester: None)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shapes=st.lists(
        st.tuples(
            st.sampled_from([None] * 7 * len(ODD) + ODD),  # (odd members now and then, plain runs between)
            st.sampled_from([0, 1, 100, 511, 512, 513, 1500, 5000]),
        ),
        min_size=3,
        max_size=60,
    ),
    damage=st.sampled_from(["none", "none", "flip", "truncate"]),
    where=st.integers(0, 10**9),
    start=st.integers(0, 10**9),
    via=st.sampled_from(["path", "stream"]),
    block=st.sampled_from([1024, 4096, 20000, 1 << 20]),
    gnu=st.booleans(),
)
def test_runs_hand_out_what_the_member_walk_does(
    eager_runs, monkeypatch, tmp_path: Path, shapes, damage: str, where: int, start: int, via: str, block: int, gnu
):
    shapes[0] = (None, shapes[0][1])  # ("samekey" needs a sample before it)
    path, twin = tmp_path / "shard.tar", tmp_path / "twin.tar"
    _write(path, shapes, gnu=gnu)
    _write(twin, shapes, twin=True, gnu=gnu)
    index = _index(twin)  # (the shard's own index, but where a stale odd member says otherwise)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[where % index.offsets[-1]] ^= 1 << (where % 8)
    elif damage == "truncate":
        del raw[where % len(raw) :]
    path.write_bytes(raw)
    begin = index.offsets[start % index.num_samples] if start % 3 else 0
    with_runs = _events(str(path), begin, via, block, index)
    with monkeypatch.context() as patch:
        _without_runs(patch)
        walked = _events(str(path), begin, via, block, index)
    assert with_runs == walked


def test_a_converted_shard_is_read_in_runs(tmp_path: Path, monkeypatch):
    """With the default settings, a shard of small samples goes out almost wholly in runs (the shard's
    last sample and a partial run at its end go the general way), equal to webdataset's reading."""
    path = tmp_path / "plain.tar"
    _write(path, [(None, 50 + (n * 37) % 900) for n in range(400)])
    build_index(str(path)).save(str(path))
    taken: list[int] = []
    take = runs_module.SampleRuns.take

    def counting(self, *args):
        samples, until = take(self, *args)
        taken.append(len(samples) if samples is not None else 0)
        return samples, until

    monkeypatch.setattr(runs_module.SampleRuns, "take", counting)
    ours = list(wds.WebDataset([str(path)], shardshuffle=False))
    assert sum(taken) >= 360
    theirs = list(webdataset.WebDataset([str(path)], shardshuffle=False))
    assert without_positions(ours) == theirs
    with monkeypatch.context() as patch:
        _without_runs(patch)
        assert list(wds.WebDataset([str(path)], shardshuffle=False)) == ours


@pytest.mark.parametrize("block", [4096, 1 << 20])
def test_runs_give_way_where_every_sample_is_odd(tmp_path: Path, monkeypatch, block: int):
    """Names in directories (every sample the general way): after a few runs tried, however many buffers
    the shard takes, the reader stops trying."""
    path = tmp_path / "dirs.tar"
    _write(path, [("dir", 100)] * 3000)
    build_index(str(path)).save(str(path))
    tried = []
    run = runs_module.SampleRuns._run
    monkeypatch.setattr(runs_module.SampleRuns, "_run", lambda self, *a: tried.append(1) or run(self, *a))
    samples = list(wds.ShardSampleReader(str(path), block_size=block))
    assert len(samples) == 3000 and samples[7]["__key__"] == "d/s00007"
    assert len(tried) <= runs_module.MAX_MISSES


def test_one_odd_sample_ends_a_run_not_the_runs(tmp_path: Path, monkeypatch):
    """A long name (an extension header) every 300 samples: the samples around it still go out in runs."""
    path = tmp_path / "sparse.tar"
    _write(path, [("long" if n % 300 == 150 else None, 100) for n in range(3000)])
    build_index(str(path)).save(str(path))
    taken: list[int] = []
    take = runs_module.SampleRuns.take

    def counting(self, *args):
        samples, until = take(self, *args)
        taken.append(len(samples) if samples is not None else 0)
        return samples, until

    monkeypatch.setattr(runs_module.SampleRuns, "take", counting)
    ours = list(wds.ShardSampleReader(str(path)))
    assert sum(taken) >= 2700
    with monkeypatch.context() as patch:
        _without_runs(patch)
        assert list(wds.ShardSampleReader(str(path))) == ours


@pytest.mark.parametrize("via", ["path", "stream"])
@pytest.mark.parametrize("odd", ODD)
def test_each_odd_member_among_plain_ones(eager_runs, monkeypatch, tmp_path: Path, odd: str, via: str):
    """Every kind of odd member once among plain samples, all in one buffer: the runs around it hand out
    what the general walk does (a run over it would give a sample short of a member, a wrong key, or start
    a sample where the general walk goes on with the last one)."""
    path, twin = tmp_path / "shard.tar", tmp_path / "twin.tar"
    shapes = [(None, 100)] * 10 + [(odd, 100)] + [(None, 100)] * 10
    for gnu in (False, True):
        _write(path, shapes, gnu=gnu)
        _write(twin, shapes, twin=True, gnu=gnu)
        index = _index(twin)
        with_runs = _events(str(path), 0, via, 1 << 20, index)
        with monkeypatch.context() as patch:
            _without_runs(patch)
            assert with_runs == _events(str(path), 0, via, 1 << 20, index)


def test_a_run_does_not_start_with_the_key_of_the_sample_before(tmp_path: Path):
    """Where the index starts a sample whose key is the last one's, a run does not start there (the
    general walk would go on with the last sample: the index is not this shard's)."""
    path = tmp_path / "shard.tar"
    _write(path, [(None, 100)] * 80)
    index = _index(path)
    runs = runs_module.SampleRuns(str(path), index.offsets)
    runs.ordinal, runs.key = 9, "s00010"  # (the key of the sample at the run's start)
    raw = path.read_bytes()
    assert runs.take(raw, index.offsets[10], len(raw), 0)[0] is None
    runs.key = "s00009"
    samples, _ = runs.take(raw, index.offsets[10], len(raw), 0)
    assert samples is not None and samples[0]["__key__"] == "s00010"


@pytest.mark.parametrize("block", [1 << 16, 1 << 20])
@pytest.mark.parametrize("where", [700_000, 1_000_000, 1_400_000])
def test_a_damaged_compressed_shard_ends_alike(monkeypatch, tmp_path: Path, block: int, where: int):
    """A gzip shard with a byte changed (payloads that do not compress: the stream fails near the damage):
    the samples before the stream error, their positions and the error, offset included, are the general
    walk's (a run's reads happen where the general walk's would)."""
    plain, path = tmp_path / "plain.tar", tmp_path / "shard.tar.gz"
    with tarfile.open(plain, "w", format=tarfile.PAX_FORMAT) as tar:
        for n in range(3000):
            payload = random.Random(n).randbytes(50 + n * 37 % 900)
            for name, data in ((f"s{n:05d}.txt", payload), (f"s{n:05d}.json", b'{"n":%d}' % n)):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))
    index = _index(plain)
    raw = bytearray(gzip.compress(plain.read_bytes(), mtime=0))
    raw[where] ^= 0x55
    path.write_bytes(raw)
    with_runs = _events(str(path), 0, "stream", block, index, gzip.open)
    with monkeypatch.context() as patch:
        _without_runs(patch)
        walked = _events(str(path), 0, "stream", block, index, gzip.open)
    assert with_runs == walked
