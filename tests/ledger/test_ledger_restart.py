"""What a restart without torch.distributed reads of the dataset: each rank checks its share of the skip set's
shard identities (one index read per shard per restart, not per rank), and a replaced shard is still refused
(by the rank that checks it at resume, by any other rank that reads it at its first commit)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
from shardutil import commit_run

import wdsraft as wds
from wdsraft.cli import main
from wdsraft.core.errors import StateMismatchError
from wdsraft.ledger import RankFile, identity, merged
from wdsraft.ledger.rank_file import committed_in, summarize
from wdsraft.ledger.snapshot import late_commits

WORLD = 4


def _ledger_of_shards(path: str, shards: list[str]) -> dict:
    """One run of one rank that consumed 2 samples of each shard, each shard's identity recorded."""
    ledger = wds.Ledger(path, run="one", rank=0, world_size=1)
    # (no dataset: the identities are given, nothing is read)
    ledger.adopt_identities(
        shards, {url: {"sha256": f"{n:064x}", "samples": 10, "size": 100} for n, url in enumerate(shards)}
    )
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


# -- ledger show (merge, export) from the snapshot written last ------------------------------------

RANKS = 3


def _run(path: str, run: str, mark: dict | None, steps: tuple[int, ...] = (1, 2)) -> dict:
    """A run of RANKS ranks resuming from ``mark``, each rank committing 2 samples of its shard per step."""
    return commit_run(path, run, mark, steps, RANKS)[0]


def _show(capsys, path: str, *extra: str) -> tuple[int, list[str]]:
    code = main(["ledger", "show", path, *extra])
    return code, [line for line in capsys.readouterr().out.splitlines() if not line.startswith("read: ")]


def test_show_reads_the_latest_snapshot_and_only_the_files_it_cannot_vouch_for(tmp_path, monkeypatch, capsys) -> None:
    path = str(tmp_path / "l")
    mark = _run(path, "a", None)
    mark = _run(path, "b", mark, steps=(3, 4))
    assert main(["ledger", "compact", path]) == 0
    capsys.readouterr()
    read: list[str] = []
    real = merged.read_bytes
    monkeypatch.setattr(merged, "read_bytes", lambda url: (read.append(url), real(url))[1])

    def same_as_every_file(*extra: str) -> list[str]:
        read.clear()
        fast = _show(capsys, path, "--shards", *extra)
        files_read = list(read)
        assert fast == _show(capsys, path, "--shards", "--every-file", *extra)
        return files_read

    assert same_as_every_file() == []  # every run as the snapshot recorded it: no rank file read
    assert same_as_every_file("--lineage", "a=2@2,b=2@4") == []

    # A run the snapshot does not cover is read; then a rank of the newest run it covers commits again:
    # that run's files are listed, one differs in size, and the run is read.
    _run(path, "c", mark, steps=(5,))
    assert sorted(Path(u).parent.name for u in same_as_every_file()) == ["run-c"] * RANKS
    url = f"{path}/run-b/rank-00001.ledger"
    rank_one = RankFile.parse(url, Path(url).read_bytes())
    rank_one.commits.append(dict(rank_one.commits[-1], commit=3, step=4))  # (same step, same samples: a retry)
    rank_one.save()
    assert sorted(Path(u).parent.name for u in same_as_every_file()) == ["run-b"] * RANKS + ["run-c"] * RANKS


def test_show_of_an_uncommitted_checkpoint_names_the_ranks_from_the_files(tmp_path, capsys) -> None:
    """The run is taken from the snapshot; refusing a checkpoint of a step not every rank committed reads
    its files to name the ranks that lack it."""
    import json

    path = str(tmp_path / "l")
    _run(path, "a", None)
    ledger = wds.Ledger(path, run="a", rank=0, world_size=RANKS)
    url = f"{path}/run-a/rank-00000.ledger"
    ledger._file = RankFile.parse(url, Path(url).read_bytes())
    ledger.commit_number = len(ledger._file.commits)
    ledger.record({"__url__": ["s0.tar"], "__ordinal__": [9]}, epoch=0)
    uncommitted = ledger.commit(step=3)
    assert main(["ledger", "compact", path]) == 0
    checkpoint = tmp_path / "c.json"
    checkpoint.write_text(json.dumps({"data": {"ledger": uncommitted}}))
    capsys.readouterr()
    assert main(["ledger", "show", path, "--checkpoint", str(checkpoint)]) == 1
    assert "step 3 of run a, which not every rank committed (ranks [1, 2]" in capsys.readouterr().err


def test_a_step_one_rank_committed_twice_and_another_never_is_not_complete(tmp_path) -> None:
    """Summaries count the ranks at a step, not the commits: two commits of one rank are not two ranks."""
    path = str(tmp_path / "l")
    twice, never = (wds.Ledger(path, run="a", rank=rank, world_size=2) for rank in range(2))
    for n in range(2):
        twice.record({"__url__": ["s0.tar"], "__ordinal__": [n]}, epoch=0)
        twice.commit(step=5)
    never.record({"__url__": ["s1.tar"], "__ordinal__": [0]}, epoch=0)
    never.commit(step=4)
    files = list(wds.Ledger(path, run="check").rank_files())
    assert summarize(files)["a"].complete() == {} and committed_in(summarize(files))[0] == {}
    never.commit(step=5)
    files = list(wds.Ledger(path, run="check").rank_files())
    assert set(summarize(files)["a"].complete()) == {5}


def test_rewind_removes_the_late_markers_of_the_commits_it_drops(tmp_path, capsys) -> None:
    path = str(tmp_path / "l")
    ledgers = [wds.Ledger(path, run="a", rank=rank, world_size=2) for rank in range(2)]
    for step in (1, 2):
        for ledger in ledgers:
            ledger.record({"__url__": [f"s{ledger.rank}.tar"], "__ordinal__": [step]}, epoch=0)
            ledger.commit(step=step)
    ledgers[0].record({"__url__": ["s0.tar"], "__ordinal__": [7]}, epoch=0)
    ledgers[0].commit(step=1)  # late: commit 3 at step 1
    ledgers[1].record({"__url__": ["s1.tar"], "__ordinal__": [8]}, epoch=0)
    ledgers[1].commit(step=2)  # late: commit 3 at step 2, which the rewind to step 1 drops
    assert late_commits(path) == {"a": [(0, 3, 1), (1, 3, 2)]}
    assert main(["ledger", "rewind", path, "--lineage", "a=1@1"]) == 0
    assert "removed the late marker of commit 3 of run a, rank 1" in capsys.readouterr().out
    assert late_commits(path) == {"a": [(0, 3, 1)]}
