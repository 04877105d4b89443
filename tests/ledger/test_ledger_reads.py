"""What a ``wdsraft ledger`` command reads, counted: each object and each listing once per command, on a
local directory (opens and directory listings) and on S3 (GETs and LISTs sent to the moto server)."""

from __future__ import annotations

import builtins
import os
from collections import Counter
from typing import Any

import pytest
from shardutil import commit_run

import wdsraft as wds
from wdsraft.cli import main
from wdsraft.io.storage import write_bytes_atomic
from wdsraft.ledger.reading import read_bytes
from wdsraft.ledger.snapshot import Snapshot

RANKS = 3


class Reads:
    """Counts the reads and listings of a ledger's objects, local or on S3."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: str) -> None:
        self.seen: Counter = Counter()
        real_parse = Snapshot.parse  # (parsing a snapshot of thousands of ranks costs as much as reading it)

        def parse(url: str, raw: bytes) -> Snapshot:
            self.seen[("parse", url)] += 1
            return real_parse(url, raw)

        monkeypatch.setattr(Snapshot, "parse", staticmethod(parse))
        if root.startswith("s3://"):
            import botocore.client

            real_call = botocore.client.BaseClient._make_api_call

            def call(client: Any, operation: str, params: dict[str, Any]) -> Any:
                if operation in ("GetObject", "HeadObject"):
                    self.seen[("get", params["Key"])] += 1
                elif operation.startswith("ListObjects"):  # (with or without a delimiter: one listing of a folder)
                    self.seen[("list", params["Prefix"], params.get("ContinuationToken"))] += 1
                return real_call(client, operation, params)

            monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", call)
            return
        real_open, real_listdir, real_scandir = builtins.open, os.listdir, os.scandir

        def opened(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if "r" in mode and str(file).startswith(root):
                self.seen[("open", str(file))] += 1
            return real_open(file, mode, *args, **kwargs)

        def listdir(path: Any = ".") -> list[str]:
            if str(path).startswith(root):
                self.seen[("list", os.path.normpath(str(path)))] += 1
            return real_listdir(path)

        def scandir(path: Any = ".") -> Any:
            if str(path).startswith(root):
                self.seen[("list", os.path.normpath(str(path)))] += 1
            return real_scandir(path)

        monkeypatch.setattr(builtins, "open", opened)
        monkeypatch.setattr(os, "listdir", listdir)
        monkeypatch.setattr(os, "scandir", scandir)

    def twice(self) -> list[Any]:
        return sorted((key for key, n in self.seen.items() if n > 1), key=str)


def _run(path: str, run: str, mark: dict | None, steps: tuple[int, ...]) -> tuple[dict, list[wds.Ledger]]:
    return commit_run(path, run, mark, steps, RANKS)


@pytest.fixture(params=["local", "s3"])
def ledger_path(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_bucket')}/ledger"
    return str(tmp_path / "ledger")


def test_each_command_reads_each_object_and_listing_once(ledger_path: str, tmp_path, monkeypatch, capsys) -> None:
    """A snapshot of runs a and b; then run c (not covered), and a late commit of b (its file changed, a
    late marker): every command reads the snapshot, the late markers, each run's listing and each rank
    file at most once, whatever it then does with them."""
    path = ledger_path
    mark, _ = _run(path, "a", None, (1, 2))
    mark, b = _run(path, "b", mark, (3, 4))
    assert main(["ledger", "compact", path]) == 0
    _run(path, "c", mark, (5,))
    b[1].record({"__url__": ["s1.tar"], "__ordinal__": [90]}, epoch=0)
    b[1].commit(step=4)  # (a step rank 1 had reached: a late marker)
    capsys.readouterr()
    commands = [
        ["show", path, "--shards"],
        ["show", path, "--lineage", "a=2@2,b=2@4"],
        ["show", path, "--lineage", "a=2@2,b=3@4"],
        ["export", path],
        ["merge", path, "--output", str(tmp_path / "merged")],
        ["compact", path],
        ["compact", path, "--lineage", "a=2@2,b=3@4,c=1@5"],
        ["show", path],
        ["export", path, "--lineage", "a=2@2"],  # (no snapshot within it: those in the folder are each read once)
        ["rewind", path, "--lineage", "a=2@2,b=2@4", "--prune"],
    ]
    repeated = {}
    for command in commands:
        reads = Reads(monkeypatch, path)
        assert main(["ledger", *command]) == 0, command
        assert reads.seen, command
        repeated[" ".join(command[:1] + command[2:])] = [str(key).replace(path, "L") for key in reads.twice()]
        monkeypatch.undo()
    assert repeated == {key: [] for key in repeated}


def test_a_torn_snapshot_written_last_is_read_once(ledger_path: str, monkeypatch, caplog, capsys) -> None:
    """``compact`` where the snapshot written last (of the same watermark) is torn: the view and the merge
    both look at it, one read and one parse between them; the warnings say it is torn, and the rank files
    are read instead."""
    path = ledger_path
    _run(path, "a", None, (1, 2))
    assert main(["ledger", "compact", path]) == 0
    url = read_bytes(f"{path}/snapshots/latest").decode()
    write_bytes_atomic(url, read_bytes(url)[:-7])
    capsys.readouterr()
    reads = Reads(monkeypatch, path)
    assert main(["ledger", "compact", path]) == 0
    assert reads.twice() == []
    assert f"ignoring the ledger snapshot {url}: " in caplog.text
    assert f"ignoring the ledger snapshot {url}, reading the rank files instead: " in caplog.text
    rewritten = Snapshot.parse(url, read_bytes(url))  # (written again, whole, from every rank's file)
    assert rewritten.lineage == {"a": 2} and rewritten.epochs[0].count() == RANKS * 4
    assert f"{RANKS} rank files merged" in capsys.readouterr().out


class Stats:
    """Counts the stat calls on local rank files: ``os.stat`` (and what calls it) and the ``stat()`` of the
    entries of an ``os.scandir`` (a C type: its entries are wrapped to count)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: Counter = Counter()
        real_stat, real_scandir = os.stat, os.scandir
        seen = self.seen

        def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path).endswith(".ledger"):
                seen[str(path)] += 1
            return real_stat(path, *args, **kwargs)

        class Entry:
            def __init__(self, entry: Any) -> None:
                self.entry = entry

            def __getattr__(self, name: str) -> Any:
                return getattr(self.entry, name)

            def stat(self, *args: Any, **kwargs: Any) -> Any:
                if self.entry.name.endswith(".ledger"):
                    seen[self.entry.path] += 1
                return self.entry.stat(*args, **kwargs)

        class Listing:
            def __init__(self, path: Any = ".") -> None:
                self.entries = real_scandir(path)

            def __enter__(self) -> Listing:
                return self

            def __exit__(self, *exc: Any) -> None:
                self.entries.close()

            def __iter__(self) -> Any:
                return (Entry(entry) for entry in self.entries)

            def close(self) -> None:
                self.entries.close()

        monkeypatch.setattr(os, "stat", stat)
        monkeypatch.setattr(os, "scandir", Listing)


