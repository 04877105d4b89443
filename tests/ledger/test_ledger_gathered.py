"""Snapshots written at checkpoint time under torch.distributed (rank 0 gathers each rank's new commits and
writes the snapshot of every checkpoint's watermark incrementally): a real 3-process gloo group; a restart
reads one object; each snapshot equals the one compacted from the rank files; a missing, torn or unwritten
snapshot falls back to the files; late commits at a step a snapshot covers are never missed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
from shardutil import free_port

import wdsraft as wds
from wdsraft.ledger import gathered, reading
from wdsraft.ledger.consumed import ConsumedSet
from wdsraft.ledger.identity import ShardIdentities
from wdsraft.ledger.merged import merge_under
from wdsraft.ledger.snapshot import Snapshot, late_commits, snapshot_url, snapshot_urls

REPO = Path(__file__).resolve().parents[2]
RANKS = 3


def pairs(consumed: ConsumedSet) -> set[tuple[str, int]]:
    return {(shard, ordinal) for shard, bitmap in consumed.samples.items() for ordinal in bitmap}


def from_files(path: str, lineage: dict, steps: dict) -> Any:
    """The ledger under a watermark read the old way: every rank file of the lineage, no snapshot."""
    return merge_under(path, lineage, steps, ShardIdentities(path), use_snapshots=False)


def assert_same_as_files(path: str, mark: dict) -> Snapshot:
    """The snapshot of ``mark`` is there and holds exactly what the rank files say under it."""
    url = snapshot_url(path, mark["lineage"], mark["steps"])
    snapshot = Snapshot.parse(url, reading.read_bytes(url))
    files = from_files(path, mark["lineage"], mark["steps"])
    assert {e: pairs(c) for e, c in snapshot.epochs.items()} == {e: pairs(c) for e, c in files.epochs.items()}
    assert {e: c.tokens for e, c in snapshot.epochs.items()} == {e: c.tokens for e, c in files.epochs.items()}
    assert snapshot.rank_commits() == files.rank_commits() and snapshot.shards == files.shards
    assert {run: s.to_plain() for run, s in snapshot.summaries().items()} == {
        run: s.to_plain() for run, s in files.summaries().items()
    }
    return snapshot


class Loader:
    """What checkpoint() asks of a loader (positions are recorded directly, not delivered)."""

    epoch = 0

    def state_dict(self) -> dict:
        return {"epoch": 0}


_GLOO_SCRIPT = """
import json, sys
import torch.distributed as dist
import wdsraft as wds
from wdsraft.ledger import merged, reading
rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=3)
class Loader:
    epoch = 0
    def state_dict(self):
        return {"epoch": 0}
def record(ledger, base):
    ledger.record({"__url__": [f"s{rank}.tar"] * 2, "__ordinal__": [base, base + 1]}, epoch=0)
marks = {}
one = wds.Ledger(path, run="one", rank=rank, world_size=3)
for step in (1, 2):
    record(one, 2 * step)
    marks[f"one@{step}"] = one.checkpoint(Loader(), step)["ledger"]
if rank == 1:  # a rank that commits again at step 2, outside a checkpoint: the next one gathers it too
    record(one, 40)
    one.commit(2)
record(one, 50)
marks["one@3"] = one.checkpoint(Loader(), 3)["ledger"]
dist.barrier()
# The restart: every object read counted, on each rank.
reads = []
original = reading.read_bytes
reading.read_bytes = lambda url: (reads.append(url), original(url))[1]
merged.read_bytes = reading.read_bytes
two = wds.Ledger(path, run="two", rank=rank, world_size=3)
mark = marks["one@3"]
two.lineage, two.lineage_steps = dict(mark["lineage"]), dict(mark["steps"])
consumed = two._skip_set(0, two.lineage, two.lineage_steps)
restart_reads = list(reads)
record(two, 60)
marks["two@4"] = two.checkpoint(Loader(), 4)["ledger"]  # (incremental from what resume read)
three = wds.Ledger(path, run="three", rank=rank, world_size=3)
three.lineage, three.lineage_steps = dict(marks["two@4"]["lineage"]), dict(marks["two@4"]["steps"])
reads.clear()
record(three, 70)
marks["three@5"] = three.checkpoint(Loader(), 5)["ledger"]  # (an exact resume: rank 0 reads its base)
print(json.dumps({"marks": marks, "restart_reads": restart_reads, "base_reads": list(reads),
                  "pairs": sorted([s, o] for s, b in consumed.samples.items() for o in b)}))
