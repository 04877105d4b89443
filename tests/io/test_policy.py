"""The retry policy: what the variables set, the backoff's growth and bounds, the module override."""

from __future__ import annotations

import pytest

from wdsraft.io import remote
from wdsraft.io.remote import RetryPolicy, read_policy


def test_the_variables_set_the_policy(monkeypatch) -> None:
    monkeypatch.setenv("WDSRAFT_READ_RETRIES", "7")
    monkeypatch.setenv("WDSRAFT_READ_BACKOFF", "0.25")
    monkeypatch.setenv("WDSRAFT_READ_TIMEOUT", "12")
    monkeypatch.setenv("WDSRAFT_CONNECT_TIMEOUT", "3.5")
    assert read_policy() == RetryPolicy(retries=7, backoff=0.25, read_timeout=12, connect_timeout=3.5)
    bad_values = [
        ("WDSRAFT_READ_RETRIES", "many"),
        ("WDSRAFT_READ_RETRIES", "2.5"),
        ("WDSRAFT_READ_BACKOFF", "-1"),
        ("WDSRAFT_READ_TIMEOUT", "nan"),
        ("WDSRAFT_READ_TIMEOUT", "inf"),
    ]
    for name, bad in bad_values:
        monkeypatch.setenv(name, bad)  # (a retry count of 2.5 is refused, not cut to 2)
        with pytest.raises(ValueError, match=f"{name}='{bad}'"):
            read_policy()
        monkeypatch.setenv(name, {"WDSRAFT_READ_RETRIES": "7", "WDSRAFT_READ_BACKOFF": "0.25"}.get(name, "12"))
    monkeypatch.setenv("WDSRAFT_READ_RETRIES", "7.0")  # (a whole number, as a config file may write it)
    assert read_policy().retries == 7


def test_defaults_and_the_module_override(monkeypatch) -> None:
    for name in ("WDSRAFT_READ_RETRIES", "WDSRAFT_READ_BACKOFF", "WDSRAFT_READ_TIMEOUT", "WDSRAFT_CONNECT_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert read_policy() == RetryPolicy(retries=5, backoff=0.5, read_timeout=60, connect_timeout=10)
    mine = RetryPolicy(retries=1)
    monkeypatch.setattr(remote, "POLICY", mine)
    assert read_policy() is mine


def test_backoff_doubles_jittered_and_capped() -> None:
    policy = RetryPolicy(backoff=1.0, backoff_max=5.0)
    for attempt, full in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (9, 5.0)]:
        delays = [policy.delay(attempt) for _ in range(200)]
        assert all(full / 2 <= d <= full for d in delays)
        assert max(delays) - min(delays) > full / 10  # jittered: workers that failed together spread out


def test_the_s3_reader_client_pools_a_connection_per_concurrent_read() -> None:
    """Indexes are read 32 at a time (EvalDataset, the ledger's identity checks) through the reader's client:
    with boto3's pool of 10, urllib3 dropped a connection (a new TLS handshake, a warning) per read beyond it."""
    from wdsraft.io.s3 import s3_reader_client
    from wdsraft.io.threads import CONCURRENCY

    assert s3_reader_client(1.0, 1.0).meta.config.max_pool_connections >= CONCURRENCY


def test_a_process_forked_while_a_client_is_being_made_can_make_its_own() -> None:
    """The pooled S3 client is made under a lock; a fork while another thread holds it (a DataLoader starting
    its workers while the training process opens a shard) gives the child a lock of its own, not a held one."""
    import multiprocessing

    from wdsraft.io import s3

    def child() -> None:
        s3.s3_pooled_client(2)  # (made, not used: no request is sent)

    with s3._pooled_lock:  # (as if another thread were making a client right now)
        process = multiprocessing.get_context("fork").Process(target=child)
        process.start()
    process.join(timeout=60)
    if process.is_alive():
        process.kill()
    assert process.exitcode == 0
