"""Tar members with their byte offsets, read from a stream in large blocks.

Python's ``tarfile`` spends about 20 µs per member building ``TarInfo`` objects; a
WebDataset shard of small text samples has hundreds of thousands of members, so the
reader here parses the 512-byte headers itself (``wdsraft.tar.format``) over large
buffered blocks, and skips non-regular members. Offsets are byte offsets in the
*uncompressed* tar stream.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import mmap
import threading
import zlib
from collections.abc import Iterator
from typing import IO, Any

import numpy as np

from wdsraft.core.errors import RemoteReadError, TarFormatError
from wdsraft.tar.format import (
    _GNU_LONGLINK,
    _GNU_LONGNAME,
    _PAX_GLOBAL,
    _PAX_LOCAL,
    _REGULAR_TYPES,
    _SPARSE_TYPES,
    _ZERO_BLOCK,
    BLOCK,
    TarMember,
    _cstring,
    _decode_name,
    _padded,
    header_checksum_ok,
    parse_number,
    parse_pax_records,
)

_MAX_READ = 64 << 20
_DECOMPRESSORS = (gzip.GzipFile, bz2.BZ2File, lzma.LZMAFile)


class TarMemberReader:
    """Iterates the regular members of one uncompressed tar stream.

    ``fileobj`` must be positioned at ``start_offset`` (the offset of a header in the
    whole archive), so that the offsets reported stay absolute after a seek.

    Reads ``block_size`` bytes at a time and parses every member that lies wholly in
    the block before checking all their header checksums at once (numpy): per-member
    Python work is what limits throughput on small samples. A member larger than the
    block is read in one call. Iterate ``batches()`` for lists of members (cheapest),
    or the reader itself for one member at a time.
    """

    def __init__(self, fileobj: IO[bytes], url: str, start_offset: int = 0, block_size: int = 1 << 20):
        self.fileobj = fileobj
        self.url = url
        self.start_offset = start_offset
        self.block_size = block_size
        #: Offset just past the last member read (where the end-of-archive blocks start).
        self.end_offset = start_offset
        self._pending_name: str | None = None  # from a GNU L header or a PAX path record
        self._pending_size: int | None = None  # from a PAX size record
        self._chain_start: int | None = None  # offset of the first header of the current chain
        self._global_pax: dict[str, str] = {}
        self._seekable = _positioned_file(fileobj, start_offset)
        self._read_error: TarFormatError | None = None  # a stream error met after some bytes were read

    def __iter__(self) -> Iterator[TarMember]:
        for batch in self.batches():
            yield from batch

    def _read(self, n: int, offset: int | None = None) -> bytes:
        """Read up to n bytes, looping over short reads (pipes, sockets, decompressors).

        A size read from a header is not trusted with one allocation: reads go in chunks of
        at most 64 MiB, so a corrupt size meets the end of the stream instead of exhausting memory.
        """
        if self._read_error is not None:
            raise self._read_error
        # A decompressor's read(n) drops what it decompressed when it meets a cut (a truncated shard);
        # read1 hands that out first, so the members before the cut come out, as tarfile's do.
        read = self.fileobj.read1 if isinstance(self.fileobj, _DECOMPRESSORS) else self.fileobj.read
        chunks = []
        try:
            while n > 0:
                chunk = read(min(n, _MAX_READ))
                if not chunk:
                    break
                chunks.append(chunk)
                n -= len(chunk)
        except RemoteReadError:
            raise  # a remote read that failed for good is no format error: it names its shard and offset
        except (EOFError, OSError, lzma.LZMAError, zlib.error) as exn:
            where = self.end_offset if offset is None else offset
            error = TarFormatError(self.url, where, f"cannot read the stream ({type(exn).__name__}: {exn})")
            if not chunks:
                raise error from exn
            error.__cause__ = exn  # (raised at the next read, after the members read so far)
            self._read_error = error
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def batches(self, plain: bool = False) -> Iterator[list[Any]]:
        """Lists of the members read, in order; ``plain``: as ``(name, offset, data)`` tuples (cheaper)."""
        # A local file is read into one buffer, refilled in place (an anonymous private mmap: its slices are
        # bytes), and handed to the next reader when this one is done; other streams give a new bytes object
        # per read. (A new block of a megabyte per read came from fresh pages whenever the C allocator maps
        # such sizes anew, a page fault every 4 KiB: up to a microsecond per small sample, or nothing,
        # depending on the allocator's history.)
        window = _take_window(max(self.block_size, BLOCK) + BLOCK) if self._seekable and _PRIVATE else None
        try:
            yield from self._batches(plain, window)
        finally:
            if window is not None:
                _give_back(window)

    def _batches(self, plain: bool, window: mmap.mmap | None) -> Iterator[list[Any]]:
        url = self.url
        buf: Any = b""
        filled = 0  # bytes of buf in use
        pos = 0  # position of the next header in buf; buf[0] is at archive offset `base`
        base = self.start_offset
        while True:
            if filled - pos < BLOCK:
                if window is not None:
                    left = filled - pos  # (under one block: a member running past the buffer is read apart)
                    if left:
                        window.move(0, pos, left)
                    buf, filled = window, left + self._read_into(window, left, base + pos)
                else:
                    buf = buf[pos:filled] + self._read(max(self.block_size, BLOCK), base + pos)
                    filled = len(buf)
                base += pos
                pos = 0
                if not filled:
                    if self._chain_start is not None:
                        raise TarFormatError(url, self._chain_start, "archive ends inside an extended header chain")
                    if base == 0:
                        raise TarFormatError(url, 0, "empty file (not a tar archive)")
                    # tarfile and webdataset accept this silently, but every tar writer ends with two zero
                    # blocks: a shard cut exactly between two members would otherwise lose samples unseen.
                    raise TarFormatError(url, base, "archive ends without end-of-archive blocks (truncated?)")
                if filled < BLOCK:
                    raise TarFormatError(url, base, f"truncated header ({filled} of 512 bytes)")

            # 1. Every member wholly inside the buffer, checksums checked together afterwards.
            batch: list[Any] = []  # TarMember, or with ``plain`` (name, offset, data) from the common path
            headers: list[int] = []  # buf positions of the headers parsed
            ends: list[int] = []  # per member: its end in buf (where the next header starts)
            failure: Exception | None = None
            ended = False
            end = filled
            unchained = self._chain_start is None  # (no extended header waits for its member)
            try:
                while end - pos >= BLOCK:
                    # The size field in its common layout (11 octal digits, then NUL), read for every header
                    # here and only here; None: another layout (or none), for _size to parse.
                    try:
                        quick = int(buf[pos + 124 : pos + 135], 8) if buf[pos + 135] == 0 else None
                    except ValueError:  # (a base-256 field's high byte too: not ASCII)
                        quick = None
                    # The common member, read without slicing its header: a regular file ('0') with such a
                    # size, no extended header before it. Anything else: the general path.
                    if unchained and buf[pos + 156] == 48 and quick is not None and quick >= 0:
                        size = quick
                        data_start = pos + BLOCK
                        next_header = data_start + ((size + BLOCK - 1) & ~(BLOCK - 1))
                        if next_header > end:
                            break  # straddles the buffer: handled below, on its own
                        headers.append(pos)
                        if buf[pos + 345]:  # (a ustar prefix, perhaps)
                            name = _ustar_name(buf, pos)
                        else:
                            cut = buf.find(b"\0", pos, pos + 100)
                            name = buf[pos : cut if cut >= 0 else pos + 100].decode("utf-8", "surrogateescape")
                        data = buf[data_start : data_start + size]
                        batch.append((name, base + pos, data) if plain else TarMember(name, base + pos, data))
                        pos = next_header
                        ends.append(pos)
                        continue
                    header = buf[pos : pos + BLOCK]
                    if header == _ZERO_BLOCK:
                        ended = True
                        break
                    size = self._size(header, base + pos, quick)
                    data_start = pos + BLOCK
                    next_header = data_start + _padded(size)
                    if next_header > end:
                        break  # straddles the buffer: handled below, on its own
                    headers.append(pos)
                    member = self._member(header, base + pos, buf[data_start : data_start + size])
                    unchained = self._chain_start is None
                    pos = next_header
                    if member is not None:
                        batch.append(member)
                        ends.append(pos)
            except (TarFormatError, ValueError) as exn:
                headers.append(pos)  # a parse failure may stem from a corrupt header: check it too
                failure = exn
            bad = _first_bad_header(buf, headers, filled)
            if bad is not None or failure is not None:
                # A member is good when all its headers lie before the bad one: when it ends at or before it.
                good = [i for i, member_end in enumerate(ends) if bad is None or member_end <= headers[bad]]
                if good:
                    self.end_offset = base + ends[good[-1]]
                    yield batch[: len(good)]
                if bad is not None:
                    raise TarFormatError(url, base + headers[bad], "bad header checksum (corrupt or not a tar archive)")
                assert failure is not None
                raise failure
            if batch:
                self.end_offset = base + ends[-1]
                yield batch
            if ended:
                if self._chain_start is not None:
                    raise TarFormatError(url, base + pos, "end-of-archive block inside an extended header chain")
                self.end_offset = base + pos
                return
            if filled - pos < BLOCK:
                continue

            # 2. A member running past the buffer: check its header, read the rest in one call.
            header = buf[pos : pos + BLOCK]
            offset = base + pos
            if not header_checksum_ok(header):
                raise TarFormatError(url, offset, "bad header checksum (corrupt or not a tar archive)")
            # (`size`: this header's, from the loop above, which stopped at it)
            available = filled - pos - BLOCK
            if available >= size:
                data = buf[pos + BLOCK : pos + BLOCK + size]
                consumed = available
            elif self._seekable:  # a local file: read the member straight into its own bytes, no copy
                self.fileobj.seek(offset + BLOCK)
                data = self._read(size, offset)
                consumed = len(data)
            else:  # one read for the rest, one copy at most
                have = buf[pos + BLOCK : filled]
                data = have + self._read(size - available, offset)
                consumed = len(data)
            if len(data) < size:
                raise TarFormatError(url, offset, f"truncated member data ({len(data)} of {size} bytes)")
            consumed += len(self._read(_padded(size) - consumed))  # the padding (short only at a truncation)
            member = self._member(header, offset, data)
            base = offset + BLOCK + consumed
            filled, pos = 0, 0
            if member is not None:
                self.end_offset = base
                yield [member]

    def _read_into(self, window: mmap.mmap, start: int, offset: int) -> int:
        """Fill ``window`` from ``start`` on (``_read`` for a local file, without a new bytes object); returns
        how many bytes came."""
        if self._read_error is not None:
            raise self._read_error
        count = 0
        with memoryview(window) as view:
            try:
                while start + count < len(view):
                    got = self.fileobj.readinto(view[start + count :])  # type: ignore[attr-defined]
                    if not got:
                        break
                    count += got
            except OSError as exn:
                error = TarFormatError(self.url, offset, f"cannot read the stream ({type(exn).__name__}: {exn})")
                if not count:
                    raise error from exn
                error.__cause__ = exn  # (raised at the next read, after the members read so far)
                self._read_error = error
        return count

    def _size(self, header: bytes, offset: int, quick: int | None) -> int:
        """The member size of ``header``: a PAX record's, else ``quick`` (the field read in the common
        layout: 11 octal digits, NUL), else the field read in any layout."""
        if self._pending_size is not None and header[156:157] not in (_PAX_LOCAL, _GNU_LONGNAME, _GNU_LONGLINK):
            return self._pending_size
        if quick is not None:
            return quick
        field = header[124:136]
        try:
            size = parse_number(field)
        except ValueError:
            raise TarFormatError(self.url, offset, "bad size field in header") from None
        if size < 0:
            raise TarFormatError(self.url, offset, f"negative member size {size}")
        return size

    def _member(self, header: bytes, offset: int, data: bytes) -> TarMember | None:
        """Interpret one header and its data; returns the member it completes, if a regular file."""
        typeflag = header[156:157]
        chain_start = self._chain_start if self._chain_start is not None else offset
        if typeflag in _REGULAR_TYPES:
            name = self._pending_name if self._pending_name is not None else _ustar_name(header, 0)
            member: TarMember | None = TarMember(name, chain_start, data)
        elif typeflag == _PAX_LOCAL:
            records = parse_pax_records(data, self.url, offset)
            if any(key.startswith("GNU.sparse.") for key in records):
                raise TarFormatError(self.url, offset, "sparse members (GNU.sparse PAX records) are not supported")
            if "path" in records:
                self._pending_name = records["path"]
            if "size" in records:
                try:
                    self._pending_size = int(records["size"])
                except ValueError:
                    raise TarFormatError(self.url, offset, f"bad PAX size record {records['size']!r}") from None
                if self._pending_size < 0:
                    raise TarFormatError(self.url, offset, f"negative PAX size record {self._pending_size}")
            self._chain_start = chain_start
            return None  # the chain goes on with the member it describes
        elif typeflag == _GNU_LONGNAME:
            self._pending_name = _decode_name(_cstring(data))
            self._chain_start = chain_start
            return None
        elif typeflag == _GNU_LONGLINK:
            self._chain_start = chain_start
            return None
        elif typeflag == _PAX_GLOBAL:
            self._global_pax.update(parse_pax_records(data, self.url, offset))
            if "path" in self._global_pax or "size" in self._global_pax:
                raise TarFormatError(self.url, offset, "global PAX path/size records are not supported")
            member = None
        elif typeflag in _SPARSE_TYPES:
            raise TarFormatError(self.url, offset, "GNU sparse members are not supported")
        else:
            member = None  # directories, links, devices: skipped, as webdataset does
        self._pending_name = None
        self._pending_size = None
        self._chain_start = None
        return member


def _ustar_name(buf: bytes, pos: int) -> str:
    """The name of the ustar header at ``pos`` in ``buf`` (read without slicing the header; the hot loop has
    the common case, a name without prefix, inline)."""
    cut = buf.find(b"\0", pos, pos + 100)
    name = buf[pos : cut if cut >= 0 else pos + 100]
    if buf[pos + 345] and buf[pos + 257 : pos + 263] == b"ustar\x00":  # POSIX ustar: prefix holds directories
        name = _cstring(buf[pos + 345 : pos + 500]) + b"/" + name
    return name.decode("utf-8", "surrogateescape")


_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)  # (a window must not be shared with forked processes)
_SPARE_WINDOWS: dict[int, list[mmap.mmap]] = {}  # by size: windows of readers that finished, for the next
_MAX_SPARE = 4  # per size (readers open at once in a process: a few, with n_active_shards)


def _take_window(size: int) -> mmap.mmap:
    """A reader's buffer: a spare one of this size (its pages already there), else a new one."""
    spare = _SPARE_WINDOWS.get(size)
    if spare:
        try:
            return spare.pop()
        except IndexError:  # (another thread took the last one)
            pass
    return mmap.mmap(-1, size, flags=_PRIVATE)  # type: ignore[arg-type]


