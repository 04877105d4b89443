"""Evaluation passes: every sample exactly once across ranks x workers, split by samples from the shard
indexes' counts (shards that do not divide by the ranks), one seek per range, unindexed shards refused
or counted, and the pass checkpointable."""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

import wdsraft as wds
from wdsraft.pipeline.evalsplit import EvalSplit, split_range
from wdsraft.testing import assert_resumes_everywhere

SIZES = [7, 7, 7, 7, 7, 3]  # 38 samples in 6 shards: neither divides by 3 ranks x 2 workers
EVERY = [f"{n:05d}" for n in range(sum(SIZES))]


@pytest.fixture(scope="module")
def urls(write_shards) -> list[str]:
    return write_shards("ev", [{"txt": f"s{n}"} for n in range(sum(SIZES))], 7)


def _keys_of_rank(urls, rank: int, monkeypatch, workers: int = 2, **kw) -> list[str]:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "3")
    dataset = wds.EvalDataset(urls, **kw).to_tuple("__key__").batched(4)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers)
    return [key for batch in loader for key in batch[0]]


def test_three_ranks_by_two_workers_read_every_sample_once(urls, monkeypatch) -> None:
    ranks = [_keys_of_rank(urls, rank, monkeypatch) for rank in range(3)]
    assert Counter(key for keys in ranks for key in keys) == Counter(EVERY)
    assert sorted(len(keys) for keys in ranks) == [12, 13, 13]  # by samples, not by shards (2, 2, 2)


@given(total=st.integers(0, 200), ranks=st.integers(1, 9), workers=st.integers(1, 5))
def test_the_ranges_partition_the_samples(total, ranks, workers) -> None:
    split = EvalSplit.__new__(EvalSplit)
    split.counts = [total]
    seen = [n for r in range(ranks) for w in range(workers) for n in range(*split.samples_of(r, ranks, w, workers))]
    assert seen == list(range(total))
    sizes = [high - low for low, high in (split_range(total, r, ranks) for r in range(ranks))]
    assert max(sizes) - min(sizes) <= 1


def test_a_range_starts_inside_a_shard_by_one_seek(urls, monkeypatch) -> None:
    """The entry leaves the offset to the reader, which has the index at hand: it opens the shard there."""
    split = EvalSplit(urls)
    entries = list(split._entries(*split.samples_of(1, 3, 1, 2)))  # rank 1, worker 1: samples 18..24
    assert entries == [{"url": urls[2], "offset": None, "ordinal": 4, "end": 7, "nsamples": 7},
                       {"url": urls[3], "offset": 0, "ordinal": 0, "end": 4, "nsamples": 7}]  # fmt: skip
    for name, value in {"RANK": "1", "WORLD_SIZE": "3", "WORKER": "1", "NUM_WORKERS": "2"}.items():
        monkeypatch.setenv(name, value)
    samples = list(wds.EvalDataset(urls))
    assert [sample["__key__"] for sample in samples] == EVERY[18:25]
    assert samples[0]["__offset__"] == wds.ShardIndex.beside(urls[2]).offset_of(4)


def test_unindexed_shards_are_refused_or_counted(urls, tmp_path, monkeypatch, caplog) -> None:
    bare = []
    for url in urls:
        copy = tmp_path / os.path.basename(url)
        copy.write_bytes(open(url, "rb").read())  # noqa: SIM115 (the shard without its index)
        bare.append(str(copy))
    with pytest.raises(wds.IndexFormatError, match=r"ev-00\.tar\.idx.*wdsraft index"):
        wds.EvalDataset(bare)
    with caplog.at_level(logging.INFO, logger="wdsraft.pipeline.evalsplit"):
        ranks = [_keys_of_rank(bare, rank, monkeypatch, count_unindexed=True) for rank in range(3)]
    assert Counter(key for keys in ranks for key in keys) == Counter(EVERY)
    assert "no index: reading it whole to count its samples" in caplog.text


def test_batch_count_is_the_ranks_number_of_batches(urls, monkeypatch) -> None:
    """The length EvenEnds takes to agree on the step count once per epoch."""
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        dataset = wds.EvalDataset(urls)
        loader = wds.WebLoader(dataset.batched(4), batch_size=None, num_workers=2)
        assert len(list(loader)) == dataset.batch_count(4, num_workers=2), rank


def test_an_eval_pass_resumes_at_every_step(urls, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")  # samples 12..24: from inside a shard to inside another
    monkeypatch.setenv("WORLD_SIZE", "3")
    stream = assert_resumes_everywhere(lambda: wds.EvalDataset(urls).to_tuple("__key__"))
    assert [key for (key,) in stream] == EVERY[12:25]


def test_each_pass_reads_each_index_once(urls, monkeypatch) -> None:
    """The split reads every index once when built (the counts). A pass then reads the index of each shard
    in its range once: the reader's checks, and the seek into the first (no second read for it)."""
    reads: list[str] = []
    real = wds.ShardIndex.beside.__func__

    def counted(cls, url):
        reads.append(url)
        return real(cls, url)

    monkeypatch.setattr(wds.ShardIndex, "beside", classmethod(counted))
    monkeypatch.setenv("RANK", "1")  # samples 12..24: from inside shard 1 to inside shard 3
    monkeypatch.setenv("WORLD_SIZE", "3")
    dataset = wds.EvalDataset(urls).to_tuple("__key__")
    assert sorted(reads) == sorted(urls)
    passes = []
    for _ in range(3):
        del reads[:]
        assert [key for (key,) in dataset] == EVERY[12:25]
        passes.append(sorted(reads))
    assert passes == [urls[1:4]] * 3


def test_the_counts_are_read_in_parallel(urls, monkeypatch) -> None:
    """Building the split reads the indexes several at once (one GET each on S3): the first four reads wait
    for each other at a barrier, which reads one after another would never pass; the counts keep their order."""
    barrier = threading.Barrier(4, timeout=20)
    real = wds.ShardIndex.beside.__func__
    lock, waited = threading.Lock(), []

    def meeting(cls, url):
        with lock:
            waits = len(waited) < 4
            waited.append(url)
        if waits:
            barrier.wait()
        return real(cls, url)

    monkeypatch.setattr(wds.ShardIndex, "beside", classmethod(meeting))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert EvalSplit(urls).counts == SIZES
