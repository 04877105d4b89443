"""``cache``: keep the items of a small dataset after the first pass, in memory or in a file, and hand
them out from there in later passes (epochraft's ``cache``), checkpointable in both phases.

The first pass reads upstream and fills the cache as items go out; later passes read the cache and
pull nothing from upstream (no shard is opened). A cache is a digest of its items' shard positions
(or pickled bytes, where positions are only numbers in a pass: after a concat, a mix or a WebLoader)
as well as the items, so a cache lost in a restart (in memory, a new process) is rebuilt from
upstream and checked against the digest the state carries, before any item goes out: the stream
before ``cache`` must then be the same every pass, and a different one raises.
On disk, the file is written atomically at the end of a whole pass, named by the pipeline's
configuration before the stage and by the rank and worker, and checked (a SHA-256 of its content,
its configuration, the identities of the shards its items came from) before it is trusted: a torn
file, one of another configuration, or one of shards since rewritten is rebuilt with a warning
naming it. Functions in the configuration are known by name only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

from wdsraft.core.errors import StateMismatchError
from wdsraft.core.state import describe, fingerprint
from wdsraft.index.shard_index import ShardIndex
from wdsraft.io.storage import local_path, write_bytes_atomic
from wdsraft.pipeline.addresses import Address
from wdsraft.pipeline.client import ClientReader
from wdsraft.pipeline.source import TarfileToSamples
from wdsraft.pipeline.stage import AddressTracker, Context, Curried, Stage

logger = logging.getLogger(__name__)

MAGIC = b"WDSRAFT-CACHE-1\n"


class _Filled:
    """A whole pass's items, their addresses (None where they had none), the pass's digest, and, for a
    pass just read (``absolute`` given: whether addresses are shard positions), the URLs of the shards
    the items came from (a shard position, or a ``__url__`` field) and how many items name none."""

    def __init__(self, items: list[Any], addresses: list[Address | None], digest: str, absolute: bool | None = None):
        self.items, self.addresses, self.digest = items, addresses, digest
        self.shards, self.unnamed = _shards_of(items, addresses, absolute) if absolute is not None else ([], 0)


def _shards_of(items: list[Any], addresses: list[Address | None], absolute: bool) -> tuple[list[str], int]:
    """The URLs of the shards ``items`` came from, in order of first use, and how many items do not tell."""
    urls: dict[str, None] = {}
    unknown = 0
    for item, address in zip(items, addresses, strict=True):
        url = address[0] if absolute and address is not None else None
        if url is None and isinstance(item, dict):
            url = item.get("__url__")
        if isinstance(url, str):
            urls[url] = None
        elif isinstance(url, (list, tuple)) and url and all(isinstance(u, str) for u in url):  # (a batch)
            urls.update(dict.fromkeys(url))
        else:
            unknown += 1
    return list(urls), unknown


def shard_identity(url: str) -> str | None:
    """What tells a shard's contents from another's under the same name: its index's identity (sha256),
    else a local file's size and mtime; None for a remote shard without an index, or no file at all."""
    index = ShardIndex.beside(url)
    if index is not None:
        return index.identity
    path = local_path(url)
    if path is None or not os.path.isfile(path):
        return None
    status = os.stat(path)
    return f"size={status.st_size},mtime_ns={status.st_mtime_ns}"


#: The digest of a pass with an item that has neither a shard position nor a pickle: a rebuild cannot be checked.
UNCHECKABLE = "uncheckable"


def _step(digest: str, item: Any, address: Address | None) -> str:
    """The running digest after one more item: its shard position (``address``, given only where it names
    one), or else its pickled bytes."""
    if digest == UNCHECKABLE:
        return digest
    if address is not None:
        material = repr(address).encode()
    else:
        try:
            material = pickle.dumps(item, protocol=4)
        except (pickle.PicklingError, TypeError, AttributeError):
            return UNCHECKABLE  # (refused only if a rebuild must be checked: a run that never resumes is fine)
    return hashlib.blake2b(bytes.fromhex(digest) + material, digest_size=16).hexdigest()


def _absolute(ctx: Context) -> bool:
    """Whether items' addresses are shard positions, the same in any pass and process. After a concat, a
    mix or a WebLoader they are the items' numbers in the pass, which say nothing of what the items were."""
    return isinstance(ctx.source, (TarfileToSamples, ClientReader))


