"""What a restart without torch.distributed reads of the dataset: each rank checks its share of the skip set's
shard identities (one index read per shard per restart, not per rank), and a replaced shard is still refused
(by the rank that checks it at resume, by any other rank that reads it at its first commit)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

import wdsraft as wds
from wdsraft.core.errors import StateMismatchError
from wdsraft.ledger import identity

WORLD = 4


def _ledger_of_shards(path: str, shards: list[str]) -> dict:
    """One run of one rank that consumed 2 samples of each shard, each shard's identity recorded."""
    ledger = wds.Ledger(path, run="one", rank=0, world_size=1)
    ledger._identities.checked.update({url: None for url in shards})  # (no dataset: nothing read here)
    ledger._to_record.update({url: {"sha256": f"{n:064x}", "samples": 10, "size": 100} for n, url in enumerate(shards)})
    ledger.record({"__url__": [u for u in shards for _ in (0, 1)], "__ordinal__": [0, 1] * len(shards)}, epoch=0)
    return ledger.commit(step=1)


def test_each_rank_checks_its_share_of_the_skip_sets_shards(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "l")
    shards = [f"s3://bucket/ds/shard-{n:04d}.tar" for n in range(40)]
    mark = _ledger_of_shards(path, shards)
    reads: Counter = Counter()
    same = {url: {"sha256": f"{n:064x}", "samples": 10, "size": 100} for n, url in enumerate(shards)}

    def read_index(url: str):
        reads[url] += 1
        return same[url]

    monkeypatch.setattr(identity, "identity_of", read_index)
    per_rank = []
    for rank in range(WORLD):
        ledger = wds.Ledger(path, run="two", rank=rank, world_size=WORLD)
        before = sum(reads.values())
        consumed = ledger._skip_set(0, mark["lineage"], mark["steps"])
        assert consumed.count() == 2 * len(shards)
        per_rank.append(sum(reads.values()) - before)
    assert sorted(reads) == sorted(shards) and set(reads.values()) == {1}  # each shard once per restart
    assert all(0 < n < len(shards) for n in per_rank) and sum(per_rank) == len(shards)

    # One shard replaced: the rank whose share it is refuses at resume; another that reads it, at its commit.
    replaced = shards[7]
    same[replaced] = dict(same[replaced], sha256="f" * 64)
    reads.clear()
    refused = []
    for rank in range(WORLD):
        ledger = wds.Ledger(path, run=f"three-{rank}", rank=rank, world_size=WORLD)
        try:
            ledger._skip_set(0, mark["lineage"], mark["steps"])
        except StateMismatchError as exn:
            assert f"{replaced}: not the shard the ledger" in str(exn)
            refused.append(rank)
            continue
        ledger.record({"__url__": [replaced], "__ordinal__": [5]}, epoch=0)
        with pytest.raises(StateMismatchError, match=re.escape(f"{replaced}: not the shard the ledger")):
            ledger.commit(step=2)
    assert len(refused) == 1


def test_one_rank_checks_every_shard(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "l")
    shards = [f"s3://bucket/ds/shard-{n:04d}.tar" for n in range(10)]
    mark = _ledger_of_shards(path, shards)
    reads: list[str] = []
    monkeypatch.setattr(identity, "identity_of", lambda url: reads.append(url))
    wds.Ledger(path, run="two", rank=0, world_size=1)._skip_set(0, mark["lineage"], mark["steps"])
    assert sorted(reads) == shards
