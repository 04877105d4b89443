"""What training consumed: a set of (shard, ordinal) positions per epoch as roaring bitmaps, plus the
tokens delivered of documents cut across checkpoints, and the positions a delivered batch carries.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pyroaring import BitMap

from wdsraft.core.errors import LedgerError, StateMismatchError
from wdsraft.core.fields import ORDINAL_FIELD, PASS_FIELD, PROVENANCE_FIELD, TOKEN_START_FIELD, pass_key

logger = logging.getLogger(__name__)


@dataclass
class ConsumedSet:
    """What one epoch consumed: whole samples per shard, and documents delivered in part (tokens)."""

    samples: dict[str, BitMap] = field(default_factory=dict)
    tokens: dict[str, dict[int, int]] = field(default_factory=dict)  # shard -> ordinal -> tokens delivered

    def add_samples(self, shard: str, ordinals: Iterable[int]) -> None:
        self.samples.setdefault(shard, BitMap()).update(ordinals)

    def add_tokens(self, shard: str, ordinal: int, token_end: int) -> None:
        per_shard = self.tokens.setdefault(shard, {})
        per_shard[ordinal] = max(per_shard.get(ordinal, 0), token_end)

    def update(self, other: ConsumedSet) -> None:
        for shard, ordinals in other.samples.items():
            self.samples.setdefault(shard, BitMap()).update(ordinals)
        for shard, partial in other.tokens.items():
            for ordinal, end in partial.items():
                self.add_tokens(shard, ordinal, end)
        # A document delivered in part at one commit and whole at a later one is whole, not also partial
        # (only the shards ``other`` touched can have changed: merging commits one by one stays linear).
        for touched in other.samples.keys() | other.tokens.keys():
            kept, done = self.tokens.get(touched), self.samples.get(touched)
            if kept and done:
                for ordinal in [o for o in kept if o in done]:
                    del kept[ordinal]
                if not kept:
                    del self.tokens[touched]

    def is_consumed(self, shard: str, ordinal: int) -> bool:
        bitmap = self.samples.get(shard)
        return bitmap is not None and ordinal in bitmap

    def tokens_consumed(self, shard: str, ordinal: int) -> int:
        return self.tokens.get(shard, {}).get(ordinal, 0)

    def skipped_in(self, url: str) -> BitMap | None:
        """The source's ``SkipSet``: the ordinals of ``url`` consumed whole."""
        return self.samples.get(url)

    def marks_in(self, url: str) -> dict[int, dict[str, int]] | None:
        """The source's ``SkipSet``: documents of ``url`` delivered in part, marked with the first
        token still owed, so that the sequence stages continue them there."""
        partial = self.tokens.get(url)
        return {ordinal: {TOKEN_START_FIELD: end} for ordinal, end in partial.items() if end} if partial else None

    def count(self) -> int:
        return sum(len(b) for b in self.samples.values())

    def __bool__(self) -> bool:
        return bool(self.samples) or bool(self.tokens)

    def to_plain(self) -> dict[str, Any]:
        tokens = {}
        for shard, partial in self.tokens.items():
            done = self.samples.get(shard, BitMap())
            kept = [[o, e] for o, e in sorted(partial.items()) if o not in done]
            if kept:
                tokens[shard] = kept
        for bitmap in self.samples.values():
            bitmap.run_optimize()  # consumed ordinals come in long runs: a few bytes per run, not 2 per sample
        return {"samples": {s: b.serialize() for s, b in self.samples.items() if b}, "tokens": tokens}

    @classmethod
    def from_plain(cls, record: dict[str, Any]) -> ConsumedSet:
        return cls(
            {shard: BitMap.deserialize(raw) for shard, raw in record["samples"].items()},
            {shard: {o: e for o, e in pairs} for shard, pairs in record["tokens"].items()},
        )


def positions_of(batch: Any) -> list[tuple[str, int, int | None, bool]]:
    """The positions a delivered batch holds: ``(shard, ordinal, token_end, whole)`` each.

    Works for batches of LLM sequences (``__provenance__``) and batches or single samples
    that keep ``__url__`` and ``__ordinal__`` (webdataset's dict collation does). A sample of a later
    pass of an ``interleave_datasets`` source (``__pass__`` > 0) is named by ``pass_key(url, pass)``.
    """
    if isinstance(batch, dict) and PROVENANCE_FIELD in batch:
        return _piece_positions(_pieces(batch))
    if isinstance(batch, dict) and "__url__" in batch and ORDINAL_FIELD in batch:
        urls, ordinals = batch["__url__"], batch[ORDINAL_FIELD]
        # (a source that interleave_datasets repeats: its later passes are recorded apart, see pass_key)
        passes = batch.get(PASS_FIELD)
        if isinstance(urls, str):
            return [(pass_key(urls, int(passes or 0)), int(ordinals), None, True)]
        passes = [0] * len(urls) if passes is None else passes
        return [
            (pass_key(url, int(number)), int(ordinal), None, True)
            for url, ordinal, number in zip(urls, ordinals, passes, strict=True)
        ]
    raise StateMismatchError(
        "the ledger needs the position of every delivered sample: keep '__url__' and '__ordinal__' in the "
        "samples (for example to_tuple(..., '__url__', '__ordinal__') is not enough; batch dicts instead), "
        "or deliver LLM sequences, which carry '__provenance__'"
    )


