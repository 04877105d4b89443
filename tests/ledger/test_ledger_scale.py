"""The ledger at many ranks and runs: snapshots under a watermark (and when they are not trusted), reads of
only the runs after a snapshot, rank 0 reading for a real 2-process gloo group, ranks waiting for rank 0's
snapshot, and the ``ledger compact`` command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
from shardutil import free_port

import wdsraft as wds
from wdsraft.cli import main
from wdsraft.core.errors import StateMismatchError
from wdsraft.ledger import reading
from wdsraft.ledger.consumed import ConsumedSet
from wdsraft.ledger.identity import ShardIdentities
from wdsraft.ledger.merged import merge_under
from wdsraft.ledger.snapshot import Snapshot, snapshot_url, snapshot_urls, write_snapshot

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings

REPO = Path(__file__).resolve().parents[2]
RANKS = 3


def pairs(consumed: ConsumedSet) -> set[tuple[str, int]]:
    return {(shard, ordinal) for shard, bitmap in consumed.samples.items() for ordinal in bitmap}


def _chain(path: str, runs: int, start: dict | None = None) -> list[dict]:
    """``runs`` runs of RANKS ranks, each resuming from the last one's watermark (no loader: positions are
    recorded directly), each rank committing 2 steps of 2 samples of its own shard; returns the watermarks."""
    watermarks = []
    lineage, steps = (dict(start["lineage"]), dict(start["steps"])) if start else ({}, {})
    for _ in range(runs):
        run = f"r{len(lineage)}"
        for rank in range(RANKS):
            ledger = wds.Ledger(path, run=run, rank=rank, world_size=RANKS)
            ledger.lineage, ledger.lineage_steps = dict(lineage), dict(steps)
            for step in (1, 2):
                base = 4 * len(lineage) + 2 * (step - 1)
                ledger.record({"__url__": [f"s{rank}.tar"] * 2, "__ordinal__": [base, base + 1]}, epoch=0)
                mark = ledger.commit(step=step)
        lineage, steps = mark["lineage"], mark["steps"]
        watermarks.append(mark)
    return watermarks


def _full(path: str, mark: dict) -> set[tuple[str, int]]:
    """The consumed set read the old way: every rank file of the lineage, no snapshot."""
    merged = merge_under(path, mark["lineage"], mark["steps"], ShardIdentities(path), use_snapshots=False)
    return pairs(merged.epochs.get(0, ConsumedSet()))


def test_a_snapshot_is_read_instead_of_the_runs_it_covers(tmp_path: Path) -> None:
    path = str(tmp_path / "l")
    marks = _chain(path, 3)
    reader = wds.Ledger(path, run="check")
    url = reader.compact(marks[-1]["lineage"], marks[-1]["steps"])
    assert url == snapshot_url(path, marks[-1]["lineage"], marks[-1]["steps"])

    again = wds.Ledger(path, run="check")
    got = pairs(again.consumed(0, marks[-1]["lineage"], marks[-1]["steps"]))
    assert again.last_read is not None and again.last_read.snapshot is not None
    assert again.last_read.files_read == 0 and got == _full(path, marks[-1]) and len(got) == 3 * RANKS * 4

    # Two more runs on top: only their files are read, the rest comes from the snapshot.
    later = _chain(path, 2, start=marks[-1])[-1]
    later_reader = wds.Ledger(path, run="check")
    got = pairs(later_reader.consumed(0, later["lineage"], later["steps"]))
    assert later_reader.last_read is not None and later_reader.last_read.files_read == 2 * RANKS
    assert got == _full(path, later) and len(got) == 5 * RANKS * 4


def test_a_snapshot_newer_torn_foreign_or_of_another_ledger_is_ignored_with_a_warning(tmp_path, caplog) -> None:
    path = str(tmp_path / "l")
    marks = _chain(path, 3)
    older, newest = marks[0], marks[-1]
    url = wds.Ledger(path, run="check").compact(newest["lineage"], newest["steps"])

    def read(mark: dict) -> tuple[set, wds.Ledger]:
        reader = wds.Ledger(path, run="check")
        caplog.clear()
        with caplog.at_level("WARNING", logger="wdsraft.ledger"):
            return pairs(reader.consumed(0, mark["lineage"], mark["steps"])), reader

    # Newer than the checkpoint (a rewind to run r2's step 1): ignored, the rank files are read.
    rewound = {"lineage": dict(newest["lineage"], r2=1), "steps": dict(newest["steps"], r2=1)}
    got, reader = read(rewound)
    assert got == _full(path, rewound) and len(got) == RANKS * 4 * 2 + RANKS * 2
    assert reader.last_read is not None and reader.last_read.snapshot is None
    assert "newer than the checkpoint: it counts run r2 up to step 2, the checkpoint up to 1" in caplog.text
    assert url in caplog.text

    # A rewind to run r0's checkpoint, or another branch: runs the snapshot counts are not in the lineage read.
    got, reader = read(older)
    assert got == _full(path, older) and len(got) == RANKS * 4 and reader.last_read.snapshot is None  # type: ignore[union-attr]
    assert "it counts run r1, which is outside the lineage being read" in caplog.text

    # Torn: the checksum fails.
    raw = Path(url).read_bytes()
    Path(url).write_bytes(raw[:-10] + bytes(10))
    got, reader = read(newest)
    assert "checksum mismatch" in caplog.text and url in caplog.text
    assert reader.last_read is not None and reader.last_read.snapshot is None and got == _full(path, newest)

    # Another ledger's snapshot copied in (under the name of this watermark).
    other = wds.Ledger(str(tmp_path / "other"), run="check")
    foreign = Snapshot(other.path, dict(newest["lineage"]), dict(newest["steps"]), {0: ConsumedSet()})
    Path(url).write_bytes(foreign.to_bytes())
    got, _ = read(newest)
    assert "snapshot of another ledger" in caplog.text and got == _full(path, newest)


def _loader(urls: list[str], seed: int, batch: int):
    dataset = wds.WebDataset(urls, shardshuffle=100, seed=seed).shuffle(10, seed=seed).batched(batch)
    return wds.WebLoader(dataset, batch_size=None, num_workers=0)


@pytest.fixture(scope="module")
def urls(write_shards) -> list[str]:
    return write_shards("sc", [{"txt": f"sample {n}".encode()} for n in range(40)], 10)


def test_a_snapshot_of_another_dataset_is_refused_by_the_identity_check(tmp_path, urls) -> None:
    """A snapshot is data like the rank files: the dataset identities it carries are checked against the
    shards before anything is skipped, so a snapshot recording other shards under the same names stops the
    resume with the shard named."""
    from wdsraft.ledger.identity import identity_of

    path = str(tmp_path / "l")
    ledger = wds.Ledger(path, run="one", rank=0, world_size=1)
    loader = _loader(urls, seed=1, batch=4)
    for step, _ in enumerate(ledger.track(loader), 1):
        if step == 3:
            saved = ledger.checkpoint(loader, step)
            break
    mark = saved["ledger"]
    merged = wds.Ledger(path, run="check").merged(mark["lineage"], mark["steps"])
    shard = sorted(merged.epochs[0].samples)[0]  # a shard the skip set names
    real = identity_of(shard)
    assert real is not None
    shards = {url: identity_of(url) for url in urls}
    shards[shard] = dict(real, sha256="0" * 64)  # another dataset's shard under this name
    write_snapshot(Snapshot(path, dict(mark["lineage"]), dict(mark["steps"]), merged.epochs, shards))  # type: ignore[arg-type]
    again = wds.Ledger(path, run="two", rank=0, world_size=1)
    with pytest.raises(StateMismatchError, match=re.escape(f"{shard}: not the shard the ledger")):
        again.resume(_loader(urls, seed=2, batch=5), saved)


def test_an_elastic_resume_writes_the_snapshot_and_the_next_one_reads_it(tmp_path, urls) -> None:
    path = str(tmp_path / "l")
    ledger = wds.Ledger(path, run="one", rank=0, world_size=1)
    loader = _loader(urls, seed=1, batch=4)
    delivered = []
    for step, batch in enumerate(ledger.track(loader), 1):
        delivered += list(zip(batch["__url__"], batch["__ordinal__"].tolist(), strict=True))
        if step == 3:
            saved = ledger.checkpoint(loader, step)
            break
    first = wds.Ledger(path, run="two", rank=0, world_size=1)
    assert first.resume(_loader(urls, seed=2, batch=5), saved) == "elastic"
    assert first.last_read is not None and first.last_read.files_read == 1
    assert [Path(u).name for u in snapshot_urls(path)] == [Path(snapshot_url(path, **_mark(saved))).name]
    second = wds.Ledger(path, run="three", rank=0, world_size=1)
    changed = _loader(urls, seed=3, batch=3)
    assert second.resume(changed, saved) == "elastic"
    assert second.last_read is not None and second.last_read.files_read == 0 and second.last_read.snapshot
    rest = [
        p for batch in second.track(changed) for p in zip(batch["__url__"], batch["__ordinal__"].tolist(), strict=True)
    ]
    assert sorted(delivered + rest) == sorted((u, o) for u in urls for o in range(10))


def _mark(saved: dict) -> dict:
    return {"lineage": saved["ledger"]["lineage"], "steps": saved["ledger"]["steps"]}


def test_ranks_wait_for_the_snapshot_rank_zero_writes(tmp_path) -> None:
    """Without a process group, ranks other than 0 with ``snapshot_wait`` read rank 0's snapshot of the
    watermark instead of every rank file; without it (the default) they read the files."""
    path = str(tmp_path / "l")
    mark = _chain(path, 2)[-1]
    results: dict[int, object] = {}

    def resume(rank: int, wait: float) -> None:
        ledger = wds.Ledger(path, run="new", rank=rank, world_size=2, snapshot_wait=wait)
        results[rank] = (pairs(ledger._skip_set(0, mark["lineage"], mark["steps"])), ledger.last_read)

    waiting = threading.Thread(target=resume, args=(1, 30.0))
    waiting.start()
    time.sleep(0.7)  # rank 1 is polling
    resume(0, 0.0)
    waiting.join()
    (zero, zero_read), (one, one_read) = results[0], results[1]  # type: ignore[misc]
    assert zero == one == _full(path, mark)
    assert zero_read.files_read == 2 * RANKS and one_read.files_read == 0 and one_read.snapshot is not None
    other = _chain(str(tmp_path / "m"), 1)[-1]
    impatient = wds.Ledger(str(tmp_path / "m"), run="new2", rank=1, world_size=2)
    impatient._skip_set(0, other["lineage"], other["steps"])
    assert impatient.last_read is not None and impatient.last_read.files_read == RANKS


_GLOO_SCRIPT = """
import json, os, sys
import torch.distributed as dist
import wdsraft as wds
from wdsraft.ledger import merged
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
mark = json.loads(sys.argv[4])
from wdsraft.ledger import identity
from wdsraft.core.errors import StateMismatchError
reads, index_reads = [], []
original, original_identity = merged.read_bytes, identity.identity_of
merged.read_bytes = lambda url: (reads.append(url), original(url))[1]
identity.identity_of = lambda url: (index_reads.append(url), original_identity(url))[1]
if sys.argv[5] == "mismatch" and rank == 0:
    def differs(self, urls):
        raise StateMismatchError("s1.tar: not the shard the ledger recorded positions in")
    identity.ShardIdentities.check = differs