dist.destroy_process_group()
"""


def test_every_checkpoint_has_its_snapshot_and_a_restart_reads_one_object_in_a_gloo_group(tmp_path) -> None:
    path = str(tmp_path / "l")
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO), "WDSRAFT_RUN": "unused"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _GLOO_SCRIPT, str(rank), port, path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for rank in range(RANKS)
    ]
    out = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr.decode()[-3000:]
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    marks = out[0]["marks"]
    # The restart: rank 0 read one object (the snapshot of the checkpoint's watermark), the others none.
    restart = [o["restart_reads"] for o in out]
    assert restart[0] == [snapshot_url(path, marks["one@3"]["lineage"], marks["one@3"]["steps"])]
    assert restart[1] == restart[2] == []
    assert out[0]["pairs"] == out[1]["pairs"] == out[2]["pairs"]
    one_at_3 = marks["one@3"]
    assert {tuple(p) for p in out[0]["pairs"]} == pairs(
        from_files(path, one_at_3["lineage"], one_at_3["steps"]).epochs[0]
    )
    assert ["s1.tar", 40] in out[0]["pairs"]  # the commit outside a checkpoint, gathered at the next one
    # The next run's first snapshot built on what resume read; an exact resume's on one read of the snapshot.
    assert out[0]["base_reads"] == [snapshot_url(path, marks["two@4"]["lineage"], marks["two@4"]["steps"])]
    # Every snapshot written incrementally is the one compacted from the rank files under its watermark.
    for name in ("one@3", "two@4", "three@5"):
        assert_same_as_files(path, marks[name])
    three = assert_same_as_files(path, marks["three@5"])
    assert len(pairs(three.epochs[0])) == RANKS * 2 * 5 + 2  # (a checkpoint at steps 1-5, and rank 1's extra commit)


# -- the chain in one process: ranks' gathers played in turn through a stand-in process group ---------


class Group:
    """``gather_object`` for ranks played one after the other in this process: ranks other than 0 leave
    their object, rank 0 (played last) receives them all."""

    def __init__(self, size: int):
        self.size, self.rank, self.left = size, 0, {}

    def get_world_size(self) -> int:
        return self.size

    def get_rank(self) -> int:
        return self.rank

    def gather_object(self, obj: Any, received: list | None, dst: int) -> None:
        self.left[self.rank] = obj
        if received is not None:
            received[:] = [self.left[r] for r in range(self.size)]


def _checkpoint_all(ledgers: list[wds.Ledger], group: Group, step: int, extra: int = 0) -> dict:
    marks = []
    for ledger in reversed(ledgers):  # (rank 0 last: it receives what the others left)
        ledger.record({"__url__": [f"s{ledger.rank}.tar"] * 2, "__ordinal__": [step * 10 + extra, step * 10 + 1]}, 0)
        group.rank = ledger.rank
        mark = ledger.commit(step)
        ledger._chain.gather(ledger._file, mark, ledger._base(), group)  # type: ignore[arg-type]
        marks.append(mark)
    return marks[-1]


def _ranks(path: str, run: str) -> list[wds.Ledger]:
    return [wds.Ledger(path, run=run, rank=rank, world_size=RANKS) for rank in range(RANKS)]


def test_a_snapshot_that_fails_to_write_costs_only_speed_and_the_next_is_whole(tmp_path, monkeypatch) -> None:
    path, group = str(tmp_path / "l"), Group(RANKS)
    ledgers = _ranks(path, "one")
    real = gathered.write_snapshot

    def failing(snapshot: Snapshot) -> str:
        raise OSError(28, "No space left on device", "snapshot")

    monkeypatch.setattr(gathered, "write_snapshot", failing)
    first = _checkpoint_all(ledgers, group, 1)
    assert not list(snapshot_urls(path))
    reader = wds.Ledger(path, run="check")
    got = pairs(reader.consumed(0, first["lineage"], first["steps"]))  # (no snapshot: the files)
    assert reader.last_read.files_read == RANKS and got == pairs(
        from_files(path, first["lineage"], first["steps"]).epochs[0]
    )  # type: ignore[union-attr]
    monkeypatch.setattr(gathered, "write_snapshot", real)
    second = _checkpoint_all(ledgers, group, 2)
    assert_same_as_files(path, second)  # (holds step 1's commits too: the state was right all along)


def test_a_missing_or_torn_gathered_snapshot_falls_back_to_the_files(tmp_path, caplog) -> None:
    path, group = str(tmp_path / "l"), Group(RANKS)
    ledgers = _ranks(path, "one")
    _checkpoint_all(ledgers, group, 1)
    last = _checkpoint_all(ledgers, group, 2)
    url = snapshot_url(path, last["lineage"], last["steps"])
    expected = pairs(from_files(path, last["lineage"], last["steps"]).epochs[0])
    raw = Path(url).read_bytes()
    Path(url).write_bytes(raw[: len(raw) // 2])  # torn
    reader = wds.Ledger(path, run="check")
    with caplog.at_level("WARNING", logger="wdsraft.ledger"):
        assert pairs(reader.consumed(0, last["lineage"], last["steps"])) == expected
    assert "torn" in caplog.text and url in caplog.text
    # (the snapshot of step 1 is used instead: run one is read again on top of it)
    assert reader.last_read.snapshot is not None and reader.last_read.files_read == RANKS  # type: ignore[union-attr]
    for snapshot in snapshot_urls(path):
        os.remove(snapshot)  # missing: all of them
    reader = wds.Ledger(path, run="check")
    assert pairs(reader.consumed(0, last["lineage"], last["steps"])) == expected
    assert reader.last_read.snapshot is None and reader.last_read.files_read == RANKS  # type: ignore[union-attr]


def test_a_chain_starts_from_the_snapshot_the_last_run_left_or_from_its_files(tmp_path) -> None:
    path, group = str(tmp_path / "l"), Group(RANKS)
    first = _checkpoint_all(_ranks(path, "one"), group, 1)
    for snapshot in snapshot_urls(path):
        os.remove(snapshot)  # (the last run left none: the chain reads the files once)
    ledgers = _ranks(path, "two")
    for ledger in ledgers:
        ledger.lineage, ledger.lineage_steps = dict(first["lineage"]), dict(first["steps"])
    second = _checkpoint_all(ledgers, group, 2)
    assert_same_as_files(path, second)
    assert (
        len(pairs(Snapshot.parse("x", reading.read_bytes(snapshot_url(path, **_mark(second)))).epochs[0])) == 4 * RANKS
    )


def _mark(mark: dict) -> dict:
    return {"lineage": mark["lineage"], "steps": mark["steps"]}


def test_rank_zero_keeps_the_last_snapshots_of_its_run(tmp_path) -> None:
    path, group = str(tmp_path / "l"), Group(RANKS)
    ledgers = _ranks(path, "one")
    marks = [_checkpoint_all(ledgers, group, step) for step in range(1, gathered.KEEP + 2)]
    names = sorted(Path(u).name for u in snapshot_urls(path))
    assert names == sorted(Path(snapshot_url(path, **_mark(m))).name for m in marks[1:])


def test_a_payload_is_small_commits_only_since_the_last_gather(tmp_path) -> None:
    path, group = str(tmp_path / "l"), Group(RANKS)
    ledgers = _ranks(path, "one")
    _checkpoint_all(ledgers, group, 1)
    _checkpoint_all(ledgers, group, 2)
    rank, world_size, commits, _ = msgpack.unpackb(group.left[1], raw=False)
    assert (rank, world_size) == (1, RANKS) and [c["commit"] for c in commits] == [2]


def test_a_chain_that_cannot_start_writes_no_snapshot_and_training_goes_on(tmp_path, monkeypatch, caplog) -> None:
    path, group = str(tmp_path / "l"), Group(RANKS)
    first = _checkpoint_all(_ranks(path, "one"), group, 1)
    ledgers = _ranks(path, "two")
    for ledger in ledgers:
        ledger.lineage, ledger.lineage_steps = dict(first["lineage"]), dict(first["steps"])

    def unreadable(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionResetError("reset")

    monkeypatch.setattr(gathered, "merge_under", unreadable)
    with caplog.at_level("WARNING", logger="wdsraft.ledger"):
        second = _checkpoint_all(ledgers, group, 2)
    assert "no more snapshots at checkpoints of run two" in caplog.text
    assert not Path(snapshot_url(path, **_mark(second))).exists()
    monkeypatch.undo()
    reader = wds.Ledger(path, run="check")
    got = pairs(reader.consumed(0, second["lineage"], second["steps"]))
    assert got == pairs(from_files(path, second["lineage"], second["steps"]).epochs[0]) and len(got) == 4 * RANKS


@pytest.mark.parametrize("how", ["compact", "gathered"])
def test_a_commit_at_a_step_a_snapshot_covers_is_never_missed(tmp_path, how: str) -> None:
    """A rank that commits something again at a step it reached leaves a late marker first: a snapshot of
    that step written before lacks its commit and is read with that run's files on top."""
    path, group = str(tmp_path / "l"), Group(RANKS)
    ledgers = _ranks(path, "one")
    mark = _checkpoint_all(ledgers, group, 1)
    if how == "compact":
        for snapshot in snapshot_urls(path):
            os.remove(snapshot)
        wds.Ledger(path, run="check").compact(mark["lineage"], mark["steps"])
    url = snapshot_url(path, **_mark(mark))
    before = Path(url).read_bytes()
    late = ledgers[2]
    late.record({"__url__": ["s2.tar"], "__ordinal__": [99]}, 0)
    late.commit(1)  # again at step 1, after the snapshot of step 1 was written
    assert late_commits(path) == {"one": [(2, 2, 1)]}
    assert Path(url).read_bytes() == before  # (the snapshot is as it was)
    expected = pairs(from_files(path, mark["lineage"], mark["steps"]).epochs[0])
    assert ("s2.tar", 99) in expected
    reader = wds.Ledger(path, run="check")
    assert pairs(reader.consumed(0, mark["lineage"], mark["steps"])) == expected
    assert reader.last_read.stale == {"one"} and reader.last_read.files_read == RANKS  # type: ignore[union-attr]
    # An empty commit at the same step (a final checkpoint right after a periodic one) leaves no marker.
    ledgers[1].commit(1)
    assert late_commits(path) == {"one": [(2, 2, 1)]}
    # A snapshot written after the late commit holds it: used whole again.
    wds.Ledger(path, run="check").compact(mark["lineage"], mark["steps"])
    again = wds.Ledger(path, run="check")
    assert pairs(again.consumed(0, mark["lineage"], mark["steps"])) == expected
    assert again.last_read.stale == set() and again.last_read.files_read == 0  # type: ignore[union-attr]


