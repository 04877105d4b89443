"""Collation of sequences into batch tensors, and splitting a batch back into sequences (for
``unbatched``).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from wdsraft.core.fields import PROVENANCE_FIELD
from wdsraft.llm.sequences import SEQUENCE_TENSORS, TOKENS
from wdsraft.llm.transport import collated_here
from wdsraft.pipeline.batch import register_batch_format

logger = logging.getLogger(__name__)


def is_sequence(item: Any) -> bool:
    return isinstance(item, dict) and PROVENANCE_FIELD in item and "cu_seqlens" in item


def is_sequence_batch(batch: Any) -> bool:
    """Whether ``batch`` is a batch ``collate_sequences`` made (``[batch, length]`` token ids)."""
    return is_sequence(batch) and isinstance(batch.get(TOKENS), torch.Tensor) and batch[TOKENS].dim() == 2


def split_sequence_batch(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The sequences of a ``collate_sequences`` batch, as the sequence stages made them (rows are views),
    so that ``unbatched`` and ``batched`` can regroup them in the training process."""
    rows, length = batch[TOKENS].shape
    bounds = batch["cu_seqlens"].tolist()
    per_row = {key: value for key, value in batch.items() if key not in ("cu_seqlens", "max_seqlen")}
    sequences = []
    cursor = 1  # bounds[0] is the first row's start
    for row in range(rows):
        # A row holds one segment per document piece (its provenance says how many; pieces may be empty,
        # so values alone cannot tell rows apart), then a padding segment if the pieces end short of it.
        pieces = len(batch[PROVENANCE_FIELD][row])
        row_bounds = [0, *(bound - row * length for bound in bounds[cursor : cursor + pieces])]
        cursor += pieces + (row_bounds[-1] < length)
        sequence = {key: value[row] for key, value in per_row.items()}
        sequence["cu_seqlens"] = row_bounds
        sequences.append(sequence)
    return sequences


def collate_sequences(sequences: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack sequences into a batch of ``[batch, length]`` tensors, with batch-level ``cu_seqlens``
    and ``max_seqlen`` for variable-length attention over the flattened batch (flash-attn's
    convention). ``batched`` uses it for sequences by default.

    The four tensors are views of one buffer. ``max_seqlen`` covers every segment of
    ``cu_seqlens``, padding segments included (varlen kernels size their work by it).
    """
    length = sequences[0][TOKENS].shape[0]
    buffer = torch.empty((len(SEQUENCE_TENSORS), len(sequences), length), dtype=torch.int64)
    for field, key in enumerate(SEQUENCE_TENSORS):
        torch.stack([s[key] for s in sequences], out=buffer[field])
    batch: dict[str, Any] = {key: buffer[field] for field, key in enumerate(SEQUENCE_TENSORS)}
    boundaries = [0]
    for row, sequence in enumerate(sequences):
        bounds = sequence["cu_seqlens"]
        boundaries.extend(row * length + b for b in bounds[1:])
        if bounds[-1] < length:  # padding forms its own segment, so rows stay aligned
            boundaries.append((row + 1) * length)
    batch["cu_seqlens"] = torch.tensor(boundaries, dtype=torch.int32)
    batch["max_seqlen"] = max((b - a for a, b in itertools.pairwise(boundaries)), default=0)
    batch[PROVENANCE_FIELD] = [s[PROVENANCE_FIELD] for s in sequences]
    return batch


class SequenceBatches:
    """Token sequences as a batch format of ``batched``/``unbatched`` (``pipeline.batch``'s hook)."""

    @property
    def collate(self) -> Any:
        return collate_sequences

    def is_item(self, item: Any) -> bool:
        return is_sequence(item)

    def collate_batch(self, items: list[Any]) -> Any:
        batch = collate_sequences(items)  # webdataset's collation cannot stack cu_seqlens
        collated_here(batch)
        return batch

    def is_batch(self, batch: Any) -> bool:
        return is_sequence_batch(batch)  # (batch-level cu_seqlens/max_seqlen do not split by row)

    def split(self, batch: Any) -> list[Any]:
        return split_sequence_batch(batch)


register_batch_format(SequenceBatches())
