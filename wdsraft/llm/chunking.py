"""``concat_chunk``, ``chunk`` and ``pad``: cut documents into fixed-length sequences, concatenated
across documents or one document at a time. The leftover tokens are held as (address, span) pieces.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator
from typing import Any

from wdsraft.llm.pack import _item_address
from wdsraft.llm.sequences import Piece, _document_position, _remaining, _SequenceStage, build_sequence
from wdsraft.pipeline.stage import AddressTracker, Context

logger = logging.getLogger(__name__)


class ConcatChunk(_SequenceStage):
    """Concatenate documents and cut the stream into sequences of ``length`` tokens.

    Nothing is dropped: the tokens left at the end of the input form a last, padded
    sequence. Between outputs the stage holds the unfinished tail of the stream, saved as
    (document address, token range).
    """

    def _run(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        held = self._held
        held[:] = self._read(ctx, held)  # (the restored pieces' tokens; nothing on a fresh start)
        # A state taken inside a long document holds a full sequence or more: hand those out first
        # (the input may have nothing more to give).
        total = yield from self._full_sequences(ctx, held, sum(len(piece[0]) for piece in held))
        tracker = AddressTracker(ctx)
        for item in src:
            tokens, base = _remaining(item)
            address = tracker.address()
            end = base + len(tokens)
            held.append((tokens, address, base, end, end, _document_position(item, address)))
            total = yield from self._full_sequences(ctx, held, total + len(tokens))
        if held and total > 0:
            out = list(held)
            held.clear()
            yield self._emit(ctx, out)
        held.clear()  # (empty documents after the last sequence: nothing to hand out, nothing to re-read)

    def _full_sequences(self, ctx: Context, held: list[Piece], total: int) -> Generator[Any, None, int]:
        """Hand out every full sequence the held tokens (``total`` of them) make; returns what is left."""
        while total >= self.length:
            out, rest = _take(held, self.length)
            held[:] = rest
            total -= self.length
            yield self._emit(ctx, out)
        return total


def _take(pieces: list[Piece], count: int) -> tuple[list[Piece], list[Piece]]:
    """Split a list of pieces after ``count`` tokens."""
    taken: list[Piece] = []
    for i, piece in enumerate(pieces):
        tokens, address, start, end, total, position = piece
        if count >= len(tokens):
            taken.append(piece)
            count -= len(tokens)
            if count == 0:
                return taken, pieces[i + 1 :]
            continue
        taken.append((tokens[:count], address, start, start + count, total, position))
        rest = [(tokens[count:], address, start + count, end, total, position), *pieces[i + 1 :]]
        return taken, rest
    return taken, []


class Chunk(_SequenceStage):
    """One document per sequence: cut each document into pieces of ``length`` tokens.

    The last piece of a document, shorter than ``length``, is dropped with
    ``drop_remainder=True`` (the default) and padded otherwise.
    """

    def __init__(self, length: int, drop_remainder: bool = True, pad_id: int = 0):
        super().__init__(length, pad_id)
        self.drop_remainder = drop_remainder

    def config(self) -> dict[str, Any]:
        return {**super().config(), "drop_remainder": self.drop_remainder}

    def _run(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        self._held[:] = self._read(ctx, self._held)  # (the restored pieces' tokens; nothing on a fresh start)
        yield from self._cut(ctx)
        tracker = AddressTracker(ctx)
        for item in src:
            tokens, base = _remaining(item)
            address = tracker.address()
            end = base + len(tokens)
            self._held.append((tokens, address, base, end, end, _document_position(item, address)))
            yield from self._cut(ctx)

    def _cut(self, ctx: Context) -> Iterator[Any]:
        while self._held:
            tokens, address, start, end, total, position = self._held[0]
            if len(tokens) >= self.length:
                piece = (tokens[: self.length], address, start, start + self.length, total, position)
                rest = (tokens[self.length :], address, start + self.length, end, total, position)
                self._held[0] = rest
                if len(rest[0]) == 0:
                    self._held.pop(0)
                yield self._emit(ctx, [piece])
            else:
                self._held.pop(0)
                if len(tokens) and not self.drop_remainder:
                    yield self._emit(ctx, [(tokens, address, start, end, total, position)])


class pad:
    """One document per sequence, truncated to ``length`` and padded (supervised fine-tuning).

    A stateless map: it holds nothing between items. A document is consumed by its sequence,
    truncated tail included: its provenance says ``is_last`` even when the tail was cut off.
    """

    def __init__(self, length: int, pad_id: int = 0):
        self.length = length
        self.pad_id = pad_id

    def __call__(self, src: Iterator[Any]) -> Iterator[Any]:
        for item in src:
            tokens, base = _remaining(item)
            kept = tokens[: self.length]
            address = _item_address(item)
            # The document is consumed with this sequence, truncated tail included: pad drops it by design.
            end = base + len(kept)
            piece = (kept, address, base, end, end, _document_position(item, address))
            if len(kept):  # (an empty document, possible without ensure_bos_eos, makes no sequence)
                yield build_sequence([piece], self.length, self.pad_id)


def concat_chunk(length: int, pad_id: int = 0) -> ConcatChunk:
    return ConcatChunk(length, pad_id)


def chunk(length: int, drop_remainder: bool = True, pad_id: int = 0) -> Chunk:
    return Chunk(length, drop_remainder, pad_id)
