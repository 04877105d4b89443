"""What resuming costs, counted rather than timed: bytes read (``rchar`` of /proc/self/io, every
read of this process) and files opened (the interpreter's ``open`` audit event).

- Starting inside a local shard at a byte offset seeks: the bytes read do not grow with the offset.
- An elastic resume skips consumed samples through the shard index: shards a ledger says were
  consumed whole are not opened, and a partly consumed shard is read from its first unconsumed sample.

Counting runs in this process only: DataLoader workers would be other processes, so loaders here
have ``num_workers=0``.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

import wdsraft as wds
from wdsraft.testing import assert_resumes_everywhere

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # webdataset's advice warnings
    pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io"),
]

KB, MB = 1 << 10, 1 << 20
SAMPLE = 512 * KB  # payload of every sample below (smaller than the reader's 1 MiB block)
BLOCK = 1 * MB  # the reader's default block: what it may read ahead of the sample it needs


def _rchar() -> int:
    with open("/proc/self/io") as stats:
        for line in stats:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


class _OpenedFiles:
    """Paths opened while ``recording`` (audit hooks cannot be removed: one hook, switched on and off)."""

    def __init__(self) -> None:
        self.recording = False
        self.paths: list[str] = []

    def __call__(self, event: str, args: tuple) -> None:
        if self.recording and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            self.paths.append(os.fsdecode(args[0]))

    def __enter__(self) -> list[str]:
        self.paths = []
        self.recording = True
        return self.paths

    def __exit__(self, *exc: object) -> None:
        self.recording = False


_OPENED = _OpenedFiles()
_HOOKED: list[bool] = []


@pytest.fixture(scope="session")
def opened_files() -> _OpenedFiles:
    if not _HOOKED:
        sys.addaudithook(_OPENED)
        _HOOKED.append(True)
    return _OPENED


def _write_shard(path: Path, count: int, first: int = 0, size: int = SAMPLE) -> str:
    with wds.TarWriter(str(path)) as sink:  # (writes the index beside it)
        for number in range(first, first + count):
            sink.write({"__key__": f"{number:06d}", "bin": bytes([number % 251]) * size, "cls": number})
    return str(path)


# -- seeking into a shard --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deep_shard(tmp_path_factory) -> str:
    """One 48 MB shard of 96 samples of 512 KB."""
    return _write_shard(tmp_path_factory.mktemp("deep") / "deep.tar", 96)


def _bytes_read_to_first_sample(open_at) -> tuple[int, dict]:
    before = _rchar()
    sample = open_at()
    return _rchar() - before, sample


@pytest.mark.parametrize("how", ["ShardSampleReader", "tarfile_samples", "open_shard"])
def test_starting_at_an_offset_reads_the_same_whatever_the_offset(deep_shard, how) -> None:
    """The first sample at ordinal 1 or 95 costs the same bytes: far below the 47 MB before the deep one."""
    index = wds.ShardIndex.load(deep_shard)

    def first_at(ordinal: int):
        offset = index.offset_of(ordinal)
        if how == "ShardSampleReader":
            return lambda: next(iter(wds.ShardSampleReader(deep_shard, offset=offset, ordinal=ordinal)))
        if how == "tarfile_samples":
            return lambda: next(iter(wds.tarfile_samples([{"url": deep_shard, "offset": offset, "ordinal": ordinal}])))

        def header():
            with wds.open_shard(deep_shard, offset) as stream:
                return {"header": stream.read(512), "__ordinal__": ordinal}

        return header

    reads = {}
    for ordinal in (1, 30, 60, 95):
        reads[ordinal], sample = _bytes_read_to_first_sample(first_at(ordinal))
        if how == "open_shard":
            assert sample["header"][:6] == f"{ordinal:06d}".encode()  # positioned at that sample's header
        else:
            assert sample["__ordinal__"] == ordinal and sample["__key__"] == f"{ordinal:06d}"
            assert sample["bin"] == bytes([ordinal % 251]) * SAMPLE
    deep_offset = index.offset_of(95)
    assert deep_offset > 45 * MB
    limit = 64 * KB if how == "open_shard" else SAMPLE + BLOCK + 64 * KB
    assert all(read <= limit for read in reads.values()), (reads, limit, deep_offset)
    assert reads[95] <= reads[1] + 64 * KB, reads


def test_an_exact_resume_deep_in_a_shard_reads_what_a_shallow_one_does(deep_shard) -> None:
    """A WebDataset state saved 1 or 95 samples into the shard restores by seeking there."""

    def make():
        return wds.WebDataset([deep_shard], shardshuffle=False)

    reads = {}
    for depth in (1, 95):
        pipeline = make()
        iterator = iter(pipeline)
        for _ in range(depth):
            next(iterator)
        state = pipeline.state_dict()
        del iterator
        restored = make()
        restored.load_state_dict(state)
        reads[depth], sample = _bytes_read_to_first_sample(lambda restored=restored: next(iter(restored)))
        assert sample["__key__"] == f"{depth:06d}"
    assert reads[95] <= reads[1] + 64 * KB and reads[95] <= SAMPLE + BLOCK + 64 * KB, reads


# -- elastic resume through the index --------------------------------------------------------------

WHOLE, PART_CONSUMED = 10, 12  # shards consumed whole; samples consumed of the 16 in the partly consumed shard


@pytest.fixture(scope="module")
def ledger_shards(tmp_path_factory) -> list[str]:
    """10 shards of 4 samples (2 MB each), one of 16 (8 MB) and one of 4: 30 MB of 512 KB samples."""
    directory = tmp_path_factory.mktemp("elastic-cost")
    urls = [_write_shard(directory / f"whole-{n:03d}.tar", 4, first=4 * n) for n in range(WHOLE)]
    urls.append(_write_shard(directory / "part-010.tar", 16, first=100))
    urls.append(_write_shard(directory / "rest-011.tar", 4, first=200))
    return urls


def _pairs(batch) -> list[tuple[str, int]]:
    return list(zip(batch["__url__"], [int(o) for o in batch["__ordinal__"]], strict=True))


def test_an_elastic_resume_opens_no_consumed_shard_and_reads_nothing_consumed(
    tmp_path: Path, ledger_shards, opened_files
) -> None:
    """A first run consumes 10 shards whole and 12 of the 16 samples of the next (about 26 MB); an
    elastic resume (another batch size) must not open the 10 shards, must read the partly consumed one
    from its 13th sample on, and must deliver exactly what the first run did not."""
    path = str(tmp_path / "ledger")

    def loader(batch: int):
        return wds.WebLoader(wds.WebDataset(ledger_shards, shardshuffle=False).batched(batch), batch_size=None)

    first, run = wds.Ledger(path, run="first", rank=0, world_size=1), loader(4)
    delivered: Counter = Counter()
    steps = (4 * WHOLE + PART_CONSUMED) // 4
    for step, batch in enumerate(first.track(run), 1):
        delivered.update(_pairs(batch))
        if step == steps:
            saved = first.checkpoint(run, step)
            break
    consumed_whole, part, rest = ledger_shards[:WHOLE], ledger_shards[WHOLE], ledger_shards[WHOLE + 1]
    assert {url for url, _ in delivered} == {*consumed_whole, part}

    second, again = wds.Ledger(path, run="second", rank=0, world_size=1), loader(5)
    with opened_files as opened:
        before = _rchar()
        assert second.resume(again, saved) == "elastic"
        batches = iter(second.track(again))
        head = next(batches)
        to_first_batch = _rchar() - before
        rest_of_epoch = [head, *batches]
        whole_resume = _rchar() - before
    tars = [p for p in opened if p.endswith(".tar")]
    assert not set(tars) & set(consumed_whole), sorted(set(tars) & set(consumed_whole))
    assert sorted(set(tars)) == sorted({part, rest})

    # Bytes: what reading just the unconsumed samples costs (the reader's look-ahead included), no more.
    assert _pairs(head) == [(part, o) for o in range(PART_CONSUMED, 16)] + [(rest, 0)]
    unconsumed = [{"url": part, "offset": wds.ShardIndex.load(part).offset_of(PART_CONSUMED)}, {"url": rest}]
    before = _rchar()
    samples = iter(wds.tarfile_samples(unconsumed))
    # (a batch of 5 goes out when the 6th sample arrives, as webdataset's batched pulls)
    first_five, sixth = [next(samples) for _ in range(5)], next(samples)
    just_the_head = _rchar() - before
    remaining = list(samples)
    just_the_rest = _rchar() - before
    assert [s["__key__"] for s in first_five] == [f"{100 + o:06d}" for o in range(PART_CONSUMED, 16)] + ["000200"]
    assert len([sixth, *remaining]) == 3
    assert to_first_batch <= just_the_head + 64 * KB, (to_first_batch, just_the_head)
    assert whole_resume <= just_the_rest + 64 * KB, (whole_resume, just_the_rest)
    assert just_the_rest < (16 - PART_CONSUMED + 4) * SAMPLE + 2 * (BLOCK + SAMPLE)  # (sanity: a bounded look-ahead)

    for batch in rest_of_epoch:
        delivered.update(_pairs(batch))
    every = {(url, ordinal) for url in ledger_shards for ordinal in range(16 if url == part else 4)}
    assert set(delivered) == every and max(delivered.values()) == 1


def _shuffled_loader(url: str, batch: int) -> wds.WebLoader:
    return wds.WebLoader(wds.WebDataset([url], shardshuffle=False).shuffle(10, seed=1).batched(batch), batch_size=None)


def _shuffled_first_run(url: str, path: str, steps: int) -> tuple[dict, set[int]]:
    """A first run over one shard, shuffled, checkpointed after ``steps`` batches of 4: (the checkpoint, the
    ordinals it consumed, scattered by the shuffle)."""
    first, run = wds.Ledger(path, run="first", rank=0, world_size=1), _shuffled_loader(url, 4)
    delivered: Counter = Counter()
    for step, batch in enumerate(first.track(run), 1):
        delivered.update(_pairs(batch))
        if step == steps:
            return first.checkpoint(run, step), {ordinal for _, ordinal in delivered}
    raise AssertionError("the first run ended early")


def test_an_elastic_resume_opens_a_compressed_shard_once_however_scattered_its_consumed_samples(
    tmp_path: Path, opened_files
) -> None:
    """A gzip shard cannot seek: reading each run of unconsumed samples from its own offset would decompress
    the shard from its start once per run. After a shuffled first run (consumed samples scattered), the
    elastic resume opens it once and delivers exactly what the first run did not."""
    import gzip

    plain = _write_shard(tmp_path / "plain.tar", 40)
    url = str(tmp_path / "shard.tar")
    Path(url).write_bytes(gzip.compress(Path(plain).read_bytes()))
    wds.build_index(url).save(url)
    path = str(tmp_path / "ledger")
    saved, consumed = _shuffled_first_run(url, path, steps=3)
    assert len(consumed) == 12 and consumed != set(range(12))  # scattered by the shuffle
    second, again = wds.Ledger(path, run="second", rank=0, world_size=1), _shuffled_loader(url, 5)
    with opened_files as opened:
        assert second.resume(again, saved) == "elastic"
        rest = [pair for batch in second.track(again) for pair in _pairs(batch)]
    assert sorted(o for _, o in rest) == sorted(set(range(40)) - consumed)
    assert [p for p in opened if p == url] == [url]  # one open, not one per run of unconsumed samples


def test_an_elastic_resume_reads_through_small_holes_instead_of_opening_a_reader_per_run(
    tmp_path: Path, opened_files
) -> None:
    """A shuffled first run leaves the samples its buffer held as holes among the consumed ones. Reopening the
    shard for each run of unconsumed samples cost an opening (a GET on S3) per hole; small consumed stretches
    between runs are read through instead: one opening, exactly the unconsumed samples, and a state taken
    part-way through the elastic run resumes exactly."""
    url = _write_shard(tmp_path / "small.tar", 40, size=2 * KB)
    path = str(tmp_path / "ledger")
    saved, consumed = _shuffled_first_run(url, path, steps=4)
    holes = sum(1 for o in range(1, 40) if o in consumed and o - 1 not in consumed)
    assert holes > 3  # (scattered by the shuffle: several runs of unconsumed samples)
    second, again = wds.Ledger(path, run="second", rank=0, world_size=1), _shuffled_loader(url, 5)
    with opened_files as opened:
        assert second.resume(again, saved) == "elastic"
        rest = [pair for batch in second.track(again) for pair in _pairs(batch)]
    assert sorted(o for _, o in rest) == sorted(set(range(40)) - consumed)
    assert [p for p in opened if p == url] == [url]

    def resumed_elastically():
        ledger, dataset = wds.Ledger(path, run=f"exact-{len(opened)}", rank=0, world_size=1), _shuffled_loader(url, 5)
        ledger.resume(dataset, saved)
        return dataset

    assert_resumes_everywhere(resumed_elastically, same_shape=False)
