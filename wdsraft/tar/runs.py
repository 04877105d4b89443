"""Runs of whole samples taken from a read buffer at once, where the shard's index says they lie.

A shard with an index (``SHARD.idx``: every sample's byte offset) needs no header-by-header walk to
know where its samples start and end. :class:`SampleRuns` takes every sample lying wholly in the
buffer in a handful of numpy steps over all their headers together: sizes, header checksums, names
split into key and extension, the grouping rules checked. Only building each sample's dict and
slicing its payloads is left per sample. That is what made small-sample reads interpreter-bound:
about 2.6 µs of Python per sample of two members through the general walk, against 0.8 µs here.

A run is all or nothing: the samples come out exactly as the general walk would hand them out
(the same dicts, keys in the same order, the same positions), and anything the fast steps do not
cover -- an extension header, a non-ASCII or directory name, a bad checksum, a member where the index
puts none, two members with one extension -- leaves those samples to the general walk, which
applies webdataset's rules and raises its errors. The shard's last sample always goes the general
way, since only the general walk checks how the archive ends.
"""

from __future__ import annotations

import logging
import sys
from array import array
from typing import Any

import numpy as np

from wdsraft.core.fields import OFFSET_FIELD, ORDINAL_FIELD
from wdsraft.tar.format import BLOCK

logger = logging.getLogger(__name__)

#: Fewer whole samples than this in a buffer: the general walk is cheaper than the fixed cost of a run.
MIN_RUN = 32
#: More members than this in a sample: the general walk (the steps below go once per member rank).
MAX_MEMBERS = 16
#: Runs not taken in a row after which a shard is read the general way to its end (every sample an
#: exception: extension headers, directory names).
MAX_MISSES = 8

_POW8 = 8 ** np.arange(10, -1, -1, dtype=np.int64)  # the 11 octal digits of a size field
_CHECKSUM_WEIGHTS = np.ones(BLOCK, dtype=np.float32)
_CHECKSUM_WEIGHTS[148:156] = 0  # the checksum field counts as eight spaces
_OCTAL_PLACES = (8 ** np.arange(5, -1, -1)).astype(np.float32)
_OCTAL_BIAS = float(48 * _OCTAL_PLACES.sum())
_COLUMNS = np.arange(101, dtype=np.uint8)  # name bytes, and one past the longest (a 100-byte name's end)
_NAME_WIDTHS = (16, 32, 48, 64, 80)  # where a run's names may all have ended (column 100 starts the mode)

#: What :meth:`SampleRuns.take` says when no run can start at this position.
REFILL = -1  # too few whole samples in the buffer: move the partial one to its front and read more