def _copy(item: Any) -> Any:
    """A copy of a sample's dict (or list) of fields, so that a stage after the cache that sets a field in
    place (``sample["txt"] = ...``) changes neither the cache nor later passes; the field values are shared."""
    if isinstance(item, dict):
        return dict(item)
    if isinstance(item, list):
        return list(item)
    return item


class cache(Curried, Stage):
    """Hand out the first pass's items again in later passes, from memory or from files in ``directory``.

    State: the phase (filling or reading), the number of items out in this pass, the running digest of
    a fill, the digest of the whole cache, and whether upstream was read in this pass; never items.
    Limits: the cache is per DataLoader worker (an in-memory one lasts only as long as the worker:
    ``persistent_workers=True``); items are pickled to disk; a pass with a ledger's skip set (elastic
    resume) reads upstream and caches nothing.
    """

    holds_items = False  # (each item goes out as it is read or filled: none waits for a later output)

    def __init__(self, directory: str | os.PathLike[str] | None = None):
        self.directory = None if directory is None else os.fspath(directory)
        self._filled: _Filled | None = None  # the complete cache, once a whole pass filled it
        self._expected = ""  # the digest of a whole pass whose start this process did not see
        self._path: str | None = None
        self._identity = ""
        self._phase, self._index, self._running, self._spent = "fill", 0, "", False

    def config(self) -> dict[str, Any]:
        return {}  # (in memory or on disk, the stream is the same)

    def replay(self, src: Iterator[Any]) -> Iterator[Any]:
        return src

    def state_dict(self) -> dict[str, Any]:
        expected = self._filled.digest if self._filled is not None else self._expected
        return {
            "phase": self._phase,
            "index": self._index,
            "running": self._running,
            "expected": expected,
            "spent": self._spent,
        }

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        if ctx.skip is not None or (state is not None and state["phase"] == "off"):
            # An elastic resume leaves consumed items out: not the cached pass; it goes through, uncached.
            self._phase, self._index, self._running, self._spent = "off", 0, "", True
            return iter(src)
        if self.directory is not None:
            self._identity = self._identity_of(ctx)
            self._path = os.path.join(self.directory, f"cache-{self._identity}.wdsc")
            if self._filled is None:
                self._filled = self._load(self._path, self._identity)
        if state is not None and state["expected"]:
            self._expected = state["expected"]
        if self._filled is not None and self._expected and self._filled.digest != self._expected:
            self._filled = None  # (a cache of another stream: the state's wins, rebuilt and checked)
        if state is None:
            phase = "read" if self._filled is not None or self._expected else "fill"
            index, running, spent = 0, "", False
        else:
            phase, index, running, spent = state["phase"], state["index"], state["running"], state["spent"]
        self._phase, self._index, self._running, self._spent = phase, index, running, spent
        if phase == "read":
            return self._read(ctx, src)
        return self._fill(ctx, src, whole=index == 0)

    # -- the two phases --------------------------------------------------------------------------------

    def _fill(self, ctx: Context, src: Iterator[Any], whole: bool) -> Iterator[Any]:
        tracker = AddressTracker(ctx)
        absolute = _absolute(ctx)
        items: list[Any] = []
        addresses: list[Address | None] = []
        self._spent = True
        for item in src:
            address = tracker.address()
            self._running = _step(self._running, item, address if absolute else None)
            if whole:
                items.append(_copy(item))  # (stages after this one may change the item they get)
                addresses.append(address)
            self._index += 1
            yield item
        if whole:
            self._keep(_Filled(items, addresses, self._running, absolute))
        else:  # resumed mid-fill in a process that did not see the start: a later pass rebuilds, checked
            self._expected = self._running

    def _read(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        if self._filled is None:
            self._rebuild(ctx, src)
        filled = self._filled
        assert filled is not None
        absolute = _absolute(ctx)  # (only shard positions are stamped again: numbers in a pass are not)
        for index in range(self._index, len(filled.items)):
            address = filled.addresses[index]
            if absolute and address is not None:
                ctx.stamp(address)
            else:
                ctx.provenance = None
            self._index = index + 1
            yield _copy(filled.items[index])

    def _rebuild(self, ctx: Context, src: Iterator[Any]) -> None:
        """Read the whole pass from upstream again, and check it is the one the cache held."""
        if self._spent:
            raise StateMismatchError(
                f"cannot resume stage {self.index} (cache): its cache is gone (an in-memory cache in a new "
                "process) and the stream before it was already read in this pass; give cache(directory=...) "
                "so that the cache outlives the process"
            )
        self._spent = True
        tracker = AddressTracker(ctx)
        absolute = _absolute(ctx)
        items, addresses, digest = [], [], ""
        for item in src:
            address = tracker.address()
            digest = _step(digest, item, address if absolute else None)
            items.append(_copy(item))
            addresses.append(address)
        if self._expected == UNCHECKABLE:
            raise StateMismatchError(
                f"stage {self.index} (cache): its cache is gone (an in-memory cache in a new process) and the "
                "items of the pass that filled it could not be pickled, so a rebuild from upstream cannot be "
                "checked against them; make the items before cache() picklable"
            )
        if digest != self._expected:
            raise StateMismatchError(
                f"stage {self.index} (cache): the {len(items)} items before it differ from the pass that "
                "filled the cache, which is gone (an in-memory cache in a new process, or a file removed); "
                "the stream before cache() must be the same every pass (no reshuffle each epoch), or give "
                "cache(directory=...)"
            )
        self._keep(_Filled(items, addresses, digest, absolute))

    # -- keeping it ------------------------------------------------------------------------------------

    def _keep(self, filled: _Filled) -> None:
        self._filled = filled
        self._expected = filled.digest
        if self._path is not None:
            shards = {url: shard_identity(url) for url in filled.shards}
            unchecked = [url for url, identity in shards.items() if identity is None]
            if unchecked:
                logger.warning(
                    "cache: %s: %d shards have no index and are no local file (first: %s): a later run "
                    "cannot tell them rewritten under the same names, and trusts the file for them",
                    self._path,
                    len(unchecked),
                    unchecked[0],
                )
            if filled.unnamed:
                logger.warning(
                    "cache: %s: %d items name no shard (no __url__ field, no shard position): a later run "
                    "trusts the file for them by the configuration's names alone",
                    self._path,
                    filled.unnamed,
                )
            payload = pickle.dumps(
                {
                    "identity": self._identity,
                    "digest": filled.digest,
                    "items": filled.items,
                    "addresses": filled.addresses,
                    "shards": shards,
                },
                protocol=4,
            )
            write_bytes_atomic(self._path, MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
            logger.info("cache: wrote %d items to %s", len(filled.items), self._path)

    def _identity_of(self, ctx: Context) -> str:
        """The configuration before this stage, and the rank and worker: what the cached items depend on."""
        upstream = [
            {"stage": type(stage).__name__, **stage.config()} if isinstance(stage, Stage) else describe(stage)
            for stage in ctx.stages[: self.index]
        ]
        return fingerprint({"stages": upstream, "worker": list(ctx.info)})

    @staticmethod
    def _load(path: str, identity: str) -> _Filled | None:
        """The cache in ``path``, or None: absent, or refused (torn, altered, another configuration), with a
        warning naming the file."""
        try:
            with open(path, "rb") as stream:
                data = stream.read()
        except FileNotFoundError:
            return None
        why = None
        head, _, payload = data.partition(b"\n")
        checksum, _, payload = payload.partition(b"\n")
        if head + b"\n" != MAGIC:
            why = "not a wdsraft cache file"
        elif hashlib.sha256(payload).hexdigest().encode() != checksum:
            why = "its content does not match its checksum (a torn or altered write)"
        else:
            record = pickle.loads(payload)
            if record.get("identity") != identity:
                why = "it was written by another dataset or configuration"
            else:
                why = _changed_shard(record.get("shards"))
                if why is None:
                    return _Filled(record["items"], record["addresses"], record["digest"])
        warnings.warn(f"cache: ignoring {path}: {why}; rebuilding it from the dataset", stacklevel=2)
        return None


def _changed_shard(shards: Any) -> str | None:
    """Why the shards a file's items came from are not the ones there now, or None where they are."""
    if not isinstance(shards, dict):
        return "it records no shard identities (written by an older wdsraft)"
    for url, saved in shards.items():
        if saved is None:
            continue  # (no index then, remote: trusted by name, as the warning at writing said)
        now = shard_identity(url)
        if now != saved:
            return f"shard {url} changed since it was written (identity {saved}, now {now or 'none: gone'})"
    return None
