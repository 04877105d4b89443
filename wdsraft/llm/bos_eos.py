"""``ensure_bos_eos``: every document's ids start with BOS and end with EOS, once."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from wdsraft.llm.sequences import TOKENS, _token_array
from wdsraft.llm.tokenizers import TokenizerAdapter, _is_tiktoken

logger = logging.getLogger(__name__)


def _bos_eos_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """A tokenizer's BOS and EOS ids, as its adapter has them (without building one)."""
    if isinstance(tokenizer, TokenizerAdapter):
        return tokenizer.bos_id, tokenizer.eos_id
    if _is_tiktoken(tokenizer):  # (no BOS)
        return None, tokenizer.eot_token
    return getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)


class ensure_bos_eos:
    """Add BOS at the start and EOS at the end of each document where absent (epochraft's rule).

    When BOS and EOS are the same id, a document never gets two in a row. A stateless map:
    it holds nothing between items.
    """

    def __init__(self, tokenizer: Any = None, bos_id: int | None = None, eos_id: int | None = None):
        if tokenizer is not None:
            own_bos, own_eos = _bos_eos_ids(tokenizer)
            bos_id = own_bos if bos_id is None else bos_id
            eos_id = own_eos if eos_id is None else eos_id
        if bos_id is None and eos_id is None:
            raise ValueError("ensure_bos_eos: the tokenizer has neither BOS nor EOS; pass bos_id/eos_id")
        self.bos_id = bos_id
        self.eos_id = eos_id

    def add(self, ids: np.ndarray) -> np.ndarray:
        # BOS first, then EOS judged on the result: with BOS == EOS an empty document becomes [BOS]
        # (which already ends with EOS), never [BOS, EOS].
        n = len(ids)
        head = int(self.bos_id is not None and (n == 0 or ids[0] != self.bos_id))
        last = self.bos_id if head and n == 0 else (ids[-1] if n else None)
        tail = int(self.eos_id is not None and (last is None or last != self.eos_id))
        if not head and not tail:
            return ids
        out = np.empty(n + head + tail, dtype=ids.dtype)  # one allocation, not two concatenations
        if head:
            out[0] = self.bos_id
        out[head : head + n] = ids
        if tail:
            out[-1] = self.eos_id
        return out

    def __call__(self, src: Iterator[Any]) -> Iterator[Any]:
        for item in src:
            item[TOKENS] = self.add(_token_array(item[TOKENS]))
            yield item