class SampleRuns:
    """Takes runs of whole samples out of a shard's read buffer, checked against its index.

    ``ordinal`` and ``key`` are the sample reader's: the last sample ordinal it assigned and that
    sample's key as written (None before the first). The reader keeps them current, so a run
    starts exactly where the general walk would start the next sample.
    """

    def __init__(self, url: str, offsets: array):
        self.url = url
        self.offsets = np.frombuffer(offsets, dtype=np.uint64).astype(np.int64)
        self.last = len(offsets) - 2  # the shard's last sample: always read the general way
        self.ordinal = -1
        self.key: str | None = None
        self.misses = 0
        self.enabled = self.last > 0

    def take(self, buf: Any, pos: int, filled: int, base: int) -> tuple[list[dict[str, Any]] | None, int]:
        """``(samples, end)``: the run of whole samples from ``buf[pos]`` on and the archive offset just
        past it; or ``(None, REFILL)``; or ``(None, until)``: members up to archive offset ``until`` go
        the general way (the next run may start there)."""
        first = self.ordinal + 1
        at = base + pos
        offsets = self.offsets
        if first > self.last:
            return self._done()
        if offsets[first] != at or at % BLOCK or base % BLOCK:
            return self._miss(int(np.searchsorted(offsets, at, side="right")))
        # Samples first..stop-1 lie wholly in the buffer, and the first header of sample `stop` too (its
        # key must differ from theirs for the general walk to end them where the index does).
        stop = min(int(np.searchsorted(offsets, base + filled - BLOCK, side="right")) - 1, self.last)
        if stop - first < MIN_RUN:
            if pos > 0 and stop < self.last:
                return None, REFILL
            return self._miss(max(stop, first + 1))
        samples = self._run(buf, first, stop, base, filled)
        if samples is None:
            return self._miss(stop)  # (the general way through this buffer's samples: it finds what is odd)
        self.misses = 0
        self.ordinal = stop - 1
        self.key = samples[-1]["__key__"]
        return samples, int(offsets[stop])

    def _miss(self, until: int) -> tuple[None, int]:
        """The general way up to the start of sample ``until``; after many misses in a row, to the end."""
        self.misses += 1
        if self.misses >= MAX_MISSES or until > self.last:
            logger.debug("%s: read the general way from sample %d on", self.url, self.ordinal + 1)
            return self._done()
        return None, int(self.offsets[until])

    def _done(self) -> tuple[None, int]:
        """No more runs in this shard: the general way to its end."""
        self.enabled = False
        return None, sys.maxsize

    def _run(self, buf: Any, first: int, stop: int, base: int, filled: int) -> list[dict[str, Any]] | None:
        starts = self.offsets[first : stop + 1] - base  # (the last: sample `stop`'s first header)
        if (starts % BLOCK).any():
            return None  # (an index that puts a sample off the 512-byte grid: the general walk says so)
        blocks = np.frombuffer(buf, dtype=np.uint8, count=filled // BLOCK * BLOCK).reshape(-1, BLOCK)
        members = _members(blocks, starts[:-1], starts[1:])
        if members is None:
            return None
        positions, sizes, counts = members
        heads = np.concatenate((positions, starts[-1:]))  # every member's header, then the one after the run
        names = _Names.of(np.take(blocks, heads // BLOCK, axis=0))
        if names is None:
            return None
        # Sample by sample, the general walk's grouping: a sample's members share its key, the next
        # sample's first member has another (else the general walk would go on with the same sample).
        first_members = np.zeros(len(heads), dtype=bool)
        first_members[np.cumsum(counts) - counts] = True
        first_members[-1] = True
        same_key = (names.keys[1:] == names.keys[:-1]).all(axis=1)
        if (same_key == first_members[1:]).any():
            return None
        keys = _text(names.keys[first_members]).split(".")[:-2]  # (each key ends with its dot; then the next's)
        if keys[0] == self.key:
            return None
        extensions = _text(names.extensions[:-1]).lower().split(_SEPARATOR)[:-1]
        data_starts = (positions + BLOCK).tolist()
        payloads = list(map(buf.__getitem__, map(slice, data_starts, map(int.__add__, data_starts, sizes.tolist()))))
        return _samples(self.url, keys, extensions, payloads, range(first, stop), starts[:-1] + base, counts)


def _members(blocks: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """Every member header position of the samples spanning ``starts[i]:ends[i]`` (buffer positions), in
    order, their sizes and each sample's member count; None when the chain of one sample does not end
    exactly at the next one's start, or a size field is not the common 11 octal digits.

    Round r finds the r-th member of every sample that has one. While every sample still has one (the
    common case: every sample the same members), no sample is picked out and the members come in order
    by interleaving the rounds."""
    found_positions, found_sizes = [], []
    samples: np.ndarray | None = None  # the samples still in the walk (None: all of them)
    heads, limits = starts, ends
    counts = np.zeros(len(starts), dtype=np.int64)
    for _ in range(MAX_MEMBERS):
        fields = blocks[heads // BLOCK, 124:136]
        digits = fields[:, :11] - 48  # (uint8: a byte below "0" wraps to above 7 too)
        if (digits > 7).any() or fields[:, 11].any():
            return None
        sizes = digits.astype(np.int64) @ _POW8
        following = heads + BLOCK + ((sizes + BLOCK - 1) & ~(BLOCK - 1))
        found_positions.append(heads)
        found_sizes.append(sizes)
        if samples is None:
            counts += 1
        else:
            counts[samples] += 1
        if (following > limits).any():
            return None  # a member runs past where the index starts the next sample
        more = following < limits
        if samples is None and more.all():
            heads = following
            continue
        if not more.any():
            break
        samples = np.flatnonzero(more) if samples is None else samples[more]
        heads, limits = following[more], limits[more]
    else:
        return None
    if len(found_positions) == 1 or (counts == len(found_positions)).all():  # (all samples alike)
        return np.stack(found_positions, axis=1).ravel(), np.stack(found_sizes, axis=1).ravel(), counts
    positions = np.concatenate(found_positions)
    order = np.argsort(positions, kind="stable")
    return positions[order], np.concatenate(found_sizes)[order], counts


class _Names:
    """The member names of a run's headers, split as webdataset splits them (key up to the first dot,
    extension after it), as rows of bytes: every name printable ASCII, no directory, neither a meta
    file nor a hidden one, with a key and an extension. Key rows keep their dot, extension rows end
    with ``_SEPARATOR``: the rows' bytes joined are the texts joined."""

    def __init__(self, keys: np.ndarray, extensions: np.ndarray):
        self.keys = keys
        self.extensions = extensions

    @classmethod
    def of(cls, headers: np.ndarray) -> _Names | None:
        # Regular files ('0') named in the name field alone (no ustar prefix), with good checksums.
        if not ((headers[:, 156] == 48).all() and (headers[:, 345] == 0).all() and _checksums_match(headers)):
            return None
        # The names' bytes only as far as a column of NULs in every header: each name ends before it (fewer
        # columns, less work per header); the whole field, and a NUL column after it, otherwise.
        for width in _NAME_WIDTHS:
            if not headers[:, width].any():
                names = headers[:, : width + 1]
                break
        else:
            width = 100
            names = np.zeros((len(headers), width + 1), dtype=np.uint8)
            names[:, :width] = headers[:, :width]
        columns = _COLUMNS[: width + 1]
        lengths = (names == 0).argmax(axis=1).astype(np.uint8)  # (the last column is always NUL)
        within = columns < lengths[:, None]  # (uint8 on both sides: half the work of wider integers)
        dots = (names == 46) & within
        if (
            (((names < 32) | (names > 126)) & within).any()
            or ((names == 47) & within).any()  # a directory: the general walk splits the basename
            or (names[:, 0] == 95).any()  # "_...": perhaps a meta file, which the general walk skips
            or not dots.any(axis=1).all()
        ):
            return None
        first_dots = dots.argmax(axis=1).astype(np.uint8)
        if (first_dots == 0).any() or (first_dots + 1 >= lengths).any():
            return None  # a hidden name ("." first) or an empty extension: the general walk's rules
        keys = names * (columns <= first_dots[:, None])  # (a product: cheaper than np.where)
        extensions = names * ((columns > first_dots[:, None]) & within)
        extensions[np.arange(len(names)), lengths] = _SEPARATOR_BYTE
        return cls(keys, extensions)


def _text(rows: np.ndarray) -> str:
    """The rows' bytes, NULs left out, as text (the rows hold printable ASCII and their separators)."""
    return rows[rows != 0].tobytes().decode("ascii")


_SEPARATOR_BYTE = 1  # (no name in a run holds a control character)
_SEPARATOR = chr(_SEPARATOR_BYTE)


def _checksums_match(headers: np.ndarray) -> bool:
    """Whether every header's stored checksum (six octal digits, then NUL: the common layout) matches
    its bytes. Any other layout counts as a mismatch here: the general walk checks it exactly."""
    wide = headers.astype(np.float32)
    sums = wide @ _CHECKSUM_WEIGHTS + 8 * 32
    digits = headers[:, 148:154]
    plain = (headers[:, 154] == 0) & ((digits >= 48) & (digits <= 55)).all(axis=1)
    return bool((plain & (wide[:, 148:154] @ _OCTAL_PLACES - _OCTAL_BIAS == sums)).all())


def _samples(
    url: str,
    keys: list[str],
    extensions: list[str],
    payloads: list[bytes],
    ordinals: range,
    offsets: np.ndarray,
    counts: np.ndarray,
) -> list[dict[str, Any]] | None:
    """The run's sample dicts, fields in the general walk's order; None when a sample has an extension
    twice (or one named like a field of its own): the general walk reports it."""
    starts = offsets.tolist()
    widths = counts.tolist()
    if widths.count(2) == len(widths):  # (the common shape, a text and its metadata: one dict display)
        samples = [
            {"__key__": k, "__url__": url, ORDINAL_FIELD: o, OFFSET_FIELD: s, e0: p0, e1: p1}
            for k, o, s, e0, p0, e1, p1 in zip(
                keys, ordinals, starts, extensions[0::2], payloads[0::2], extensions[1::2], payloads[1::2], strict=True
            )
        ]
    else:
        samples = []
        end = 0
        for k, o, s, width in zip(keys, ordinals, starts, widths, strict=True):
            sample = {"__key__": k, "__url__": url, ORDINAL_FIELD: o, OFFSET_FIELD: s}
            begin, end = end, end + width
            sample.update(zip(extensions[begin:end], payloads[begin:end], strict=True))
            samples.append(sample)
    return samples if list(map(len, samples)) == (counts + 4).tolist() else None
