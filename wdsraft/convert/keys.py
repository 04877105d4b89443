"""Keys: the tar-safe sample key of a text, and the random shuffle key of every record (with its bucket)."""

from __future__ import annotations

import hashlib
import re

import numpy as np

_SAFE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_SAFE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def tar_safe_key(text: str) -> str:
    """A sample key for ``text`` that webdataset reads back whole: every character but letters, digits,
    ``_`` and ``-`` is %-escaped (UTF-8 bytes), so there is no dot (webdataset cuts keys at the first
    dot of the basename) and no slash, and different texts give different keys."""
    if _SAFE_KEY.fullmatch(text):
        return text
    return "".join(
        char if char in _SAFE_CHARS else "".join(f"%{b:02X}" for b in char.encode("utf-8", "surrogatepass"))
        for char in text
    )


class ShuffleKeys:
    """The random sort key of each record of one input, and the bucket it falls in.

    A key is a function of (seed, input name, line number) only, never of which process
    read the line or when: that makes the output identical whatever the parallelism.
    (SplitMix64 over the line number, from a per-input offset.)
    """

    _GAMMA = np.uint64(0x9E3779B97F4A7C15)
    _MUL1 = np.uint64(0xBF58476D1CE4E5B9)
    _MUL2 = np.uint64(0x94D049BB133111EB)

    def __init__(self, seed: int, input_name: str, buckets: int):
        digest = hashlib.blake2b(f"{seed}\0{input_name}".encode(), digest_size=8, person=b"wdsraft-shuffle").digest()
        self.base = np.uint64(int.from_bytes(digest, "little"))
        self.buckets = np.uint64(buckets)

    def keys(self, first_line: int, count: int) -> np.ndarray:
        return self.keys_at(np.arange(first_line, first_line + count, dtype=np.uint64))

    def keys_at(self, lines: np.ndarray) -> np.ndarray:
        """The keys of the records at these line numbers (``keys`` of a run of lines)."""
        z = self.base + lines.astype(np.uint64) * self._GAMMA
        z = (z ^ (z >> np.uint64(30))) * self._MUL1
        z = (z ^ (z >> np.uint64(27))) * self._MUL2
        return z ^ (z >> np.uint64(31))

    def bucket_of(self, keys: np.ndarray) -> np.ndarray:
        # Range partition on the top 32 bits: exact integer arithmetic, monotone in the key.
        return ((keys >> np.uint64(32)) * self.buckets) >> np.uint64(32)
