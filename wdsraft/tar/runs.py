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
from wdsraft.tar.checksums import checked_headers
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
_COLUMNS = np.arange(101, dtype=np.uint8)  # name bytes, and one past the longest (a 100-byte name's end)
_NAME_WIDTHS = (16, 32, 48, 64, 80)  # where a run's names may all have ended (column 100 starts the mode)


class SampleRuns:
    """Takes runs of whole samples out of a shard's read buffer, checked against its index.

    ``ordinal`` and ``key`` are the sample reader's: the last sample ordinal it assigned and that
    sample's key as written (None before the first). The reader keeps them current, so a run
    starts exactly where the general walk would start the next sample.
    """

    def __init__(self, url: str, offsets: array):
        self.url = url
        self.offsets = np.frombuffer(offsets, dtype=np.uint64)  # (a view: readers of a few samples are common)
        self.last = len(offsets) - 2  # the shard's last sample: always read the general way
        self.ordinal = -1
        self.key: str | None = None
        self.misses = 0
        self.enabled = self.last > 0

    def take(self, buf: Any, pos: int, filled: int, base: int) -> tuple[list[dict[str, Any]] | None, int]:
        """``(samples, end)``: a run of whole samples from ``buf[pos]`` on and the archive offset just past
        it; or ``(None, until)``: members up to archive offset ``until`` go the general way (the next run
        may start there). Where no run can start, the general way goes to the next sample's start: the
        sample that runs past the buffer's end, read as the general walk reads it (its reads, and a read
        that fails, happen where they would without runs). ``until`` is always past ``buf[pos]``."""
        samples, until = self._take(buf, pos, filled, base)
        if samples is None and until <= base + pos:  # (an index whose offsets do not increase: no runs)
            return self._done()
        return samples, until

    def _take(self, buf: Any, pos: int, filled: int, base: int) -> tuple[list[dict[str, Any]] | None, int]:
        first = self.ordinal + 1
        if first > self.last:
            return self._done()
        at = base + pos
        offsets = self.offsets
        if offsets[first] != at or at % BLOCK or base % BLOCK:  # (not where a sample starts: to the next one)
            following = int(np.searchsorted(offsets, at, side="right"))
            return self._done() if following > self.last else (None, int(offsets[following]))
        # Samples first..stop-1 lie wholly in the buffer, and the first header of sample `stop` too (its
        # key must differ from theirs for the general walk to end them where the index does).
        stop = min(int(np.searchsorted(offsets, base + filled - BLOCK, side="right")) - 1, self.last)
        if stop - first < MIN_RUN:  # too few for a run's fixed cost (or none): the general way through them
            return None, int(offsets[max(stop, first + 1)])
        samples, odd = self._run(buf, first, stop, base, filled)
        if not samples:
            return self._miss(odd + 1)  # (the general way through the sample it could not take)
        self.misses = 0
        self.ordinal = first + len(samples) - 1
        self.key = samples[-1]["__key__"]
        return samples, int(offsets[self.ordinal + 1])

    def _miss(self, until: int) -> tuple[None, int]:
        """A run that could not be taken: the general way up to the start of sample ``until``; after many
        in a row, to the end."""
        self.misses += 1
        if self.misses >= MAX_MISSES or until > self.last:
            logger.debug("%s: read the general way from sample %d on", self.url, self.ordinal + 1)
            return self._done()
        return None, int(self.offsets[until])

    def _done(self) -> tuple[None, int]:
        """No more runs in this shard: the general way to its end."""
        self.enabled = False
        return None, sys.maxsize

    def _run(self, buf: Any, first: int, stop: int, base: int, filled: int) -> tuple[list[dict[str, Any]] | None, int]:
        """The longest run of samples from ``first`` on that the general walk would hand out alike, and the
        ordinal of the sample that ends it (the general walk goes through that one)."""
        starts = (self.offsets[first : stop + 1] - base).astype(np.int64)  # (the last: sample `stop`'s header)
        if (starts % BLOCK).any():
            return None, stop - 1  # (an index that puts a sample off the 512-byte grid: the general walk says so)
        blocks = np.frombuffer(buf, dtype=np.uint8, count=filled // BLOCK * BLOCK).reshape(-1, BLOCK)
        positions, sizes, counts = _members(blocks, starts[:-1], starts[1:])
        chained = len(counts)  # (the samples before the first whose members do not end where the index says)
        # Each sample's first row, and then the first header of the sample after them.
        firsts = np.concatenate((np.cumsum(counts) - counts, [len(positions)]))
        rows = np.concatenate((positions, starts[chained : chained + 1]))
        headers, _, checksums_match = checked_headers(blocks, rows // BLOCK)
        names = _Names.of(headers, checksums_match)
        # Where the general walk could part from a run: an odd header or name, or the grouping (a sample's
        # members share its key; the next sample's first member has another, else the general walk would go
        # on with the same sample; the run's first key is not the last key the reader saw).
        parting = names.odd
        starting = np.zeros(len(rows), dtype=bool)
        starting[firsts] = True
        parting[1:] |= (names.keys[1:] == names.keys[:-1]).all(axis=1) == starting[1:]
        end = int(parting.argmax()) if parting.any() else len(rows)
        # A sample is taken when the first row of the next one comes before that point (its end is known).
        count = int(np.searchsorted(firsts[1:], end, side="left"))
        odd = first + min(int(np.searchsorted(firsts, end, side="right")) - 1, chained)
        if count == 0:
            return None, odd
        keys = _text(names.keys[firsts[: count + 1]]).split(".")[:-1]  # (each key ends with its dot)
        if keys[0] == self.key:
            return None, first
        del keys[-1]  # (the next sample's)
        members = int(firsts[count])
        extensions = _text(names.extensions[:members]).lower().split(_SEPARATOR)[:-1]
        data_starts = (positions[:members] + BLOCK).tolist()
        ends = map(int.__add__, data_starts, sizes[:members].tolist())
        payloads = list(map(buf.__getitem__, map(slice, data_starts, ends)))
        samples = _samples(self.url, keys, extensions, payloads, first, starts[:count] + base, counts[:count])
        return samples, first + len(samples)


def _members(blocks: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The member header positions of the samples spanning ``starts[i]:ends[i]`` (buffer positions), in
    order, their sizes and each sample's member count, for the samples before the first whose members do
    not end exactly where the next one starts (or whose size field is not the common 11 octal digits).

    Round r finds the r-th member of every sample that has one. While every sample still has one (the
    common case: every sample the same members), no sample is picked out and the members come in order
    by interleaving the rounds."""
    found_positions, found_sizes, found_samples = [], [], []
    cut = len(starts)  # (the first sample left out)
    samples: np.ndarray | None = None  # the samples still in the walk (None: all of them)
    heads, limits = starts, ends
    counts = np.zeros(len(starts), dtype=np.int64)
    for _ in range(MAX_MEMBERS):
        fields = blocks[heads // BLOCK, 124:136]
        digits = fields[:, :11] - 48  # (uint8: a byte below "0" wraps to above 7 too)
        sizes = digits.astype(np.int64) @ _POW8
        following = heads + BLOCK + ((sizes + BLOCK - 1) & ~(BLOCK - 1))
        odd = (digits > 7).any(axis=1) | (fields[:, 11] != 0) | (following > limits)
        if odd.any():  # (those samples and all after them are left to the general walk)
            numbers = np.arange(len(heads)) if samples is None else samples
            cut = min(cut, int(numbers[odd].min()))
            kept = numbers < cut
            samples, heads, sizes, following, limits = (a[kept] for a in (numbers, heads, sizes, following, limits))
        found_positions.append(heads)
        found_sizes.append(sizes)
        found_samples.append(samples)
        if samples is None:
            counts += 1
        else:
            counts[samples] += 1
        more = following < limits
        if samples is None and more.all():
            heads = following
            continue
        if not more.any():
            break
        samples = np.flatnonzero(more) if samples is None else samples[more]
        heads, limits = following[more], limits[more]
    else:  # (more members than MAX_MEMBERS)
        cut = min(cut, int(samples.min())) if samples is not None else 0
    if cut == len(starts) and (samples is None or (counts == len(found_positions)).all()):
        # every sample the same members: the rounds interleaved are the members in order
        return np.stack(found_positions, axis=1).ravel(), np.stack(found_sizes, axis=1).ravel(), counts
    rounds = [np.arange(len(s)) if n is None else n for s, n in zip(found_positions, found_samples, strict=True)]
    every = np.concatenate(rounds)
    kept = every < cut
    positions = np.concatenate(found_positions)[kept]
    order = np.argsort(positions, kind="stable")
    return positions[order], np.concatenate(found_sizes)[kept][order], counts[:cut]


class _Names:
    """The member names of a run's headers, split as webdataset splits them (key up to the first dot,
    extension after it), as rows of bytes, and ``odd``: the rows the general walk reads otherwise than a
    run can (not a plain regular file with a good checksum, or a name not printable ASCII, in a directory,
    maybe a meta file, hidden, or without a key or an extension). Key rows keep their dot, extension rows
    end with ``_SEPARATOR``: the rows' bytes joined are the texts joined."""

    def __init__(self, keys: np.ndarray, extensions: np.ndarray, odd: np.ndarray):
        self.keys = keys
        self.extensions = extensions
        self.odd = odd

    @classmethod
    def of(cls, headers: np.ndarray, checksums_match: np.ndarray) -> _Names:
        # Regular files ('0') named in the name field alone (no ustar prefix), with good checksums (in the
        # common layout: the general walk checks the others).
        odd = (headers[:, 156] != 48) | (headers[:, 345] != 0) | ~checksums_match
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
        first_dots = dots.argmax(axis=1).astype(np.uint8)
        odd |= (
            ((_UNRUNNABLE[names] & within).any(axis=1))  # not printable ASCII, or a directory's slash
            | (names[:, 0] == 95)  # "_...": perhaps a meta file, which the general walk skips
            | (first_dots == 0)  # no dot, or a hidden name (the general walk's own rules)
            | (first_dots + 1 >= lengths)  # an empty extension
        )
        keys = names * (columns <= first_dots[:, None])  # (a product: cheaper than np.where)
        extensions = names * ((columns > first_dots[:, None]) & within)
        extensions[np.arange(len(names)), lengths] = _SEPARATOR_BYTE
        return cls(keys, extensions, odd)


def _text(rows: np.ndarray) -> str:
    """The rows' bytes, NULs left out, as text (the rows hold printable ASCII and their separators)."""
    return rows[rows != 0].tobytes().decode("ascii")


_SEPARATOR_BYTE = 1  # (no name in a run holds a control character)
_SEPARATOR = chr(_SEPARATOR_BYTE)
_UNRUNNABLE = np.ones(256, dtype=bool)  # name bytes a run leaves to the general walk
_UNRUNNABLE[32:127] = False  # printable ASCII...
_UNRUNNABLE[ord("/")] = True  # ...but a directory's: the general walk splits the basename


def _samples(
    url: str,
    keys: list[str],
    extensions: list[str],
    payloads: list[bytes],
    first: int,
    offsets: np.ndarray,
    counts: np.ndarray,
) -> list[dict[str, Any]]:
    """The run's sample dicts, fields in the general walk's order, up to the first with an extension twice
    (or one named like a field of its own): the general walk reports it."""
    ordinals = range(first, first + len(keys))
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
    expected = (counts + 4).tolist()
    sizes = list(map(len, samples))
    if sizes != expected:
        del samples[next(i for i, (a, b) in enumerate(zip(sizes, expected, strict=True)) if a != b) :]
    return samples
