"""The source stage and integrity: a saved state names the shard's identity (from its index) and a
restore onto a rewritten shard of the same name refuses; verify= reaches the source, WebDataset,
the ledger's runs of unconsumed samples and the re-reads that restore buffers."""

from __future__ import annotations

from pathlib import Path

import pytest

import wdsraft as wds
from wdsraft.core.errors import ShardIntegrityError


def _write(directory: Path, letter: str, count: int = 30) -> list[str]:
    pattern = str(directory / "part-%02d.tar")
    with wds.ShardWriter(pattern, maxcount=10, verbose=0) as sink:
        for n in range(count):
            sink.write({"__key__": f"{n:04d}", "txt": letter * (50 + n)})
    return sorted(str(p) for p in directory.glob("part-*.tar"))


def _pipeline(urls: list[str], **kw) -> wds.DataPipeline:
    return wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(**kw))


def test_a_state_does_not_resume_on_a_rewritten_shard_of_the_same_name(tmp_path: Path) -> None:
    urls = _write(tmp_path, "a")
    pipeline = _pipeline(urls)
    stream = iter(pipeline)
    for _ in range(14):  # into the second shard
        next(stream)
    state = pipeline.state_dict()
    _write(tmp_path, "b")  # same names, same sizes and offsets, other bytes (a re-converted dataset)
    resumed = _pipeline(urls)
    resumed.load_state_dict(state)
    with pytest.raises(wds.StateMismatchError, match=r"part-01\.tar.*rewritten"):
        next(iter(resumed))


def test_a_state_resumes_on_the_same_shards(tmp_path: Path) -> None:
    urls = _write(tmp_path, "a")
    pipeline = _pipeline(urls)
    stream = iter(pipeline)
    head = [next(stream)["__key__"] for _ in range(14)]
    resumed = _pipeline(urls)
    resumed.load_state_dict(pipeline.state_dict())
    assert head + [s["__key__"] for s in resumed] == [f"{n:04d}" for n in range(30)]


def test_verify_reaches_the_source_and_webdataset(tmp_path: Path) -> None:
    urls = _write(tmp_path, "a")
    index = wds.ShardIndex.load(urls[1])
    where = index.offsets[4] + 512 + 10
    data = bytearray(Path(urls[1]).read_bytes())
    data[where] ^= 0x20
    Path(urls[1]).write_bytes(bytes(data))
    assert len(list(_pipeline(urls))) == 30  # unchecked bytes: delivered as they are
    with pytest.raises(ShardIntegrityError, match="sample 4") as caught:
        list(_pipeline(urls, verify=True))
    assert caught.value.url == urls[1] and caught.value.offset == index.offsets[4]
    dataset = wds.WebDataset(urls, shardshuffle=False, verify=True)
    seen = []
    with pytest.raises(ShardIntegrityError):
        for sample in dataset:
            seen.append(sample["__key__"])
    assert seen == [f"{n:04d}" for n in range(14)]


def test_verify_checks_the_re_reads_that_restore_a_shuffle_buffer(tmp_path: Path) -> None:
    urls = _write(tmp_path, "a")

    def make(verify: bool) -> wds.DataPipeline:
        return wds.DataPipeline(
            wds.SimpleShardList(urls), wds.tarfile_to_samples(verify=verify), wds.shuffle(50, seed=1)
        )

    pipeline = make(True)
    stream = iter(pipeline)
    for _ in range(3):
        next(stream)
    state = pipeline.state_dict()  # the buffer holds positions of samples of all three shards
    index = wds.ShardIndex.load(urls[0])
    data = bytearray(Path(urls[0]).read_bytes())
    data[index.offsets[2] + 512 + 1] ^= 0x01
    Path(urls[0]).write_bytes(bytes(data))
    restored = make(True)
    restored.load_state_dict(state)
    with pytest.raises(ShardIntegrityError, match="sample 2"):
        list(restored)
    unchecked = make(False)
    unchecked.load_state_dict(state)
    assert len(list(unchecked)) == 27  # (the buffer's re-read has no digest check without verify)


class _Consumed:
    """A ledger's consumed set, reduced to what the source asks of it (the SkipSet protocol)."""

    def __init__(self, url: str, ordinals: set[int]):
        self.url, self.ordinals = url, ordinals

    def skipped_in(self, url: str):
        return self.ordinals if url == self.url else None

    def marks_in(self, url: str):
        return None


@pytest.mark.parametrize("damage", ["flip", "tear"])
def test_the_runs_of_an_elastic_resume_are_checked_too(tmp_path: Path, damage: str) -> None:
    (url,) = _write(tmp_path, "a", count=10)
    index = wds.ShardIndex.load(url)
    originals = {s["__ordinal__"]: s for s in wds.ShardSampleReader(url)}
    data = bytearray(Path(url).read_bytes())
    if damage == "flip":
        data[index.offsets[8] + 512 + 7] ^= 0x08
    else:
        data[index.offsets[8] :] = bytes(len(data) - index.offsets[8])
    Path(url).write_bytes(bytes(data))
    pipeline = _pipeline([url], verify=damage == "flip")
    pipeline.skip_consumed(_Consumed(url, {0, 1, 2, 5, 6}), epoch=0)
    seen = []
    with pytest.raises(ShardIntegrityError) as caught:
        for sample in pipeline:
            seen.append(sample)
    assert caught.value.url == url and caught.value.ordinal == 8
    # Runs [3, 5) and [7, 10) are read from the index's offsets; what goes out is whole and unaltered
    # (a tear right after sample 7 holds it back: its payload may hold the tear's first zeros).
    assert [s["__ordinal__"] for s in seen] == ([3, 4, 7] if damage == "flip" else [3, 4])
    assert all(s == originals[s["__ordinal__"]] for s in seen)
