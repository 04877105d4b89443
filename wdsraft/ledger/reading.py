"""Reading many small ledger objects: listing a ledger's rank files (all, or those of some runs) and
fetching them in parallel, with bounded concurrency and retries. A resume or ``wdsraft ledger show`` may
read thousands of files: one after another, each costs a full round trip (20-40 ms on an object store).
"""

from __future__ import annotations

import functools
import logging
import os
import posixpath
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, TypeVar

from wdsraft.io.environment import number_from_env
from wdsraft.io.s3 import list_objects, s3_client, s3_pooled_client, split_s3_url
from wdsraft.io.storage import local_path
from wdsraft.io.threads import CONCURRENCY, map_in_threads

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def ledger_concurrency() -> int:
    """Objects the ledger reads at once per process (also the size of the S3 connection pool the reads share):
    ``WDSRAFT_LEDGER_CONCURRENCY``, read when the ledger first reads (a bad value stops the ledger, not every
    ``import wdsraft``)."""
    return number_from_env("WDSRAFT_LEDGER_CONCURRENCY", CONCURRENCY, minimum=1)


#: Attempts per object for failures other than "not there" (a throttled or reset request, say).
ATTEMPTS = 4

RANK_SUFFIX = ".ledger"

T = TypeVar("T")
U = TypeVar("U")


def _client() -> Any:
    """The S3 client the ledger's reads share: a connection per read at once, and one attempt per request
    (``read_bytes`` retries the whole GET, body included, ``ATTEMPTS`` times in all)."""
    return s3_pooled_client(ledger_concurrency())


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
            response = _client().get_object(Bucket=bucket, Key=key)
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
    function: Callable[[U], T], urls: Iterable[U], progress: str | None = None, concurrency: int | None = None
) -> Iterator[T]:
    """``function(url)`` of each URL, in order, ``concurrency`` at once (by default ``ledger_concurrency()``, the
    connection pool's size)."""
    return map_in_threads(function, urls, progress, concurrency or ledger_concurrency())


def list_rank_files(path: str, runs: Iterable[str] | None = None) -> list[str]:
    """URLs of the rank files under a ledger ``path``, sorted: all of them, or only those of ``runs``
    (one listing per run: a resume reads the runs of its lineage, not the whole ledger)."""
    listing = RankListing(path)
    return listing.everything() if runs is None else listing.urls(runs)


class Listed(NamedTuple):
    """One rank file of a listing."""

    url: str
    run: str | None  # the run of the ``run-RUN`` folder it is in (None: in none)
    name: str  # its name within that folder
    size: int | None  # bytes; None where the listing does not give it (a local directory's: see ``sizes``)


class RankListing:
    """The rank files of a ledger, each run listed at most once (one command asks for the same runs at
    several points: sizes to compare, files to read, a snapshot's runs to read on top of it)."""

    def __init__(self, path: str):
        self.path = path
        self._runs: dict[str, list[Listed]] = {}
        self._whole: list[Listed] | None = None  # every run, from one listing of the ledger
        self._grouped: dict[str, list[Listed]] | None = None  # ``_whole`` by run
        self._sizes: dict[str, dict[int, int]] = {}  # run -> rank -> bytes, where asked for

    def everything(self) -> list[str]:
        """Every rank file's URL (one listing of the whole ledger)."""
        if self._whole is None:
            self._whole = _list(self.path, None)
        return [item.url for item in self._whole]

    def of(self, runs: Iterable[str]) -> dict[str, list[Listed]]:
        """The rank files of each of ``runs``, listed in parallel where not listed already."""
        chosen = sorted(set(runs))
        if self._whole is not None:  # (a run not in it has no rank file)
            if self._grouped is None:
                self._grouped = {}
                for item in self._whole:
                    if item.run is not None:
                        self._grouped.setdefault(item.run, []).append(item)
            return {run: self._grouped.get(run, []) for run in chosen}
        missing = [run for run in chosen if run not in self._runs]
        self._runs.update(zip(missing, parallel_map(functools.partial(_list, self.path), missing), strict=True))
        return {run: self._runs[run] for run in chosen}

    def urls(self, runs: Iterable[str]) -> list[str]:
        return sorted(item.url for found in self.of(runs).values() for item in found)

    def sizes(self, run: str) -> dict[int, int]:
        """Each rank of a run and the size of its file in bytes. Local files are stat'ed here, once, in
        parallel: only a comparison with a snapshot needs sizes, a resume only reads the files."""
        if run not in self._sizes:
            ranks = {}
            for item in self.of([run])[run]:
                digits = item.name[len("rank-") : -len(RANK_SUFFIX)]
                if item.name.startswith("rank-") and item.name.endswith(RANK_SUFFIX) and digits.isdigit():
                    ranks[int(digits)] = item
            unknown = [item for item in ranks.values() if item.size is None]  # (local files; S3 listed them)
            stated = dict(zip((item.url for item in unknown), parallel_map(_size, unknown), strict=True))
            self._sizes[run] = {rank: stated.get(item.url, item.size) for rank, item in ranks.items()}  # type: ignore[misc]
        return self._sizes[run]


def _size(item: Listed) -> int:
    """A listed file's size: from the listing (S3), or stat'ed (a local file)."""
    if item.size is not None:
        return item.size
    return os.stat(item.url).st_size


def _list(path: str, run: str | None) -> list[Listed]:
    """The rank files of one run, or of every run (``run`` None): one listing (of a directory per run where
    local, names only; of a prefix on S3, where sizes come with the names)."""
    local = local_path(path)
    if local is not None:
        if not os.path.isdir(local):
            return []
        found = []
        names = [f"run-{run}"] if run is not None else sorted(os.listdir(local))
        for name in names:
            directory = os.path.join(local, name)
            if name.startswith("run-") and os.path.isdir(directory):
                files = sorted(f for f in os.listdir(directory) if f.endswith(RANK_SUFFIX))
                found += [Listed(os.path.join(directory, f), name[len("run-") :], f, None) for f in files]
        return found
    bucket, prefix = split_s3_url(path)
    # (a ledger at the bucket's root lists the whole bucket: Prefix="/" would list nothing)
    base = prefix.rstrip("/") + "/" if prefix else ""
    if run is not None:
        base += f"run-{run}/"
    found = []
    for item in list_objects(f"s3://{bucket}/{base}"):
        if item.key.endswith(RANK_SUFFIX):
            folder, _, name = item.name.partition("/") if run is None else (f"run-{run}", "/", item.name)
            in_run = folder.startswith("run-") and bool(name)
            found.append(Listed(item.url, folder[len("run-") :] if in_run else None, name, item.size))
    return found


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
    paginator = s3_client().get_paginator("list_objects_v2")  # (a listing: boto3's own retries, as list_objects)
    runs = []
    for page in paginator.paginate(Bucket=bucket, Prefix=base, Delimiter="/"):
        for common in page.get("CommonPrefixes", []):
            name = common["Prefix"][len(base) :].rstrip("/")
            if name.startswith("run-"):
                runs.append(name[len("run-") :])
    return sorted(runs)
