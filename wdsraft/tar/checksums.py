"""Tar header checksums of many headers at once (numpy), for the reader's blocks and for runs of samples."""

from __future__ import annotations

import threading

import numpy as np

from wdsraft.tar.format import BLOCK

_OCTAL_PLACES = (8 ** np.arange(5, -1, -1)).astype(np.float32)
_OCTAL_BIAS = float(48 * _OCTAL_PLACES.sum())  # the six digits' ASCII '0's
_CHECKSUM_WEIGHTS = np.ones(BLOCK, dtype=np.float32)
_CHECKSUM_WEIGHTS[148:156] = 0  # the checksum field counts as eight spaces (the 8 * 32 added)

_SCRATCH = threading.local()


def _scratch(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's arrays for a block's headers (bytes, and as float32), with room for ``rows``: reused from
    block to block. (New arrays of this size -- about 1 MiB for a block of small samples -- came from fresh
    pages at every block whenever the C allocator maps such sizes anew: a page fault every 4 KiB, which
    cost more than the checksums themselves.)"""
    arrays: tuple[np.ndarray, np.ndarray] | None = getattr(_SCRATCH, "arrays", None)
    if arrays is None or len(arrays[0]) < rows:
        size = 1 << max(rows - 1, 255).bit_length()  # (a power of two: a few sizes at most)
        arrays = _SCRATCH.arrays = (np.empty((size, BLOCK), np.uint8), np.empty((size, BLOCK), np.float32))
    return arrays


def checked_headers(blocks: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The header blocks ``blocks[rows]`` (in this thread's scratch array: use them before the next call),
    each one's computed checksum, and whether its stored checksum, in the common layout (six octal digits,
    then NUL), matches. A header that does not is not necessarily bad: other layouts and the historic signed
    sums need a look at the header itself (``format.header_checksum_ok``)."""
    count = len(rows)
    raw, wide = _scratch(count)
    headers = np.take(blocks, rows, axis=0, out=raw[:count], mode="clip")  # (rows are in range: no buffering)
    floats = wide[:count]
    np.copyto(floats, headers)
    # Sums and stored values as float32 dot products (exact: integers below 2**24; an integer sum over the
    # headers took three times as long).
    sums = floats @ _CHECKSUM_WEIGHTS + 8 * 32
    digits = headers[:, 148:154]
    plain = (headers[:, 154] == 0) & ((digits >= 48) & (digits <= 55)).all(axis=1)
    return headers, sums, plain & (floats[:, 148:154] @ _OCTAL_PLACES - _OCTAL_BIAS == sums)
