"""A transformers tokenizer that encodes exactly like a tiktoken BPE file (for the fast-tokenizer
path without a model hub).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def hf_from_tiktoken(vocab_file: str, special_tokens: dict[str, int] | None = None) -> Any:
    """A transformers fast tokenizer that encodes exactly like a tiktoken BPE file (e.g. cl100k_base).

    transformers' converter splits text with Oniguruma, which reads tiktoken's possessive
    quantifiers (``\\p{N}{1,3}+``) as repetitions; its default, non-possessive pattern gives
    the same pieces. Special tokens keep tiktoken's ids (cl100k's ``<|endoftext|>`` is 100257,
    after a gap) by filling gaps with placeholders.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=vocab_file).converted()
    specials = special_tokens or {"<|endoftext|>": 100257}
    for token, wanted in sorted(specials.items(), key=lambda item: item[1]):
        while backend.get_vocab_size() < wanted:
            backend.add_special_tokens([f"<|placeholder{backend.get_vocab_size()}|>"])
        backend.add_special_tokens([token])
        if backend.token_to_id(token) != wanted:
            raise ValueError(f"cannot place {token} at id {wanted}")
    eos = "<|endoftext|>" if "<|endoftext|>" in specials else None
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos)
