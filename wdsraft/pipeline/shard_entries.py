"""A shard list's entries, as the source stage reads them: a URL, or a dict that also says where to start
and stop (``{"url", "offset", "ordinal", "end", "nsamples"}``; an eval split's entries, a ledger's runs).

``TarfileToSamples`` reads shards one at a time, ``ActiveShards`` several at once; both take an entry's
fields and its start from here, so an entry means the same whichever reads it.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from wdsraft.core.errors import IndexFormatError, StateMismatchError
from wdsraft.index.shard_index import INDEX_SUFFIX, ShardIndex

logger = logging.getLogger(__name__)

__all__ = ["OpenedEntry", "ShardEntry", "open_entry", "same_shard", "start_of"]


class ShardEntry(NamedTuple):
    """One entry of a shard list. ``offset`` None: where the index puts sample ``ordinal``; ``ordinal`` None:
    the index's ordinal of the sample at ``offset``; ``end``: the exclusive ordinal to stop at; ``counted``:
    the sample count the list was made by (refused unless the index has it)."""

    url: str
    offset: int | None = 0
    ordinal: int | None = 0
    end: int | None = None
    counted: int | None = None

    @classmethod
    def of(cls, source: Any) -> ShardEntry:
        if not isinstance(source, dict):
            return cls(source)
        return cls(
            source["url"], source.get("offset", 0), source.get("ordinal"), source.get("end"), source.get("nsamples")
        )


def start_of(entry: ShardEntry, index: ShardIndex | None, offset: int | None, ordinal: int | None) -> tuple[int, int]:
    """Where reading ``entry``'s shard starts, (byte offset, ordinal), from ``offset``/``ordinal`` (the entry's,
    or a saved state's) and the shard's index. Where the entry relies on the index (a count to check, an
    offset to look up), a shard without one, or whose index has another count, is refused: the list was
    made from counts read before (a manifest, the indexes when the dataset was built), and a shard that
    changed since would shift every range after it."""
    url = entry.url
    if entry.counted is not None or offset is None:
        if index is None:
            raise IndexFormatError(
                url + INDEX_SUFFIX,
                "the split counted this shard's samples, and the shard has no readable index now to check that "
                "count against (`wdsraft index SHARD` writes one)",
            )
        if entry.counted is not None and index.num_samples != entry.counted:
            raise IndexFormatError(
                url + INDEX_SUFFIX,
                f"the split counted {entry.counted} samples in this shard, its index has {index.num_samples}: the "
                "shard changed since the counts were taken (a stale manifest? `wdsraft index` writes a new one)",
            )
        if offset is None:
            if ordinal is None:
                raise ValueError(f"{url}: a shard entry with no offset needs the ordinal to seek to")
            offset = index.offset_of(ordinal)
    if ordinal is None:  # an offset without its ordinal: the index knows it (else 0, as before indexes)
        ordinal = (index.ordinal_at(offset) if index is not None else None) or 0
    return offset, ordinal


class OpenedEntry(NamedTuple):
    """An entry opened for reading: where its shard's reading starts, where it stops, and the shard's index."""

    url: str
    offset: int
    ordinal: int
    end: int | None
    shard_index: ShardIndex | None


def open_entry(source: Any, number: int, saved: dict[str, Any] | None) -> OpenedEntry | None:
    """Shard list entry ``source`` (shard ``number`` of the epoch) opened for reading: from the entry's start,
    or from ``saved``'s position when a state was taken on this shard (it must be the same shard: name and
    identity), its index read once. None where ``saved`` says the shard was finished."""
    entry = ShardEntry.of(source)
    offset, ordinal = entry.offset, entry.ordinal
    if saved is not None:
        if entry.url != saved["url"]:
            raise StateMismatchError(
                f"shard #{number} of this epoch is {entry.url}, but the saved state was reading {saved['url']}: "
                "the shard list or its order changed"
            )
        if saved.get("done"):
            return None
        offset, ordinal = saved["offset"], saved["ordinal"]
    index = ShardIndex.beside(entry.url)  # once per shard: the readers check against it
    offset, ordinal = start_of(entry, index, offset, ordinal)
    if saved is not None:
        same_shard(entry.url, saved.get("shard"), index.identity if index is not None else None)
    return OpenedEntry(entry.url, offset, ordinal, entry.end, index)


def same_shard(url: str, saved: str | None, identity: str | None) -> None:
    """A state taken on one shard must not resume on another of the same name (a re-converted dataset)."""
    if saved is None:
        return  # (a state from before identities were recorded, or a shard without an index then)
    if identity is None:
        logger.warning("%s: the saved state names the shard %s but it has no index now: not checked", url, saved)
        return
    if saved != identity:
        raise StateMismatchError(
            f"{url}: the saved state was taken on a shard with identity {saved}, this one is {identity}: "
            "the shard was rewritten (same name, other contents)"
        )
