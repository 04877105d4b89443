"""Every remote reader (s5cmd, boto3 ranged, HTTP) under injected faults, through ``open_shard``: each
fault gives the shard's exact bytes, reopened at the offset reached, or an error naming the shard,
the offset and the remote's reason. Permanent errors are not retried; nothing hangs."""

from __future__ import annotations

import gzip
import logging
import pickle
import time
from pathlib import Path

import pytest
from faultproxy import Drop, Fault, IgnoreRange, Stall, Status, Truncate

import wdsraft
from wdsraft.core.errors import RemoteAccessDeniedError, RemoteNotFoundError, RemoteReadError
from wdsraft.io import remote as remote_module
from wdsraft.io.gopen import open_shard

pytestmark = pytest.mark.timeout(60)

MID = 5000  # bytes into a body where faults strike

FAULTS = {
    "truncated body": Truncate(after=MID),
    "dropped connection": Drop(after=MID),
    "stall mid-body": Stall(after=MID, seconds=30),
    "stall before the headers": Stall(after=None, seconds=30),
    "500": Status(500),
    "503": Status(503),
}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "wdsraft.io.remote" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
def test_a_fault_costs_a_retry_not_a_byte(remote, fault: Fault, caplog) -> None:
    url = remote.urls[0]
    remote.proxy.inject(fault, path=remote.name(url))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), open_shard(url) as stream:
        assert stream.read() == remote.data[url]
    assert time.monotonic() - started < 10  # a stall (30 s) is cut by the 1 s read timeout, not waited out
    gets = remote.proxy.requests(remote.name(url))
    assert [r.fault for r in gets] == [fault, None]  # one faulty response, one retry
    # A clean early end (any reader) or a pipe (s5cmd): every byte sent before the fault was taken, so the
    # retry starts after them. (A reset or a timeout inside one big read may lose what that read buffered.)
    if isinstance(fault, Truncate) or (remote.reader == "s5cmd" and isinstance(fault, (Drop, Stall)) and fault.after):
        assert gets[1].range_start == MID
    elif isinstance(fault, Status) or (isinstance(fault, Stall) and fault.after is None):
        assert gets[1].range_start is None  # nothing came: again from the start
    if remote.reader == "s5cmd":  # the first response is s5cmd's (Go's SDK), the retry the ranged boto3 reader's
        assert "aws-sdk-go" in gets[0].headers["user-agent"] and "Boto3" in gets[1].headers["user-agent"]
    (warning,) = _warnings(caplog)
    assert url in warning and "retry 1 of 3" in warning and "byte offset" in warning


