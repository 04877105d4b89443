"""The dataset identity of the shards a ledger records positions in: each shard's sha256, sample count
and size, from its index. Ledger positions are (shard URL, ordinal): a dataset re-converted under the
same shard names (another seed, ``wdsraft convert --overwrite``) puts other samples at the same
positions, so a ledger of the old one must refuse it rather than skip the wrong samples.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from wdsraft.core.errors import StateMismatchError
from wdsraft.index.shard_index import ShardIndex
from wdsraft.io.threads import map_in_threads

logger = logging.getLogger(__name__)

_warned_once = threading.Event()  # (the index reads run in threads)

Identity = dict[str, Any]  # {"sha256": str | None, "samples": int, "size": int}


def identity_of(url: str) -> Identity | None:
    """A shard's identity from its index, or None where it has no readable index (not checked then)."""
    # ``beside`` as the readers use it: no lookup for pipe:/HTTP shards (a pipe: command with ".idx"
    # appended would run), None for a missing index, a torn one logged and ignored.
    try:
        index = ShardIndex.beside(url)
    except Exception as exn:  # (S3 clients raise their own kinds) the shard is then not checked: say so
        if _warned_once.is_set():
            logger.debug("no dataset identity for %s: %s", url, exn)
        else:
            _warned_once.set()
            logger.warning(
                "could not read the index of %s to check its dataset identity (%s): shards whose index cannot be "
                "read are not checked (further failures are logged at debug level)",
                url,
                exn,
            )
        return None
    if index is None:
        logger.debug("no dataset identity for %s: no index beside it", url)
        return None
    return {"sha256": index.sha256, "samples": index.num_samples, "size": index.size}


def identities_of(urls: Iterable[str]) -> dict[str, Identity | None]:
    """The identities of several shards (index reads in parallel threads: one GET each on S3)."""
    wanted = sorted(set(urls))
    return dict(zip(wanted, map_in_threads(identity_of, wanted), strict=True))


def difference(recorded: Identity, current: Identity) -> str | None:
    """How a shard differs from what a ledger recorded of it, or None where it is the same shard."""
    for field in ("sha256", "samples", "size"):
        before, now = recorded.get(field), current.get(field)
        if before is not None and now is not None and before != now:
            shown = (lambda v: v[:12]) if field == "sha256" else (lambda v: v)
            return f"{field} {shown(before)} recorded, {shown(now)} now"
    return None


class ShardIdentities:
    """What a ledger knows of the shards' identities: recorded by earlier commits, and checked now."""

    def __init__(self, ledger_url: str):
        self.ledger_url = ledger_url
        self.recorded: dict[str, Identity] = {}  # by earlier commits (of this or earlier runs)
        self.checked: dict[str, Identity | None] = {}  # read from the dataset by this process
        self.unrecorded_seen = False  # a commit written before ledgers recorded identities

    def learn(self, commit: dict[str, Any], where: str) -> None:
        """Take in the identities a commit recorded (a commit from before identities were recorded: noted)."""
        shards = commit.get("shards")
        if shards is None:
            if commit.get("epochs") and not self.unrecorded_seen:
                self.unrecorded_seen = True
                logger.warning(
                    "%s was written by an older wdsraft and records no dataset identity: the shards it names "
                    "are not checked against the dataset (a re-converted dataset under the same names would "
                    "go unnoticed for them)",
                    where,
                )
            return
        for url, identity in shards.items():
            self.recorded.setdefault(url, identity)

    def learn_recorded(self, shards: dict[str, Identity], unrecorded: bool, where: str) -> None:
        """Take in identities merged elsewhere (a ledger snapshot, or what another rank read)."""
        if unrecorded and not self.unrecorded_seen:
            self.unrecorded_seen = True
            logger.warning(
                "%s merges commits of an older wdsraft that record no dataset identity: the shards they name "
                "are not checked against the dataset",
                where,
            )
        for url, identity in shards.items():
            self.recorded.setdefault(url, identity)

    def check(self, urls: Iterable[str]) -> dict[str, Identity]:
        """Read the identities of shards not checked yet and compare them with what was recorded; returns
        those newly read (to record). Raises ``StateMismatchError`` naming a shard that differs."""
        fresh = [url for url in urls if url not in self.checked]
        if not fresh:
            return {}
        found = identities_of(fresh)
        for url in sorted(found):
            current, recorded = found[url], self.recorded.get(url)
            why = difference(recorded, current) if recorded is not None and current is not None else None
            if why is not None:
                raise StateMismatchError(
                    f"{url}: not the shard the ledger {self.ledger_url} recorded positions in ({why}): the "
                    "dataset was re-converted or replaced under the same names, and the recorded positions "
                    "would skip other samples. Use a new ledger for this dataset (or restore the old one)"
                )
        self.checked.update(found)
        return {url: identity for url, identity in found.items() if identity is not None}
