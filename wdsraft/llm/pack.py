"""``pack_bestfit``: pack whole documents (or their chunks) into sequences, best fit first, with few
padding tokens.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator
from typing import Any

from wdsraft.core.fields import OFFSET_FIELD, ORDINAL_FIELD
from wdsraft.llm.sequences import Piece, Unread, _document_position, _remaining, _SequenceStage
from wdsraft.pipeline.addresses import Address
from wdsraft.pipeline.stage import AddressTracker, Context

logger = logging.getLogger(__name__)

READ_AHEAD = 8  # sequences whose restored documents are re-read at once, ahead of where they go out


def _item_address(item: dict[str, Any]) -> Address | None:
    if "__url__" in item and ORDINAL_FIELD in item:
        return (item["__url__"], item[ORDINAL_FIELD], item.get(OFFSET_FIELD), 0)  # (a map may have dropped it)
    return None


class PackBestFit(_SequenceStage):
    """Pack whole documents into sequences with best-fit-decreasing over a buffer of documents.

    Documents longer than ``length`` are split into full sequences and a remainder; no
    other document is cut. When ``buffer`` documents are held, they are packed: longest
    first, each into the open sequence with the least room that still fits it. This wastes
    a little padding instead of cutting documents in two as ``concat_chunk`` does.
    """

    def __init__(self, length: int, buffer: int = 1024, pad_id: int = 0):
        super().__init__(length, pad_id)
        self.buffer = buffer
        self._ready: list[list[Piece]] = []  # packed sequences not yet handed out
        self._restored = False  # whether this run began from a state (pieces may wait to be re-read)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "buffer": self.buffer}

    def state_dict(self) -> dict[str, Any]:
        # Packed sequences not yet handed out: their pieces in one record, and how many each holds.
        pieces = [piece for sequence in self._ready for piece in sequence]
        sizes = [len(sequence) for sequence in self._ready]
        return {"ready": self._save(pieces), "ready_sizes": sizes, "held": self._save(self._held)}

    def addresses(self) -> list[Address]:
        return super().addresses() + [p[1] for sequence in self._ready for p in sequence if p[1] is not None]

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        # Adopted now, not when the generator first runs: a state taken before then (the stages after this one
        # hand out what they restored first) must hold these pieces. Their tokens are read when needed.
        self._restored = state is not None  # (only a restore leaves pieces to re-read: fresh runs never look)
        self._held, self._ready = [], []
        if state is not None:
            pieces = iter(self._restore(ctx, state["ready"], unread=True))
            self._ready = [[next(pieces) for _ in range(size)] for size in state["ready_sizes"]]
            self._held = self._restore(ctx, state["held"], unread=True)
        return self._run(ctx, src)

    def _run(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        yield from self._hand_out(ctx)  # (what a restore left ready; nothing on a fresh start)
        tracker = AddressTracker(ctx)
        n = self.length
        for item in src:
            tokens, base = _remaining(item)
            address = tracker.address()
            position = _document_position(item, address)
            end = base + len(tokens)
            full = len(tokens) // n if len(tokens) > n else 0
            for k in range(full):  # a long document: full sequences first, the rest is packed
                piece = (tokens[k * n : (k + 1) * n], address, base + k * n, base + (k + 1) * n, end, position)
                self._ready.append([piece])
            if len(tokens) - full * n > 0 or len(tokens) == 0:
                self._held.append((tokens[full * n :], address, base + full * n, end, end, position))
            if len(self._held) >= self.buffer:
                self._pack_held(final=False)
            yield from self._hand_out(ctx)
        if self._held:
            self._pack_held(final=True)
        yield from self._hand_out(ctx)

    def _pack_held(self, final: bool) -> None:
        held, self._held = self._held, []
        for sequence in self._pack(held):
            if any(len(piece[0]) for piece in sequence):
                self._ready.append(sequence)
            elif not final:  # empty documents only: they wait to ride along in a sequence with tokens
                self._held.extend(sequence)

    def _hand_out(self, ctx: Context) -> Iterator[Any]:
        while self._ready:
            if self._restored and any(isinstance(piece[0], Unread) for piece in self._ready[0]):
                self._read_ahead(ctx)
            sequence = self._ready.pop(0)
            yield self._emit(ctx, sequence)

    def _read_ahead(self, ctx: Context) -> None:
        """Re-read the restored documents of the next ``READ_AHEAD`` sequences, and with them every other
        piece of those documents (each document is re-read once): the first batch after a restore waits
        for its own documents only, and the rest are read in groups (a few reads each on S3)."""
        wanted = {
            piece[1] for sequence in self._ready[:READ_AHEAD] for piece in sequence if isinstance(piece[0], Unread)
        }
        sizes = [len(sequence) for sequence in self._ready]
        read = iter(self._read(ctx, [piece for sequence in self._ready for piece in sequence] + self._held, wanted))
        self._ready = [[next(read) for _ in range(size)] for size in sizes]
        self._held = list(read)

    def _pack(self, pieces: list[Piece]) -> list[list[Piece]]:
        """Best-fit decreasing; ties broken by arrival order, so packing is deterministic."""
        order = sorted(range(len(pieces)), key=lambda i: (-len(pieces[i][0]), i))
        bins: list[list[Piece]] = []
        room: list[tuple[int, int]] = []  # (free tokens, bin number), sorted
        for i in order:
            size = len(pieces[i][0])
            slot = bisect.bisect_left(room, (size, -1))
            if slot < len(room):
                free, number = room.pop(slot)
                bins[number].append(pieces[i])
                bisect.insort(room, (free - size, number))
            else:
                bins.append([pieces[i]])
                bisect.insort(room, (self.length - size, len(bins) - 1))
        return bins


def pack_bestfit(length: int, buffer: int = 1024, pad_id: int = 0) -> PackBestFit:
    return PackBestFit(length, buffer, pad_id)
