"""Where a sample lives: its shard, its ordinal in that shard, and the byte offset of its first header.

Every sample read by wdsraft carries its position in two plain-int fields beside webdataset's
``__key__`` and ``__url__``, so that later stages (shuffle state, packing provenance, the
ledger) can name it without holding its bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

ORDINAL_FIELD = "__ordinal__"
OFFSET_FIELD = "__offset__"
# Set by the reader on a document a ledger says was delivered in part: the first token still owed.
TOKEN_START_FIELD = "__token_start__"
# A sequence's list of document pieces (address and token span each), carried to the batch.
PROVENANCE_FIELD = "__provenance__"
# Set by ``interleave_datasets`` on dict samples: the index of the source a sample came from, and that
# source's pass (a source repeated within one epoch serves a position once per pass).
SOURCE_FIELD = "__source__"
PASS_FIELD = "__pass__"


def pass_key(url: str, pass_number: int) -> str:
    """The shard key a ledger records a position of a source's pass under: the URL for the first pass,
    ``URL#pass=N`` for the later ones (so one epoch's consumed set tells the passes apart)."""
    return url if not pass_number else f"{url}#pass={int(pass_number)}"


def split_pass_key(key: str) -> tuple[str, int]:
    """A ledger's shard key as (shard URL, pass): ``pass_key``'s inverse."""
    head, sep, tail = key.rpartition("#pass=")
    return (head, int(tail)) if sep and head and tail.isdigit() else (key, 0)


def shard_of_key(key: str) -> str:
    """The shard URL of a ledger's shard key (for reading the shard itself)."""
    return split_pass_key(key)[0]


class Position(NamedTuple):
    """A sample's address: ``shard`` URL, dense ``ordinal`` within it, ``offset`` of its first header."""

    shard: str
    ordinal: int
    offset: int

    @classmethod
    def of(cls, sample: Mapping[str, Any]) -> Position:
        """The position of a sample produced by a wdsraft reader."""
        try:
            return cls(sample["__url__"], sample[ORDINAL_FIELD], sample[OFFSET_FIELD])
        except KeyError as missing:
            raise KeyError(f"sample {sample.get('__key__')!r} carries no position field {missing}") from None