def test_a_read_under_a_watermark_stats_no_rank_file(tmp_path, monkeypatch, capsys) -> None:
    """A local ledger's rank files are listed by name only: a read under a watermark (what ``resume()``
    does) never needs their sizes, so no rank file is stat'ed. ``ledger show`` from a snapshot compares the
    sizes of the newest run it covers with what it recorded: each of that run's files is stat'ed once, and
    no other (the run after the snapshot is read whole)."""
    path = str(tmp_path / "ledger")
    mark, _ = _run(path, "a", None, (1, 2))
    mark, _ = _run(path, "b", mark, (3, 4))
    stats = Stats(monkeypatch)
    merged = wds.Ledger(path, run="check").merged(mark["lineage"], mark["steps"])
    assert merged.snapshot is None and merged.files_read == 2 * RANKS
    assert merged.epochs[0].count() == RANKS * 2 * 4
    assert stats.seen == {}
    monkeypatch.undo()

    assert main(["ledger", "compact", path]) == 0
    _run(path, "c", mark, (5,))
    capsys.readouterr()
    stats = Stats(monkeypatch)
    assert main(["ledger", "show", path]) == 0
    assert "for 2 runs (as it recorded them), the files of 1 runs" in capsys.readouterr().out
    assert stats.seen == {os.path.join(path, "run-b", f"rank-{rank:05d}.ledger"): 1 for rank in range(RANKS)}
