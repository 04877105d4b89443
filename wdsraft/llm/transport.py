"""Sequence batches crossing from DataLoader workers: a compact form (ids and row lengths only) that
the training process expands back into the full batch.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from wdsraft.llm.chunking import Chunk, ConcatChunk, pad
from wdsraft.llm.pack import PackBestFit
from wdsraft.llm.sequences import IGNORE_INDEX, SEQUENCE_TENSORS, TOKENS, _arange
from wdsraft.pipeline.batch import batched
from wdsraft.pipeline.datapipeline import DataPipeline
from wdsraft.pipeline.loader import register_batch_transport

logger = logging.getLogger(__name__)


class CompactSequenceBatch:
    """A batch of sequences on its way from a DataLoader worker to the training process.

    Of the four ``[batch, length]`` int64 tensors only the token ids travel (as int32): labels,
    attention mask and position ids follow from them, the batch's ``cu_seqlens`` and each
    row's real length, and are rebuilt on arrival (unpickling returns the full batch). A
    batch then crosses as one 64 KiB message instead of a 512 KiB shared-memory segment, whose
    file descriptor hand-over costs more than a millisecond of CPU per batch between the two
    processes: as much as tokenizing several documents.
    """

    def __init__(self, ids: np.ndarray, used: np.ndarray, rest: dict[str, Any]):
        self.ids = ids
        self.used = used
        self.rest = rest

    def __reduce__(self) -> tuple[Any, ...]:
        return (expand_sequence_batch, (self.ids, self.used, self.rest))


class _LastCollated(threading.local):
    batch: Any = None


_last_collated = _LastCollated()


def collated_here(batch: dict[str, Any]) -> None:
    """Note a batch ``batched`` just made with ``collate_sequences`` (the last one, in this thread)."""
    _last_collated.batch = batch


def straight_from_collation(batch: Any) -> bool:
    """Whether ``batch`` is the last batch ``batched`` collated in this thread (and forget it). The
    caller must know that no code ran on it since: see ``compact_for_transport``."""
    last, _last_collated.batch = _last_collated.batch, None
    return last is batch


def compact_sequence_batch(batch: Any, unchanged: bool = False) -> CompactSequenceBatch | None:
    """The compact form of a batch made by ``collate_sequences``, or None when ``batch`` is not one.

    Checked in full (a batch changed after collation, labels included, travels as it is), unless
    the caller knows it is ``unchanged`` since ``collate_sequences`` made it.
    """
    if not (type(batch) is dict and all(isinstance(batch.get(key), torch.Tensor) for key in SEQUENCE_TENSORS)):
        return None
    cu_seqlens = batch.get("cu_seqlens")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        return None
    ids = batch[TOKENS]
    bounds = cu_seqlens.numpy()
    # Segments tiling every row from 0 to the end, as collate_sequences makes them (a map after batched
    # may have changed them; such a batch travels as it is).
    if ids.dim() != 2 or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != ids.numel() or (np.diff(bounds) < 0).any():
        return None
    if ids.numel() == 0 or any(
        batch[key].shape != ids.shape or batch[key].dtype != torch.int64 or batch[key].device.type != "cpu"
        for key in SEQUENCE_TENSORS
    ):
        return None
    low, high = torch.aminmax(ids)
    if low < np.iinfo(np.int32).min or high > np.iinfo(np.int32).max:
        return None
    used = batch["attention_mask"].sum(1).numpy().astype(np.int32)
    compact = ids.numpy().astype(np.int32)
    rest = {key: None if key in SEQUENCE_TENSORS else value for key, value in batch.items()}  # (keeps key order)
    rest["cu_seqlens"] = cu_seqlens.numpy()
    if not unchanged:
        expected = expand_sequence_batch(compact, used, rest)
        if not all(torch.equal(expected[key], batch[key]) for key in SEQUENCE_TENSORS[1:]):
            return None
    return CompactSequenceBatch(compact, used, rest)


def expand_sequence_batch(ids: np.ndarray, used: np.ndarray, rest: dict[str, Any]) -> dict[str, Any]:
    """The batch a ``CompactSequenceBatch`` stands for: the same tensors ``collate_sequences`` made."""
    rows, length = ids.shape
    buffer = np.empty((len(SEQUENCE_TENSORS), rows, length), dtype=np.int64)
    tokens, labels, mask, positions = buffer
    tokens[:] = ids
    real = _arange(length)[None, :] < used[:, None]
    mask[:] = real
    labels.fill(IGNORE_INDEX)
    np.copyto(labels, tokens, where=real)
    cu_seqlens = np.asarray(rest["cu_seqlens"], dtype=np.int64)
    flat = positions.reshape(-1)  # position ids restart at every segment boundary; padding holds 0
    np.subtract(_arange(rows * length), np.repeat(cu_seqlens[:-1], np.diff(cu_seqlens)), out=flat)
    np.copyto(positions, 0, where=~real)
    batch = dict(rest)
    batch.update(zip(SEQUENCE_TENSORS, torch.from_numpy(buffer).unbind(0), strict=True))
    batch["cu_seqlens"] = torch.from_numpy(rest["cu_seqlens"])
    return batch


def compact_for_transport(batch: Any, dataset: Any) -> CompactSequenceBatch | None:
    """``pipeline.loader``'s transport hook: the compact form of a sequence batch made in a worker.

    The full check of a compact batch costs as much as making it. A batch that the worker's
    dataset, a pipeline ending in a sequence stage and ``batched``, collated just now with
    ``collate_sequences`` reaches the hook with no code run on its sequences since they were
    built (DataLoader's fetcher only calls next() and the collate function): it needs none.
    """
    unchanged = straight_from_collation(batch) and _ends_in_batched_sequences(dataset)
    return compact_sequence_batch(batch, unchanged=unchanged)


def _ends_in_batched_sequences(dataset: Any) -> bool:
    """Whether ``dataset`` batches sequences straight from the stage that built them (a ``map`` in
    between may have changed their labels, say: those batches get the full check)."""
    stages = dataset.pipeline if isinstance(dataset, DataPipeline) else []
    return len(stages) >= 2 and isinstance(stages[-1], batched) and _builds_sequences(stages[-2])


def _builds_sequences(stage: Any) -> bool:
    """Whether ``stage`` is one of the stages that make sequences with ``build_sequence`` (exactly: a
    subclass may change what they hold)."""
    return type(stage) in (ConcatChunk, Chunk, PackBestFit, pad)


register_batch_transport(compact_for_transport)
