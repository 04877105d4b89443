"""A multi-shard dataset read with ``wdsraft.WebDataset`` through faults, for every remote reader: all
samples exactly once, sample by sample as a clean read gives them, also after a resume from a state
saved mid-shard; when the retries run out, the named error goes to the handler."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from faultproxy import Drop, Stall, Status, Truncate

import wdsraft
from wdsraft.core.errors import RemoteReadError

pytestmark = pytest.mark.timeout(90)


def _dataset(urls: list[str], **kw) -> wdsraft.WebDataset:
    return wdsraft.WebDataset(urls, shardshuffle=False, **kw)


def _assert_same(got: list[dict], want: list[dict]) -> None:
    assert [s["__key__"] for s in got] == [s["__key__"] for s in want]
    for mine, theirs in zip(got, want, strict=True):
        assert mine == theirs, mine["__key__"]


def test_every_sample_exactly_once_under_faults(remote) -> None:
    clean = list(_dataset(remote.urls))
    assert len(clean) == 72
    first, second, third = (remote.name(url) for url in remote.urls)
    proxy = remote.proxy
    proxy.clear()
    proxy.inject(Truncate(after=20_000), path=first)
    proxy.inject(Drop(after=30_000), path=second)
    proxy.inject(Status(503), path=second)  # the retry fails too
    proxy.inject(Stall(after=40_000, seconds=30), path=third)
    _assert_same(list(_dataset(remote.urls)), clean)
    assert sum(r.fault is not None for r in proxy.log) == 4


def _state_in_second_shard(remote) -> tuple[list[dict], list[dict], dict, int]:
    """The clean read, its first 30 samples, the state after them (inside the second shard), and the byte
    offset of the next sample there."""
    clean = list(_dataset(remote.urls))
    dataset = _dataset(remote.urls)
    stream = iter(dataset)
    head = [next(stream) for _ in range(30)]
    state = dataset.state_dict()
    offset = clean[30]["__offset__"]
    assert offset > 0 and clean[30]["__url__"] == remote.urls[1]
    return clean, head, state, offset


def _put_indexes(remote, put_remote) -> None:
    """Each shard's index beside it on the remote."""
    for url in remote.urls:
        local = next(p for p in remote.local_paths if p.endswith(remote.name(url)))
        put_remote(remote, remote.name(url) + ".idx", Path(local + ".idx").read_bytes())


def test_resume_mid_shard_through_faults(remote) -> None:
    clean, head, state, offset = _state_in_second_shard(remote)
    proxy = remote.proxy
    proxy.clear()
    proxy.inject(Truncate(after=7_000), path=remote.name(remote.urls[1]), range_start=offset)
    proxy.inject(Drop(after=0), path=remote.name(remote.urls[2]))
    resumed = _dataset(remote.urls)
    resumed.load_state_dict(state)
    _assert_same(head + list(resumed), clean)
    starts = [r.range_start for r in proxy.requests(remote.name(remote.urls[1]))]
    assert offset in starts and offset + 7_000 in starts  # a seek to the saved sample, then a resume past the cut
    assert sum(r.fault is not None for r in proxy.log) == 2


def test_spent_retries_raise_the_named_error_through_the_handler(remote) -> None:
    bad = remote.urls[1]
    remote.proxy.inject(Truncate(after=9_000), path=remote.name(bad))
    remote.proxy.inject(Status(503), path=remote.name(bad), times=10)
    with pytest.raises(RemoteReadError) as caught:
        list(_dataset(remote.urls))
    assert caught.value.url == bad and caught.value.offset == 9_000 and caught.value.status == 503
    remote.proxy.clear()
    remote.proxy.inject(Status(503), path=remote.name(bad), method=None, times=10)
    kept = list(_dataset(remote.urls, handler=wdsraft.ignore_and_continue))
    assert [s["__url__"] for s in kept] == [remote.urls[0]] * 24 + [remote.urls[2]] * 24


@pytest.mark.parametrize("remote", ["s5cmd", "boto3"], indirect=True)
def test_loader_workers_retry_and_report_in_their_processes(remote) -> None:
    """Two DataLoader workers (forked; boto3 clients are per process) read through faults: every sample
    once; a shard that stays denied reaches the training process named, with its reason."""
    clean = {s["__key__"]: s for s in _dataset(remote.urls)}
    remote.proxy.clear()
    for url in remote.urls:
        remote.proxy.inject(Truncate(after=11_000), path=remote.name(url))
    loader = wdsraft.WebLoader(_dataset(remote.urls), batch_size=None, num_workers=2)
    got = list(loader)
    assert sorted(s["__key__"] for s in got) == sorted(clean)
    assert all(s == clean[s["__key__"]] for s in got)
    assert sum(r.fault is not None for r in remote.proxy.log) == 3
    remote.proxy.inject(Status(403), path=remote.name(remote.urls[2]), method=None, times=50)
    # torch re-raises a worker's error whose constructor takes more than a message as a RuntimeError
    # carrying the original type, message and traceback (so it does with TarFormatError)
    with pytest.raises((RemoteReadError, RuntimeError)) as caught:
        list(wdsraft.WebLoader(_dataset(remote.urls), batch_size=None, num_workers=2))
    text = str(caught.value)
    assert "RemoteAccessDeniedError" in text and f"{remote.urls[2]}: access denied (403" in text


@pytest.mark.parametrize("remote", ["s5cmd", "boto3"], indirect=True)
@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "no-index"])
def test_an_index_read_is_retried_like_its_shard(remote, put_remote, indexed: bool) -> None:
    """Indexes (and manifests, ledger files) on S3 are read with the same retries as shards: a dropped
    index request costs a retry, not the epoch (the probe for a missing index, dropped, used to end the
    read with urllib3's unnamed ProtocolError)."""
    clean = list(_dataset(remote.urls))
    if indexed:
        _put_indexes(remote, put_remote)
    index = remote.name(remote.urls[1]) + ".idx"
    remote.proxy.clear()  # (the clean read asked for the indexes too)
    remote.proxy.inject(Drop(after=0), path=index)
    remote.proxy.inject(Stall(after=None, seconds=30), path=index)  # cut by the 1 s read timeout, then a retry
    started = time.monotonic()
    _assert_same(list(_dataset(remote.urls)), clean)
    assert time.monotonic() - started < 10  # smart_open's own retries waited out boto3's 60 s read timeout
    assert len(remote.proxy.requests(index)) == 3  # the drop, the stall, then the retry that reads it


def test_a_resume_into_an_indexed_remote_shard_reads_it_from_the_offset_only(remote, put_remote) -> None:
    """On S3, an index that says the shard is a plain tar spares the look at its first bytes (a request from
    byte 0 before the ranged one from the offset). HTTP shards' indexes are not looked up (a missing one
    cannot be told from a failure there): their first bytes are still looked at."""
    _put_indexes(remote, put_remote)
    clean, head, state, offset = _state_in_second_shard(remote)
    remote.proxy.clear()
    resumed = _dataset(remote.urls)
    resumed.load_state_dict(state)
    _assert_same(head + list(resumed), clean)
    shard = remote.name(remote.urls[1])
    reads = [r.range_start or 0 for r in remote.proxy.requests(shard) if not r.path.endswith(".idx")]
    assert reads == ([0, offset] if remote.reader == "http" else [offset]), reads
