"""Sequences: fixed-length rows of ``input_ids``/``labels``/``attention_mask``/``position_ids`` built
from pieces of documents, each piece remembered by its document's address and token span, and the
base class of the stages that build them.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from wdsraft.core.errors import StateMismatchError
from wdsraft.core.fields import OFFSET_FIELD, ORDINAL_FIELD, PASS_FIELD, PROVENANCE_FIELD, TOKEN_START_FIELD, pass_key
from wdsraft.llm.tokenizers import _ThreadedAdapter
from wdsraft.pipeline.addresses import Address, pack_addresses, unpack_addresses
from wdsraft.pipeline.stage import Context, Stage

TOKENS = "input_ids"


SEQUENCE_TENSORS = (TOKENS, "labels", "attention_mask", "position_ids")  # the tensor fields of a sequence


IGNORE_INDEX = -100


logger = logging.getLogger(__name__)


# A fork while another thread held the lock would leave it held in the child for good.
os.register_at_fork(after_in_child=lambda: setattr(_ThreadedAdapter, "_pool_lock", threading.Lock()))


Piece = tuple  # (tokens: np.ndarray | Unread, address, start, end, doc_length, position)


class Unread:
    """The tokens of a restored piece, not re-read yet: only their number.

    Packing needs only how many tokens a piece has. Re-reading and re-tokenizing every document
    a packer held (up to its whole buffer) before the first sequence went out made a restore's
    first batch wait for all of them; they are now read a few sequences ahead of where they go out.
    """

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size


def _remaining(item: dict[str, Any]) -> tuple[np.ndarray, int]:
    """The tokens of a document still to deliver, and where they start in the whole document.

    A document that a ledger says was delivered in part before an elastic resume goes on
    where it stopped; token ranges always count in the whole document (BOS/EOS included).
    """
    start = item.get(TOKEN_START_FIELD, 0)
    tokens = _token_array(item[TOKENS])
    return (tokens[start:], start) if start else (tokens, 0)


def _token_array(tokens: Any) -> np.ndarray:
    """Token ids as numpy (after a WebLoader, DataLoader's conversion has made them a torch tensor)."""
    return tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens


def _position(address: Address | None) -> list[Any]:
    return list(address[:-1]) if address is not None else [None, None, None]


def _document_position(item: Any, address: Address | None) -> list[Any]:
    """``[shard, ordinal, offset]`` of a document, for provenance: its own fields where it has them (after a
    ``WebLoader``, stages in the training process address items by loader batch), else its tar address."""
    if isinstance(item, dict) and "__url__" in item and ORDINAL_FIELD in item:
        offset = item.get(OFFSET_FIELD)
        url = pass_key(str(item["__url__"]), int(item.get(PASS_FIELD, 0)))  # (a later pass of a mixed source)
        return [url, int(item[ORDINAL_FIELD]), None if offset is None else int(offset)]
    return _position(address)


def build_sequence(pieces: Sequence[Piece], length: int, pad_id: int) -> dict[str, Any]:
    """One training sequence from document pieces, padded to ``length``.

    The four tensors are rows of one ``[4, length]`` buffer (one allocation; batching copies
    rows), filled with a handful of whole-row numpy calls whatever the number of pieces:
    this runs thousands of times a second beside the tokenizer, on the same cores.
    """
    buffer = np.empty((len(SEQUENCE_TENSORS), length), dtype=np.int64)
    ids, labels, mask, positions = buffer
    sizes = [len(piece[0]) for piece in pieces]
    used = sum(sizes)
    if len(pieces) == 1:
        ids[:used] = pieces[0][0]
        positions[:used] = _arange(length)[:used]
    elif used:
        np.concatenate([piece[0] for piece in pieces], out=ids[:used])
        steps = _arange(length)
        np.concatenate([steps[:size] for size in sizes], out=positions[:used])  # restart at every piece
    labels[:used] = ids[:used]
    mask[:used] = 1
    buffer[:, used:] = _padding_column(pad_id)
    provenance = [[*position, start, end, end == total] for _, _, start, end, total, position in pieces]
    input_ids, labels_, attention_mask, position_ids = torch.from_numpy(buffer).unbind(0)
    return {
        TOKENS: input_ids,
        "labels": labels_,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "cu_seqlens": list(itertools.accumulate(sizes, initial=0)),
        PROVENANCE_FIELD: provenance,
    }


_STEPS = np.arange(0, dtype=np.int64)


def _arange(size: int) -> np.ndarray:
    """0..size-1 (position ids), a read-only view of one shared array that grows as needed."""
    global _STEPS
    steps = _STEPS
    if len(steps) < size:
        steps = np.arange(max(size, 2 * len(steps)), dtype=np.int64)
        steps.flags.writeable = False
        _STEPS = steps  # (another thread growing it meanwhile is harmless: views of the old one stay valid)
    return steps[:size]


@functools.lru_cache(maxsize=8)
def _padding_column(pad_id: int) -> np.ndarray:
    """What a padding position holds in each of the four rows: pad id, ignored label, mask 0, position 0."""
    column = np.array([[pad_id], [IGNORE_INDEX], [0], [0]], dtype=np.int64)
    column.flags.writeable = False
    return column


class _SequenceStage(Stage):
    """Shared machinery: tracks document addresses and saves held pieces as (address, start, end)."""

    def __init__(self, length: int, pad_id: int = 0):
        if length < 1:
            raise ValueError("sequence length must be positive")
        self.length = length
        self.pad_id = pad_id
        self._held: list[Piece] = []  # pieces received and not yet handed out, in order

    def config(self) -> dict[str, Any]:
        return {"length": self.length, "pad_id": self.pad_id}

    def _save(self, pieces: Sequence[Piece]) -> dict[str, Any]:
        if any(piece[1] is None for piece in pieces):
            raise StateMismatchError(f"cannot save stage {self.index}: it holds documents without positions")
        return {
            "docs": pack_addresses([piece[1] for piece in pieces]),
            "spans": [[piece[2], piece[3]] for piece in pieces],
        }

    def _restore(self, ctx: Context, saved: dict[str, Any], *, unread: bool = False) -> list[Piece]:
        """The pieces a state names; with ``unread``, their tokens stand in as ``Unread`` until ``_read``."""
        addresses = unpack_addresses(saved["docs"])
        pieces = [
            (Unread(end - start), address, start, end, None, None)
            for address, (start, end) in zip(addresses, saved["spans"], strict=True)
        ]
        return pieces if unread else self._read(ctx, pieces)

    def _read(self, ctx: Context, pieces: list[Piece], wanted: set[Address] | None = None) -> list[Piece]:
        """``pieces`` with the tokens of their ``Unread`` ones re-read (only those of the documents ``wanted``,
        if given): their documents re-read and re-tokenized at once, each document once."""

        def unread(piece: Piece) -> bool:
            return isinstance(piece[0], Unread) and (wanted is None or piece[1] in wanted)

        unique = list(dict.fromkeys(piece[1] for piece in pieces if unread(piece)))
        if not unique:
            return pieces
        documents = dict(zip(unique, ctx.rematerializers[self.index](unique), strict=True))
        read = []
        for piece in pieces:
            if not unread(piece):
                read.append(piece)
                continue
            _, address, start, end, _, _ = piece
            document = documents[address]
            tokens = document[TOKENS]
            if end > len(tokens):  # (a tokenizer that gives fewer tokens than when the state was taken)
                raise StateMismatchError(
                    f"stage {self.index}: document {_position(address)} has {len(tokens)} tokens on re-reading, "
                    f"the state holds its tokens {start}-{end}: was the tokenizer changed?"
                )
            read.append((tokens[start:end], address, start, end, len(tokens), _document_position(document, address)))
        return read

    def addresses(self) -> list[Address]:
        return [piece[1] for piece in self._held if piece[1] is not None]

    def state_dict(self) -> dict[str, Any]:
        return self._save(self._held)

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        assert src is not None
        # Adopted now, not when the generator first runs: a state taken before then (the stages after this one
        # hand out what they restored first) must hold these pieces. ``_run`` reads their tokens first thing.
        self._held = self._restore(ctx, state, unread=True) if state is not None else []
        return self._run(ctx, src)

    def _run(self, ctx: Context, src: Iterator[Any]) -> Iterator[Any]:
        raise NotImplementedError

    def _sequence(self, pieces: Sequence[Piece]) -> dict[str, Any]:
        return build_sequence(pieces, self.length, self.pad_id)

    def _emit(self, ctx: Context, pieces: Sequence[Piece]) -> dict[str, Any]:
        ctx.provenance = None  # a sequence has many sources: later stages cannot address it
        return self._sequence(pieces)