def test_a_fault_after_a_seek_resumes_from_there(remote) -> None:
    url, data = remote.urls[1], remote.data[remote.urls[1]]
    offset = 512 * (len(data) // 1024)  # a block boundary in the middle
    remote.proxy.inject(Truncate(after=MID), path=remote.name(url), range_start=offset)
    remote.proxy.inject(Drop(after=0), path=remote.name(url), range_start=offset + MID)
    with open_shard(url, offset) as stream:
        assert stream.read() == data[offset:]
    starts = [r.range_start for r in remote.proxy.requests(remote.name(url))]
    assert starts[-3:] == [offset, offset + MID, offset + MID]


def test_retries_are_bounded_and_the_error_names_shard_offset_and_reason(remote, caplog) -> None:
    url = remote.urls[0]
    remote.proxy.inject(Truncate(after=MID), path=remote.name(url))
    remote.proxy.inject(Status(503), path=remote.name(url), times=3)  # with the truncation: 4 failures in a row
    with caplog.at_level(logging.WARNING), pytest.raises(RemoteReadError) as caught:
        open_shard(url).read()
    error = caught.value
    assert not isinstance(error, (RemoteNotFoundError, RemoteAccessDeniedError))
    assert (error.url, error.offset, error.status) == (url, MID, 503)
    assert url in str(error) and f"byte offset {MID}" in str(error) and "503" in str(error)
    assert "gave up after 3 retries" in str(error)
    assert len(remote.proxy.requests(remote.name(url))) == 4  # the first response, then WDSRAFT_READ_RETRIES=3
    assert len(_warnings(caplog)) == 3


def test_progress_restarts_the_count(remote) -> None:
    """Three failures in a row are tolerated each time bytes arrive in between (a long flaky read)."""
    url = remote.urls[0]
    for start in (0, MID, 2 * MID):
        remote.proxy.inject(Status(500), path=remote.name(url), times=2, range_start=start or None)
        remote.proxy.inject(Truncate(after=MID), path=remote.name(url), range_start=start or None)
    with open_shard(url) as stream:
        assert stream.read() == remote.data[url]


def test_a_missing_shard_is_not_found_and_not_retried(remote, caplog) -> None:
    url = remote.urls[0].replace("faulty-00", "missing-00")
    with caplog.at_level(logging.WARNING), pytest.raises(RemoteNotFoundError) as caught:
        open_shard(url)
    assert isinstance(caught.value, FileNotFoundError)
    assert caught.value.url == url and caught.value.status == 404
    assert str(caught.value).startswith(f"{url}: not found (404")
    assert len(remote.proxy.requests("missing-00", method=None)) == 1  # no retry
    assert _warnings(caplog) == []


def test_access_denied_is_not_retried(remote, caplog) -> None:
    url = remote.urls[0]
    remote.proxy.inject(Status(403), path=remote.name(url), method=None, times=10)
    with caplog.at_level(logging.WARNING), pytest.raises(RemoteAccessDeniedError) as caught:
        open_shard(url)
    assert isinstance(caught.value, PermissionError)
    assert "access denied (403" in str(caught.value) and caught.value.status == 403
    assert len(remote.proxy.requests(remote.name(url), method=None)) == 1
    assert _warnings(caplog) == []


def test_access_denied_mid_read_is_reported_as_such_by_the_sample_reader(remote) -> None:
    """Through the tar reader too: the remote's reason, not a format error, and at the offset reached."""
    url = remote.urls[0]
    remote.proxy.inject(Truncate(after=MID), path=remote.name(url))
    remote.proxy.inject(Status(403), path=remote.name(url))
    with pytest.raises(RemoteAccessDeniedError) as caught:
        list(wdsraft.ShardSampleReader(url))
    assert not isinstance(caught.value, wdsraft.TarFormatError)
    assert caught.value.offset == MID


def test_an_object_overwritten_mid_read_is_an_error_not_a_splice(remote, put_remote, monkeypatch) -> None:
    """S3: the same size, told apart by the ETag (If-Match); HTTP (this server sends no ETag): by the size."""
    url = remote.urls[0]
    size = len(remote.data[url]) + (1024 if remote.reader == "http" else 0)
    sleep = remote_module.time.sleep

    def overwrite_then_sleep(seconds: float) -> None:  # the backoff before the reopen
        put_remote(remote, remote.name(url), b"x" * size)
        sleep(seconds)

    monkeypatch.setattr(remote_module.time, "sleep", overwrite_then_sleep)
    remote.proxy.inject(Truncate(after=MID), path=remote.name(url))
    with pytest.raises(RemoteReadError, match="object changed during the read") as caught:
        open_shard(url).read()
    assert caught.value.offset == MID
    assert len(remote.proxy.requests(remote.name(url))) == 2  # not retried


def test_errors_keep_their_fields_across_processes() -> None:
    """Errors that cross a process pickled (multiprocessing pools, queues) keep their type and fields."""
    for error in (
        RemoteNotFoundError("s3://b/k", 0, "not found (404 NoSuchKey)", 404),
        RemoteAccessDeniedError("s3://b/k", 0, "access denied (403 AccessDenied)", 403),
        RemoteReadError("http://h/k", 77, "gave up after 5 retries: ConnectionResetError", None),
    ):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert (copy.url, copy.offset, copy.reason, copy.status) == (
            error.url,
            error.offset,
            error.reason,
            error.status,
        )


def test_a_server_that_ignores_range_is_read_and_discarded_up_to_the_offset(remote) -> None:
    url, data = remote.urls[2], remote.data[remote.urls[2]]
    offset = 512 * (len(data) // 1024)
    remote.proxy.inject(IgnoreRange(), path=remote.name(url), range_start=offset)
    with open_shard(url, offset) as stream:
        assert stream.tell() == offset
        assert stream.read() == data[offset:]
    starts = [(r.range_start, type(r.fault).__name__) for r in remote.proxy.requests(remote.name(url))]
    assert starts[-1] == (offset, "IgnoreRange")  # answered with the whole object, read through


def test_a_compressed_shard_resumes_in_stored_bytes(remote, dataset_shards, put_remote) -> None:
    """A gzipped shard: the retry goes on in the compressed bytes, the samples come out whole."""
    plain = dataset_shards[0]
    url = put_remote(remote, "packed-00.tar.gz", gzip.compress(Path(plain).read_bytes()))
    remote.proxy.inject(Truncate(after=MID), path="packed-00")
    remote.proxy.inject(Drop(after=MID), path="packed-00", range_start=MID)
    samples = list(wdsraft.ShardSampleReader(url))
    assert samples == [{**s, "__url__": url} for s in wdsraft.ShardSampleReader(plain)]
    starts = [r.range_start for r in remote.proxy.requests("packed-00")]
    assert starts[1] == MID and starts[2] >= MID  # (the reset may cost bytes buffered in the read it broke)


def test_http_credentials_in_the_url_go_in_a_basic_authorization_header(http_proxy) -> None:
    root, proxy = http_proxy
    (root / "secret.tar").write_bytes(b"x" * 2048)
    url = f"{proxy.url}/secret.tar".replace("http://", "http://reader:p%40ss@")
    with open_shard(url, 1024) as stream:
        assert stream.read() == b"x" * 1024
    requests = proxy.requests("secret.tar")
    assert requests and all(r.headers["authorization"] == "Basic cmVhZGVyOnBAc3M=" for r in requests)  # reader:p@ss
