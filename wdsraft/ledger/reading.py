"""Reading many small ledger objects: listing a ledger's rank files (all, or those of some runs) and
fetching them in parallel, with bounded concurrency and retries. A resume or ``wdsraft ledger show`` may
read thousands of files: one after another, each costs a full round trip (20-40 ms on an object store).
"""

from __future__ import annotations

import functools
import logging
import os
import posixpath
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from wdsraft.io.ranged import split_s3_url
from wdsraft.io.s3 import list_objects, s3_endpoint_url
from wdsraft.io.storage import local_path
from wdsraft.io.threads import map_in_threads

logger = logging.getLogger(__name__)

#: Objects read at once per process (also the size of the S3 connection pool the reads share).
CONCURRENCY = int(os.environ.get("WDSRAFT_LEDGER_CONCURRENCY", "32"))

#: Attempts per object for failures other than "not there" (a throttled or reset request, say).
ATTEMPTS = 4

RANK_SUFFIX = ".ledger"

T = TypeVar("T")


_client_lock = threading.Lock()


def _client(pid: int, endpoint_url: str | None, pool: int) -> Any:
    """A boto3 client whose connection pool holds ``pool`` connections (boto3's default, 10, would
    serialise a pool of 32 reading threads); one per process, as clients must not cross a fork. Made
    under a lock: the first reads start in many threads at once, and each would make its own."""
    with _client_lock:
        return _make_client(pid, endpoint_url, pool)


@functools.lru_cache(maxsize=4)
def _make_client(pid: int, endpoint_url: str | None, pool: int) -> Any:
    import boto3
    from botocore.config import Config

    # (boto3 retries nothing here: read_bytes retries the whole GET, body included, ATTEMPTS times in all)
    config = Config(max_pool_connections=pool, retries={"total_max_attempts": 1, "mode": "standard"})
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


def _missing(exn: BaseException) -> bool:
    if isinstance(exn, FileNotFoundError):
        return True
    code = getattr(exn, "response", {}).get("Error", {}).get("Code")
    return code in ("404", "NoSuchKey", "NotFound")


def read_bytes(url: str) -> bytes:
    """One object's bytes (a local file, or an S3 object in one GET), retried on transient failures;
    a missing object raises ``FileNotFoundError`` naming it."""
    path = local_path(url)
    for attempt in range(ATTEMPTS):  # (shared filesystems fail transiently too: local reads are retried)
        try:
            if path is not None:
                with open(path, "rb") as stream:
                    return stream.read()
            bucket, key = split_s3_url(url)
            response = _client(os.getpid(), s3_endpoint_url(), CONCURRENCY).get_object(Bucket=bucket, Key=key)
            return bytes(response["Body"].read())
        except Exception as exn:
            if _missing(exn):
                raise FileNotFoundError(2, "No such file or object", url) from None
            if attempt + 1 == ATTEMPTS:
                raise
            logger.debug("reading %s failed (%s): retrying", url, exn)
            time.sleep(0.1 * 2**attempt)
    raise AssertionError("unreachable")


def read_optional(url: str) -> bytes | None:
    """``read_bytes``, or None where the object is not there."""
    try:
        return read_bytes(url)
    except FileNotFoundError:
        return None


def parallel_map(
    function: Callable[[str], T], urls: Iterable[str], progress: str | None = None, concurrency: int = CONCURRENCY
) -> Iterator[T]:
    """``function(url)`` of each URL, in order, ``WDSRAFT_LEDGER_CONCURRENCY`` at once (the connection pool's size)."""
    return map_in_threads(function, urls, progress, concurrency)


def list_rank_files(path: str, runs: Iterable[str] | None = None) -> list[str]:
    """URLs of the rank files under a ledger ``path``, sorted: all of them, or only those of ``runs``
    (one listing per run: a resume reads the runs of its lineage, not the whole ledger)."""
    if runs is None:
        return _list(path, None)
    chosen = sorted(set(runs))
    return sorted(url for found in parallel_map(functools.partial(_list, path), chosen) for url in found)


def _list(path: str, run: str | None) -> list[str]:
    local = local_path(path)
    if local is not None:
        if not os.path.isdir(local):
            return []
        found = []
        names = [f"run-{run}"] if run is not None else sorted(os.listdir(local))
        for name in names:
            directory = os.path.join(local, name)
            if name.startswith("run-") and os.path.isdir(directory):
                found += [os.path.join(directory, f) for f in sorted(os.listdir(directory)) if f.endswith(RANK_SUFFIX)]
        return found
    bucket, prefix = split_s3_url(path)
    # (a ledger at the bucket's root lists the whole bucket: Prefix="/" would list nothing)
    base = prefix.rstrip("/") + "/" if prefix else ""
    if run is not None:
        base += f"run-{run}/"
    return [item.url for item in list_objects(f"s3://{bucket}/{base}") if item.key.endswith(RANK_SUFFIX)]


def list_under(path: str, folder: str) -> list[str]:
    """URLs of the objects directly in ``path/folder`` (local or S3)."""
    url = posixpath.join(path, folder)
    local = local_path(url)
    if local is not None:
        return sorted(os.path.join(local, f) for f in os.listdir(local)) if os.path.isdir(local) else []
    return [item.url for item in list_objects(url.rstrip("/") + "/", delimiter="/")]


def list_runs(path: str) -> list[str]:
    """The run ids of a ledger (its ``run-RUN`` folders), in one listing."""
    local = local_path(path)
    if local is not None:
        names = sorted(os.listdir(local)) if os.path.isdir(local) else []
        return [n[len("run-") :] for n in names if n.startswith("run-") and os.path.isdir(os.path.join(local, n))]
    bucket, prefix = split_s3_url(path)
    base = prefix.rstrip("/") + "/" if prefix else ""
    paginator = _client(os.getpid(), s3_endpoint_url(), CONCURRENCY).get_paginator("list_objects_v2")
    runs = []
    for page in paginator.paginate(Bucket=bucket, Prefix=base, Delimiter="/"):
        for common in page.get("CommonPrefixes", []):
            name = common["Prefix"][len(base) :].rstrip("/")
            if name.startswith("run-"):
                runs.append(name[len("run-") :])
    return sorted(runs)


def list_objects_sized(prefix_url: str) -> list[tuple[str, int]]:
    """(name after the prefix, size) of the objects directly under an S3 prefix."""
    return [(item.name, item.size) for item in list_objects(prefix_url, delimiter="/")]
