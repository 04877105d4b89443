"""Seeking into a remote shard that has an index: one request for the shard's bytes, from the offset."""

from __future__ import annotations

from pathlib import Path

import pytest

import wdsraft

pytestmark = pytest.mark.timeout(90)


def test_a_resume_into_an_indexed_remote_shard_reads_it_from_the_offset_only(remote, put_remote) -> None:
    """On S3, an index that says the shard is a plain tar spares the look at its first bytes (a request from
    byte 0 before the ranged one from the offset). HTTP shards' indexes are not looked up (a missing one
    cannot be told from a failure there): their first bytes are still looked at."""
    for url in remote.urls:
        local = next(p for p in remote.local_paths if p.endswith(remote.name(url)))
        put_remote(remote, remote.name(url) + ".idx", Path(local + ".idx").read_bytes())
    clean = list(wdsraft.WebDataset(remote.urls, shardshuffle=False))
    dataset = wdsraft.WebDataset(remote.urls, shardshuffle=False)
    stream = iter(dataset)
    head = [next(stream) for _ in range(30)]  # into the second shard
    state = dataset.state_dict()
    del stream
    offset = clean[30]["__offset__"]
    assert offset > 0 and clean[30]["__url__"] == remote.urls[1]
    remote.proxy.clear()
    resumed = wdsraft.WebDataset(remote.urls, shardshuffle=False)
    resumed.load_state_dict(state)
    assert [s["__key__"] for s in head + list(resumed)] == [s["__key__"] for s in clean]
    shard = remote.name(remote.urls[1])
    reads = [r.range_start or 0 for r in remote.proxy.requests(shard) if not r.path.endswith(".idx")]
    assert reads == ([0, offset] if remote.reader == "http" else [offset]), reads
