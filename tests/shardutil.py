"""Helpers shared by the tests: reading shards with both libraries, comparing samples, free ports."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
from typing import Any

import webdataset

import wdsraft
from wdsraft.core.fields import OFFSET_FIELD, ORDINAL_FIELD

POSITION_FIELDS = (ORDINAL_FIELD, OFFSET_FIELD)


def without_positions(samples: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples as webdataset would give them (wdsraft adds position fields)."""
    return [{k: v for k, v in sample.items() if k not in POSITION_FIELDS} for sample in samples]


def read_webdataset(urls: Sequence[str]) -> list[dict[str, Any]]:
    return list(webdataset.tarfile_samples([{"url": url} for url in urls]))


def read_wdsraft(urls: Sequence[str]) -> list[dict[str, Any]]:
    return list(wdsraft.tarfile_samples([{"url": url} for url in urls]))


def corpus_samples(records: Sequence[dict], count: int | None = None) -> list[dict[str, Any]]:
    """webdataset-style samples from corpus records: text as .txt, the id as .json."""
    chosen = records if count is None else records[:count]
    return [{"__key__": f"{n:08d}", "txt": r["text"], "json": {"id": r["id"]}} for n, r in enumerate(chosen)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for servers and process groups the tests start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def commit_run(
    path: str, run: str, mark: dict | None, steps: Sequence[int], ranks: int
) -> tuple[dict, list[wdsraft.Ledger]]:
    """A run of ``ranks`` ledger ranks resuming from ``mark`` (a commit's lineage), each rank committing two
    samples of its own shard per step; the last commit and the ledgers."""
    ledgers = []
    last: dict = {}
    for rank in range(ranks):
        ledger = wdsraft.Ledger(path, run=run, rank=rank, world_size=ranks)
        if mark:
            ledger.lineage, ledger.lineage_steps = dict(mark["lineage"]), dict(mark["steps"])
        for step in steps:
            ledger.record({"__url__": [f"s{rank}.tar"] * 2, "__ordinal__": [2 * step, 2 * step + 1]}, epoch=0)
            last = ledger.commit(step=step)
        ledgers.append(ledger)
    return last, ledgers