def _give_back(window: mmap.mmap) -> None:
    spare = _SPARE_WINDOWS.setdefault(len(window), [])
    if len(spare) < _MAX_SPARE:
        spare.append(window)


def _positioned_file(fileobj: IO[bytes], offset: int) -> bool:
    """Whether ``fileobj`` is a plain local file whose position is the archive offset (cheap to seek)."""
    if not isinstance(fileobj, (io.FileIO, io.BufferedReader)):
        return False
    try:
        return fileobj.tell() == offset
    except OSError:
        return False


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


def _first_bad_header(buf: Any, positions: list[int], length: int) -> int | None:
    """Index (into ``positions``) of the first header in ``buf`` (its first ``length`` bytes in use) whose
    checksum is wrong, or None."""
    if not positions:
        return None
    blocks = np.frombuffer(buf, dtype=np.uint8, count=length // BLOCK * BLOCK).reshape(-1, BLOCK)
    rows = np.asarray(positions, dtype=np.intp) // BLOCK
    if rows[-1] >= len(blocks):  # a partial header (parse failure at the buffer's end)
        rows = rows[:-1]
    count = len(rows)
    raw, wide = _scratch(count)
    headers = np.take(blocks, rows, axis=0, out=raw[:count], mode="clip")  # (rows are in range: no buffering)
    floats = wide[:count]
    np.copyto(floats, headers)
    # Sums and stored values as float32 dot products (exact: integers below 2**24; an integer sum over the
    # headers took three times as long).
    sums = floats @ _CHECKSUM_WEIGHTS + 8 * 32
    # The usual stored checksum (six octal digits, then NUL) is read here for all headers at once: the
    # ones that match need no more; the others are looked at one by one below.
    digits = headers[:, 148:154]
    plain = (headers[:, 154] == 0) & ((digits >= 48) & (digits <= 55)).all(axis=1)
    matches = plain & (floats[:, 148:154] @ _OCTAL_PLACES - _OCTAL_BIAS == sums)
    if matches.all():
        return None
    for i in np.flatnonzero(~matches).tolist():
        computed = int(sums[i])
        header = buf[positions[i] : positions[i] + BLOCK]
        field = header[148:156]
        try:
            stored = int(field[:6], 8) if field[6:7] == b"\0" else parse_number(field)
        except ValueError:
            return i
        if stored != computed and not header_checksum_ok(header):  # the slow check accepts signed sums
            return i
    return None
