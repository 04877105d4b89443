"""Eval passes from a manifest: the split's counts in one read per rank instead of one per shard, each
count checked against the shard's index where the reader reads it anyway (a stale manifest is refused,
naming the shard), and the index reads of building and passing counted, locally and as GETs on S3."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import wdsraft as wds
from wdsraft.core.distributed import worker_info
from wdsraft.index.manifest import MANIFEST_NAME, manifest_for
from wdsraft.pipeline.evalsplit import EvalSplit
from wdsraft.pipeline.source import TarfileToSamples
from wdsraft.pipeline.stage import Context

SIZES = [7, 7, 7, 7, 7, 3]  # 38 samples in 6 shards, as in test_eval_split
EVERY = [f"{n:05d}" for n in range(sum(SIZES))]
RANKS, WORKERS = 3, 2
# The shards each (rank, worker) range touches, ranges [0,6) [6,12) [12,18) [18,25) [25,31) [31,38):
# 1 + 2 + 2 + 2 + 2 + 2 index reads in a pass of all of them.
PASS_READS = 11


@pytest.fixture
def dataset_dir(write_shards, tmp_path) -> Path:
    """The shards, their indexes and their manifest (relative URLs), in a directory of this test's own."""
    urls = write_shards("evm", [{"txt": f"s{n}"} for n in range(sum(SIZES))], 7)
    for url in urls:
        for path in (url, url + ".idx"):
            shutil.copy(path, tmp_path / os.path.basename(path))
    copies = [str(tmp_path / os.path.basename(url)) for url in urls]
    manifest_for(str(tmp_path), [(url, wds.ShardIndex.beside(url)) for url in copies]).save(
        str(tmp_path / MANIFEST_NAME)
    )
    return tmp_path


class IndexReads:
    """Counts reads of shard indexes (``ShardIndex.beside``) and manifests (``Manifest.load``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.indexes = self.manifests = 0
        real_beside, real_load = wds.ShardIndex.beside.__func__, wds.Manifest.load.__func__

        def beside(cls: type, url: str) -> Any:
            self.indexes += 1
            return real_beside(cls, url)

        def load(cls: type, url: str) -> Any:
            self.manifests += 1
            return real_load(cls, url)

        monkeypatch.setattr(wds.ShardIndex, "beside", classmethod(beside))
        monkeypatch.setattr(wds.Manifest, "load", classmethod(load))

    def take(self) -> Counter:
        """The index and manifest reads since the last take."""
        taken = Counter(indexes=self.indexes, manifests=self.manifests)
        self.indexes = self.manifests = 0
        return taken


def _every_part(monkeypatch, source: Any, reads: IndexReads) -> tuple[dict, Counter, Counter]:
    """The keys each (rank, worker) reads, and the reads of building the ranks' datasets and of one pass
    of each part (each rank builds its own dataset with its rank set, as a job's processes do)."""
    keys, built, passed = {}, Counter(), Counter()
    for rank in range(RANKS):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(RANKS))
        reads.take()
        dataset = wds.EvalDataset(source).to_tuple("__key__")
        built.update(reads.take())
        for worker in range(WORKERS):
            monkeypatch.setenv("WORKER", str(worker))
            monkeypatch.setenv("NUM_WORKERS", str(WORKERS))
            keys[rank, worker] = [key for (key,) in dataset]
        passed.update(reads.take())
    return keys, built, passed


