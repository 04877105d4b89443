"""LLM stages: tokenize, add BOS/EOS, cut or pack documents into fixed-length sequences, collate them,
and carry sequence batches out of DataLoader workers compactly.

Every stage is checkpointable; leftover tokens are saved as (document address, token span) pieces.
Imports ``wdsraft.core`` and ``wdsraft.pipeline``; never ``wdsraft.ledger``.
"""

from wdsraft.llm.bos_eos import ensure_bos_eos
from wdsraft.llm.chunking import Chunk, ConcatChunk, chunk, concat_chunk, pad
from wdsraft.llm.collate import (
    collate_sequences,
    is_sequence,
    is_sequence_batch,
    split_sequence_batch,
)
from wdsraft.llm.hf_from_tiktoken import hf_from_tiktoken
from wdsraft.llm.pack import PackBestFit, pack_bestfit
from wdsraft.llm.sequences import IGNORE_INDEX, SEQUENCE_TENSORS, TOKENS, Piece, build_sequence
from wdsraft.llm.tokenize_stage import QUEUED_BATCHES, TextField, Tokenize, text_getter, tokenize
from wdsraft.llm.tokenizers import (
    HFTokenizer,
    TiktokenTokenizer,
    TokenizerAdapter,
    as_tokenizer,
    available_cores,
    thread_count,
)
from wdsraft.llm.transport import (
    CompactSequenceBatch,
    collated_here,
    compact_sequence_batch,
    expand_sequence_batch,
    straight_from_collation,
)

__all__ = [
    "IGNORE_INDEX",
    "QUEUED_BATCHES",
    "SEQUENCE_TENSORS",
    "TOKENS",
    "Chunk",
    "CompactSequenceBatch",
    "ConcatChunk",
    "HFTokenizer",
    "PackBestFit",
    "Piece",
    "TextField",
    "TiktokenTokenizer",
    "Tokenize",
    "TokenizerAdapter",
    "as_tokenizer",
    "available_cores",
    "build_sequence",
    "chunk",
    "collate_sequences",
    "collated_here",
    "compact_sequence_batch",
    "concat_chunk",
    "ensure_bos_eos",
    "expand_sequence_batch",
    "hf_from_tiktoken",
    "is_sequence",
    "is_sequence_batch",
    "pack_bestfit",
    "pad",
    "split_sequence_batch",
    "straight_from_collation",
    "text_getter",
    "thread_count",
    "tokenize",
]
