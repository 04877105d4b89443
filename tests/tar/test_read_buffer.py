"""Local shards are read into a reusable buffer (an anonymous private mmap) refilled in place: readers open
at once each have their own, a finished reader's goes to the next one, and a forked process never shares one."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shardutil import corpus_samples

import wdsraft
from wdsraft.tar import members
from wdsraft.tar.members import TarMemberReader


@pytest.fixture
def shards(tmp_path: Path, corpus_records) -> list[str]:
    urls = []
    for number in range(2):
        url = str(tmp_path / f"shard-{number}.tar")
        with wdsraft.TarWriter(url) as sink:
            for sample in corpus_samples(corpus_records[number * 30 :], 30):
                sink.write(sample)
        urls.append(url)
    return urls


def _tarfile_members(url: str) -> list[tuple[str, bytes]]:
    with tarfile.open(url) as archive:
        return [(m.name, archive.extractfile(m).read()) for m in archive.getmembers()]  # type: ignore[union-attr]


def test_readers_open_at_once_read_their_own_shards(shards: list[str]) -> None:
    """Two readers of local shards, in turn batch by batch in one thread (as n_active_shards does), with a
    small block (many refills): each gives its shard's members, as tarfile reads them."""
    with open(shards[0], "rb") as first, open(shards[1], "rb") as second:
        streams: list[Iterator[list[Any]] | None] = [
            TarMemberReader(f, url, block_size=4096).batches() for f, url in zip((first, second), shards, strict=True)
        ]
        got: list[list[tuple[str, bytes]]] = [[], []]
        while streams[0] is not None or streams[1] is not None:
            for which, stream in enumerate(streams):
                if stream is None:
                    continue
                batch = next(stream, None)
                if batch is None:
                    streams[which] = None
                else:
                    got[which] += [(m.name, m.data) for m in batch]
    assert got == [_tarfile_members(url) for url in shards] and all(len(g) == 60 for g in got)


def test_a_finished_readers_buffer_serves_the_next_reader(shards: list[str]) -> None:
    """No fresh pages per shard: the buffer a reader filled goes to the next reader of the same block size."""
    taken: list[object] = []
    original = members._take_window

    def spy(size: int):  # type: ignore[no-untyped-def]
        window = original(size)
        taken.append(window)
        return window

    members._take_window = spy  # type: ignore[assignment]
    try:
        for url in shards * 2:
            assert [(s["__key__"]) for s in wdsraft.ShardSampleReader(url, block_size=8192)]
    finally:
        members._take_window = original  # type: ignore[assignment]
    assert len(taken) == 4 and all(window is taken[0] for window in taken)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_buffer_is_never_shared_with_a_forked_process() -> None:
    """A spare buffer inherited by a forked worker is the worker's own copy: its reads do not reach the
    parent's buffer (a shared mapping would hand the parent the worker's bytes)."""
    window = members._take_window(4096)
    window[:5] = b"madam"
    child = os.fork()
    if child == 0:  # the worker: writes its copy, then leaves at once
        window[:5] = b"child"
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and window[:5] == b"madam"
    members._give_back(window)


class _FailingFile(io.BufferedReader):
    """A local file whose reads fail once ``budget`` bytes were read (a disk error part-way)."""

    budget = 20000

    def readinto(self, buffer):  # type: ignore[no-untyped-def,override]
        if self.tell() >= self.budget:
            raise OSError(5, "Input/output error")
        with memoryview(buffer) as view:
            return super().readinto(view[: self.budget - self.tell()])


class _FailingStream(io.BytesIO):
    """The same failure in a stream that is no local file (read in new bytes objects)."""

    def read(self, size: int | None = -1) -> bytes:
        if self.tell() >= _FailingFile.budget:
            raise OSError(5, "Input/output error")
        return super().read(min(_FailingFile.budget - self.tell(), size if size is not None and size >= 0 else 1 << 30))


def test_a_read_error_part_way_ends_the_shard_as_on_any_stream(shards: list[str]) -> None:
    """The members before the failure come out, then a format error naming the shard and the offset reached:
    the same from the reused buffer as from a stream read in new bytes objects."""
    url = shards[0]
    outcomes = []
    for stream in (_FailingFile(io.FileIO(url)), _FailingStream(Path(url).read_bytes())):
        reader = TarMemberReader(stream, url, block_size=8192)
        got = []
        with pytest.raises(wdsraft.TarFormatError) as caught:
            for member in reader:
                got.append((member.name, member.data))
        outcomes.append((got, caught.value.offset, str(caught.value)))
    assert outcomes[0] == outcomes[1]
    got, offset, message = outcomes[0]
    assert got == _tarfile_members(url)[: len(got)] and len(got) > 0 and 0 < offset <= _FailingFile.budget
    assert url in message and "Input/output error" in message