def test_a_manifest_gives_the_split_in_one_read_per_rank(dataset_dir, monkeypatch) -> None:
    """Built from the manifest, a rank reads it once and no index; built from the shard URLs, each rank
    reads every shard's index to count. Either way a pass reads the indexes of its range's shards once
    each (the reader's checks, the count's check and the seek in one read), and the same samples."""
    reads = IndexReads(monkeypatch)
    urls = sorted(str(path) for path in dataset_dir.glob("*.tar"))
    for source, building in ((str(dataset_dir / MANIFEST_NAME), (0, 1)), (urls, (len(urls), 0))):
        indexes, manifests = building  # (each rank's reads to build)
        keys, built, passed = _every_part(monkeypatch, source, reads)
        assert Counter(key for part in keys.values() for key in part) == Counter(EVERY)
        assert [len(keys[rank, 0]) + len(keys[rank, 1]) for rank in range(RANKS)] == [12, 13, 13]
        assert built == Counter(indexes=RANKS * indexes, manifests=RANKS * manifests), source
        assert passed == Counter(indexes=PASS_READS), source


def test_a_stale_manifest_is_refused_naming_the_shard(dataset_dir, monkeypatch) -> None:
    """A manifest written before shard 2 was rewritten with one sample fewer: the split would shift every
    range after it. The reader opening shard 2 compares the count with the index it reads anyway."""
    manifest = dataset_dir / MANIFEST_NAME
    record = json.loads(manifest.read_text())
    record["shardlist"][2]["nsamples"] = 8  # (as if shard 2 had 8 samples when the manifest was written)
    manifest.write_text(json.dumps(record))
    monkeypatch.setenv("RANK", "1")  # samples 12..25 by the manifest: shards 1, 2 and 3
    monkeypatch.setenv("WORLD_SIZE", str(RANKS))
    dataset = wds.EvalDataset(str(manifest), handler=wds.warn_and_continue)  # (no handler skips it)
    with pytest.raises(wds.IndexFormatError, match=r"evm-02\.tar\.idx: the split counted 8 samples .* index has 7"):
        list(dataset)
    monkeypatch.setenv("RANK", "0")  # samples 0..12: shards 0 and 1 only, both as counted
    assert [sample["__key__"] for sample in wds.EvalDataset(str(manifest))] == EVERY[:13]


def test_a_shard_counted_empty_is_still_checked(dataset_dir, monkeypatch) -> None:
    """A manifest's 0 puts the shard in no range: the range at its place still opens its index to check."""
    manifest = dataset_dir / MANIFEST_NAME
    record = json.loads(manifest.read_text())
    record["shardlist"][5]["nsamples"] = 0  # (the last shard: its place is the end of the last range)
    manifest.write_text(json.dumps(record))
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", str(RANKS))
    with pytest.raises(wds.IndexFormatError, match=r"evm-05\.tar\.idx: the split counted 0 samples .* index has 3"):
        list(wds.EvalDataset(str(manifest)))


def test_a_shard_whose_index_went_away_is_refused(dataset_dir, monkeypatch) -> None:
    """Without its index the reader could not check the manifest's count: the shard is refused, not read."""
    os.remove(dataset_dir / "evm-03.tar.idx")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", str(RANKS))
    with pytest.raises(wds.IndexFormatError, match=r"evm-03\.tar\.idx: the split counted .* no readable index"):
        list(wds.EvalDataset(dataset_dir / MANIFEST_NAME))  # (a path, as well as a string)
    with pytest.raises(ValueError, match="count_unindexed has nothing to count"):
        wds.EvalDataset(str(dataset_dir / MANIFEST_NAME), count_unindexed=True)


def test_counts_taken_at_build_are_checked_in_each_pass(dataset_dir, monkeypatch) -> None:
    """Without a manifest the counts come from the indexes when the dataset is built: a shard rewritten
    (and indexed) between then and a pass is refused there, as a stale manifest is."""
    urls = sorted(str(path) for path in dataset_dir.glob("*.tar"))
    monkeypatch.setenv("RANK", "2")  # samples 25..38: shards 3, 4, 5
    monkeypatch.setenv("WORLD_SIZE", str(RANKS))
    dataset = wds.EvalDataset(urls)
    with wds.ShardWriter(str(dataset_dir / "new-%02d.tar"), maxcount=100, verbose=0) as sink:
        for number in range(5):
            sink.write({"__key__": f"x{number}", "txt": "x"})
    for suffix in ("", ".idx"):
        os.replace(dataset_dir / f"new-00.tar{suffix}", dataset_dir / f"evm-04.tar{suffix}")
    with pytest.raises(wds.IndexFormatError, match=r"evm-04\.tar\.idx: the split counted 7 samples .* index has 5"):
        list(dataset)