ledger = wds.Ledger(sys.argv[3], run="new", rank=rank, world_size=2)
try:
    consumed = ledger._skip_set(0, mark["lineage"], mark["steps"])
except StateMismatchError as exn:
    print(json.dumps({"refused": str(exn)}))
    dist.destroy_process_group()  # (exiting with the group alive can abort in gloo's threads: SIGABRT)
    sys.exit(0)
print(json.dumps({"pairs": sorted([s, o] for s, b in consumed.samples.items() for o in b), "reads": len(reads),
                  "index_reads": len(index_reads), "shards": sorted(ledger._identities.recorded),
                  "checked": len(ledger._identities.checked), "index_urls": sorted(index_reads)}))
dist.destroy_process_group()
"""


def _gloo(path: str, mark: dict, mode: str) -> list[dict]:
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO), "WDSRAFT_RUN": "unused"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _GLOO_SCRIPT, str(rank), port, path, json.dumps(mark), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for rank in (0, 1)
    ]
    out = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr.decode()[-2000:]
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return out


def test_rank_zero_reads_the_ledger_and_broadcasts_it_in_a_gloo_group(tmp_path) -> None:
    path = str(tmp_path / "l")
    mark = _chain(path, 2)[-1]
    out = _gloo(path, mark, "plain")
    assert out[0]["pairs"] == out[1]["pairs"] and {tuple(p) for p in out[0]["pairs"]} == _full(path, mark)
    assert out[0]["reads"] == 2 * RANKS and out[1]["reads"] == 0  # one reader for the whole group
    # Each shard's index read once in the group, each rank its share (not all on rank 0), and both learn all.
    read = sorted(out[0]["index_urls"] + out[1]["index_urls"])
    assert len(read) == len(set(read)) == RANKS
    assert [o["index_urls"] for o in out] == [[u for u in read if zlib.crc32(u.encode()) % 2 == r] for r in (0, 1)]
    assert out[0]["shards"] == out[1]["shards"] and out[0]["checked"] == out[1]["checked"] == RANKS
    assert len(list(snapshot_urls(path))) == 1  # rank 0 left the snapshot for the next restart

    # A dataset that differs, found by one rank, stops every rank with the shard named.
    refused = _gloo(path, mark, "mismatch")
    assert all("s1.tar: not the shard the ledger" in r["refused"] for r in refused), refused
    assert refused[1]["refused"].startswith("(found by rank 0)") and not refused[0]["refused"].startswith("(")


def test_ledger_compact_command_and_rewind_drops_snapshots_beyond_it(tmp_path, capsys) -> None:
    path = str(tmp_path / "l")
    marks = _chain(path, 3)
    assert main(["ledger", "compact", path]) == 0  # the committed truth: the newest complete step
    out = capsys.readouterr().out
    assert out.startswith("wrote ") and "r2=" in out and f"{3 * RANKS} rank files merged" in out
    newest = snapshot_url(path, marks[-1]["lineage"], marks[-1]["steps"])
    assert Path(newest).exists()
    lineage = ",".join(f"{run}={c}@{marks[0]['steps'][run]}" for run, c in marks[0]["lineage"].items())
    assert main(["ledger", "compact", path, "--lineage", lineage]) == 0
    assert f"{RANKS} rank files merged" in capsys.readouterr().out
    torn = str(Path(path) / "snapshots" / "torn.snapshot")  # (a copy cut short: no rewound read could use it)
    Path(torn).write_bytes(Path(newest).read_bytes()[:-9])
    assert main(["ledger", "rewind", path, "--lineage", lineage]) == 0
    out = capsys.readouterr().out
    assert f"removed the snapshot {newest} (it counts run r1, which is outside the lineage" in out
    assert f"removed the snapshot {torn} ({torn}: unreadable ledger snapshot (torn or not msgpack" in out
    assert [Path(u).name for u in snapshot_urls(path)] == [Path(snapshot_url(path, **_mark_of(marks[0]))).name]


def _mark_of(mark: dict) -> dict:
    return {"lineage": mark["lineage"], "steps": mark["steps"]}


def test_snapshots_and_per_run_reads_on_s3(s3_bucket) -> None:
    path = f"s3://{s3_bucket}/deep/ledger"
    marks = _chain(path, 2)
    reader = wds.Ledger(path, run="check")
    assert len(reader.files()) == 2 * RANKS
    url = reader.compact(marks[0]["lineage"], marks[0]["steps"])
    assert list(snapshot_urls(path)) == [url]
    again = wds.Ledger(path, run="check")
    got = pairs(again.consumed(0, marks[-1]["lineage"], marks[-1]["steps"]))
    assert again.last_read is not None and again.last_read.files_read == RANKS and again.last_read.snapshot
    assert len(got) == 2 * RANKS * 4


def test_reads_are_retried_then_fail_naming_the_object(tmp_path, monkeypatch) -> None:
    target = tmp_path / "x.ledger"
    target.write_bytes(b"data")
    calls = []
    real_open = open

    def flaky(path, *args, **kwargs):
        if str(path) == str(target):
            calls.append(path)
            if len(calls) < reading.ATTEMPTS:
                raise ConnectionResetError("reset")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", flaky)
    monkeypatch.setattr(reading.time, "sleep", lambda _: None)
    assert reading.read_bytes(str(target)) == b"data" and len(calls) == reading.ATTEMPTS
    with pytest.raises(FileNotFoundError, match=r"missing\.ledger"):
        reading.read_bytes(str(tmp_path / "missing.ledger"))
    assert list(reading.parallel_map(lambda u: u * 2, ["a", "b", "c"], concurrency=2)) == ["aa", "bb", "cc"]


def test_the_ledger_concurrency_variable_sets_its_reads_and_their_connection_pool(tmp_path, monkeypatch) -> None:
    """``WDSRAFT_LEDGER_CONCURRENCY`` sets how many ledger objects a process reads at once and the pool of
    the S3 client they share (one connection each); the shard reader's client keeps its own pool. It is read
    when the ledger first reads: a value that is not a whole number from 1 is refused then, naming the
    variable, and does not stop ``import wdsraft``."""
    probe = (
        "import wdsraft; from wdsraft.ledger import reading; from wdsraft.io.s3 import s3_reader_client\n"
        "ledger, reader = reading._client().meta.config, s3_reader_client(1.5, 2.5).meta.config\n"
        "print(reading.ledger_concurrency(), ledger.max_pool_connections, ledger.retries['total_max_attempts'],"
        " reader.max_pool_connections, reader.connect_timeout, reader.read_timeout)"
    )
    env = dict(os.environ, WDSRAFT_LEDGER_CONCURRENCY="5", AWS_ENDPOINT_URL="http://127.0.0.1:1")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["5", "5", "1", "32", "1.5", "2.5"]
    env["WDSRAFT_LEDGER_CONCURRENCY"] = "0"
    subprocess.run([sys.executable, "-c", "import wdsraft"], env=env, check=True)  # (a bad value: only the ledger)
    from wdsraft.io.threads import CONCURRENCY

    monkeypatch.delenv("WDSRAFT_LEDGER_CONCURRENCY", raising=False)
    reading.ledger_concurrency.cache_clear()
    assert reading.ledger_concurrency() == CONCURRENCY
    for good, value in (("3.0", 3), ("1e1", 10)):
        monkeypatch.setenv("WDSRAFT_LEDGER_CONCURRENCY", good)
        reading.ledger_concurrency.cache_clear()
        assert reading.ledger_concurrency() == value
    for bad in ("abc", "0", "-3", "2.5", "nan", "inf"):
        monkeypatch.setenv("WDSRAFT_LEDGER_CONCURRENCY", bad)
        reading.ledger_concurrency.cache_clear()
        with pytest.raises(ValueError, match=f"WDSRAFT_LEDGER_CONCURRENCY='{re.escape(bad)}'"):
            reading.ledger_concurrency()
    reading.ledger_concurrency.cache_clear()  # (the next test reads its own environment)