def _piece_positions(pieces: list[list[Any]]) -> list[tuple[str, int, int | None, bool]]:
    return [(url, ordinal, end, bool(last)) for url, ordinal, _offset, _start, end, last in pieces]


def _pieces(batch: dict[str, Any]) -> list[list[Any]]:
    """The provenance entries of a sequence or a batch of sequences, in order."""
    pieces = batch[PROVENANCE_FIELD]
    if pieces and isinstance(pieces[0], list) and pieces[0] and isinstance(pieces[0][0], list):
        return [piece for sequence in pieces for piece in sequence]  # a batch of sequences
    return list(pieces)


class PieceOrder:
    """Checks that each document's pieces reach the training loop in token order.

    The ledger records a partly delivered document as its delivered prefix. A shuffle after the
    sequence stages (``WebLoader(...).unbatched().shuffle(n)``) can hand out a later piece first:
    recording it would mark the gap consumed, and an elastic resume would lose those tokens. Such
    a run is stopped with an explanation instead. Remembers the recent partly delivered documents
    (a shuffle reorders within its buffer, far fewer than this).
    """

    capacity = 1 << 16

    def __init__(self) -> None:
        self.next_token: collections.OrderedDict[tuple[int, str, int], int] = collections.OrderedDict()

    def check(self, pieces: list[list[Any]], epoch: int) -> None:
        for url, ordinal, _offset, start, end, last in pieces:
            key = (epoch, url, ordinal)  # (a document whose tail chunk() dropped starts afresh next epoch)
            expected = self.next_token.pop(key, None)
            # A gap loses tokens; a piece starting earlier repeats delivered ones (resampled shards read a
            # document twice, maybe interleaved across workers) and loses none.
            if expected is not None and start > expected:
                raise LedgerError(
                    "ledger",
                    f"document {ordinal} of {url}: tokens {start}-{end} reached the training loop while the next "
                    f"undelivered token is {expected}. Its pieces arrive out of order, as a shuffle after the "
                    "sequence stages makes them (WebLoader(...).unbatched().shuffle(n)); the ledger keeps a "
                    "delivered prefix per document and would lose the gap on an elastic resume. Shuffle documents "
                    "before tokenize/packing instead, or resume such a run exactly only (without the ledger).",
                )
            if not last:
                self.next_token[key] = max(end, expected or 0)
                if len(self.next_token) > self.capacity:
                    self.next_token.popitem(last=False)


def refuse_repeats(shard: str, ordinals: list[int], recorded: BitMap | None, epoch: int) -> BitMap:
    """Stops a run that delivers a whole sample twice in one epoch before the ledger records it; returns
    the batch's ordinals as a bitmap (``add_samples`` takes it: the ordinals are not turned into one twice).

    The ledger counts whole samples: a sample split into several items (``unlisted``, a flat-map, a
    ``concat_datasets`` of one dataset twice) is marked consumed with its first item, so an elastic
    resume after a checkpoint between its items would skip the rest. Seen within one batch or
    between the commits' batches (a split's items mostly travel close together)."""
    batch = BitMap(ordinals)
    if len(batch) == len(ordinals) and not (recorded is not None and recorded.intersect(batch)):
        return batch
    seen = collections.Counter(ordinals)
    again = next(o for o in ordinals if seen[o] > 1 or (recorded is not None and o in recorded))
    raise LedgerError(
        "ledger",
        f"sample {again} of {shard} reached the training loop twice in epoch {epoch}. The ledger counts whole "
        "samples: a sample split into several items (unlisted/unbatched of a list made from one sample, a "
        "generator yielding several items per sample) would be marked consumed with its first item, and an "
        "elastic resume would lose the rest. Deliver each sample as one item (split it in the training step), "
        "or make LLM sequences, which record token ranges. A stream that repeats samples on purpose "
        "(resampled=True) is not checked.",
    )