def test_index_gets_on_s3_with_and_without_a_manifest(dataset_dir, s3_bucket, monkeypatch) -> None:
    """The same reads as GETs sent to a real S3 endpoint (moto): 3 ranks build from the manifest with one
    GET each and no index GET; from the shard URLs, with one GET per shard each. A pass of all parts
    then GETs each index once per part whose range touches its shard, and nothing else of the indexes."""
    import boto3
    import botocore.client

    client = boto3.client("s3")
    for path in dataset_dir.iterdir():
        client.put_object(Bucket=s3_bucket, Key=f"ds/{path.name}", Body=path.read_bytes())
    gets: Counter = Counter()
    real_call = botocore.client.BaseClient._make_api_call

    def call(client: Any, operation: str, params: dict[str, Any]) -> Any:
        if operation in ("GetObject", "HeadObject"):
            gets[os.path.splitext(params["Key"])[1]] += 1  # .json, .idx, .tar
        return real_call(client, operation, params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", call)
    urls = [f"s3://{s3_bucket}/ds/evm-{n:02d}.tar" for n in range(len(SIZES))]
    reads = IndexReads(monkeypatch)
    for source, building in ((f"s3://{s3_bucket}/ds/{MANIFEST_NAME}", (0, 1)), (urls, (len(urls), 0))):
        gets.clear()
        keys, built, passed = _every_part(monkeypatch, source, reads)
        assert Counter(key for part in keys.values() for key in part) == Counter(EVERY)
        assert (gets[".idx"], gets[".json"]) == (RANKS * building[0] + PASS_READS, RANKS * building[1]), source
        assert gets[".idx"] == built["indexes"] + passed["indexes"]  # (one GET per read: no retries, no HEADs)


@pytest.mark.parametrize("active", [1, 2, 3])
def test_split_entries_mean_the_same_to_a_source_reading_several_shards_at_once(dataset_dir, active: int) -> None:
    """An eval split's entries (a seek by the index, a count to check) read by ``TarfileToSamples`` one shard at
    a time or several at once (``n_active_shards``): the same samples, and a stale count refused either way."""
    split = EvalSplit(str(dataset_dir / MANIFEST_NAME))
    entries = list(split._entries(10, 30))
    assert entries[0]["offset"] is None and entries[0]["ordinal"] == 3  # (the range starts inside shard 1)
    stage = TarfileToSamples(n_active_shards=active, handler=wds.warn_and_continue)
    keys = [sample["__key__"] for sample in stage.run(Context(0, worker_info()), iter(entries), None)]
    assert sorted(keys) == EVERY[10:30]
    stale = [dict(entry, nsamples=entry["nsamples"] + 1) for entry in entries]
    stage = TarfileToSamples(n_active_shards=active, handler=wds.warn_and_continue)
    with pytest.raises(wds.IndexFormatError, match=r"evm-01\.tar\.idx: the split counted 8 samples"):
        list(stage.run(Context(0, worker_info()), iter(stale), None))


def test_a_manifest_of_shards_where_no_index_is_looked_up_is_refused_up_front(dataset_dir) -> None:
    """Shards served over HTTP (or a ``pipe:``) have no index the reader looks up, so a manifest's counts could
    not be checked: refused when the dataset is built, saying what to do, not shard by shard later."""
    manifest = dataset_dir / MANIFEST_NAME
    record = json.loads(manifest.read_text())
    record["shardlist"][3]["url"] = "http://127.0.0.1:9/evm-03.tar"
    manifest.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"http://127\.0\.0\.1:9/evm-03\.tar is neither local nor on S3"):
        wds.EvalDataset(str(manifest))