def test_without_the_snapshot_of_its_watermark_a_read_starts_from_the_latest_not_a_scan(tmp_path, monkeypatch) -> None:
    path, group = str(tmp_path / "l"), Group(RANKS)
    ledgers = _ranks(path, "one")
    marks = [_checkpoint_all(ledgers, group, step) for step in (1, 2, 3)]
    later = _ranks(path, "two")  # (a run without a process group: no snapshot at its commits)
    for ledger in later:
        ledger.lineage, ledger.lineage_steps = dict(marks[-1]["lineage"]), dict(marks[-1]["steps"])
        ledger.record({"__url__": [f"s{ledger.rank}.tar"], "__ordinal__": [99]}, 0)
        mark = ledger.commit(step=4)
    read: list[str] = []
    real = reading.read_bytes
    monkeypatch.setattr(reading, "read_bytes", lambda url: (read.append(url), real(url))[1])
    reader = wds.Ledger(path, run="check")
    got = pairs(reader.consumed(0, mark["lineage"], mark["steps"]))
    assert got == pairs(from_files(path, mark["lineage"], mark["steps"]).epochs[0])
    latest = snapshot_url(path, **_mark(marks[-1]))
    assert reader.last_read.snapshot.url == latest and reader.last_read.files_read == RANKS  # type: ignore[union-attr]
    snapshots = [url for url in read if url.endswith(".snapshot")]
    assert snapshots == [snapshot_url(path, **_mark(mark)), latest]  # (the missing one tried, then the latest)


def test_compact_refuses_a_step_not_every_rank_committed(tmp_path) -> None:
    """A rank committing the compacted step later commits there for the first time (no late marker): a
    snapshot written before would miss its commit for good. compact() refuses until every rank is there."""
    path = str(tmp_path / "l")
    zero, one = (wds.Ledger(path, run="one", rank=rank, world_size=2) for rank in (0, 1))
    zero.record({"__url__": ["s0.tar"], "__ordinal__": [1]}, 0)
    mark = zero.commit(5)
    with pytest.raises(wds.LedgerError, match="not every rank of the run has committed there"):
        wds.Ledger(path, run="check").compact(mark["lineage"], mark["steps"])
    one.record({"__url__": ["s1.tar"], "__ordinal__": [7]}, 0)
    one.commit(5)
    wds.Ledger(path, run="check").compact(mark["lineage"], mark["steps"])
    reader = wds.Ledger(path, run="check")
    assert pairs(reader.consumed(0, mark["lineage"], mark["steps"])) == {("s0.tar", 1), ("s1.tar", 7)}
