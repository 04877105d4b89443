"""The tar format at the byte level: 512-byte headers parsed (ustar with ``prefix``, GNU ``L``/``K``
long names and base-256 numbers, PAX ``x``/``g`` records) and built for writing; padding; the end
of an archive.
"""

from __future__ import annotations

import tarfile
from typing import Any, NamedTuple

from wdsraft.core.errors import TarFormatError

BLOCK = 512


RECORD = 20 * BLOCK  # tar archives are padded to a multiple of this (GNU tar, tarfile)


_ZERO_BLOCK = bytes(BLOCK)


_REGULAR_TYPES = frozenset((b"0", b"\0", b"7"))


_PAX_LOCAL = b"x"


_PAX_GLOBAL = b"g"


_GNU_LONGNAME = b"L"


_GNU_LONGLINK = b"K"


_SPARSE_TYPES = frozenset((b"S",))


class TarMember(NamedTuple):
    """A regular file read from a tar stream."""

    name: str
    #: Offset of the first header of this member (its PAX or GNU long-name header when it has one).
    offset: int
    data: bytes


def _padded(size: int) -> int:
    return (size + BLOCK - 1) & ~(BLOCK - 1)


def parse_number(field: bytes) -> int:
    """Decode a numeric header field: octal ASCII, or GNU base-256 when the high bit is set."""
    if field and field[0] & 0x80:
        value = int.from_bytes(field[1:], "big")
        if field[0] == 0xFF:  # negative base-256 number
            value -= 256 ** (len(field) - 1)
        return value
    digits = field.rstrip(b"\0 ").lstrip(b" ")
    return int(digits, 8) if digits else 0


def _decode_name(raw: bytes) -> str:
    # tarfile decodes names with the filesystem encoding and surrogateescape; so do we.
    return raw.decode("utf-8", "surrogateescape")


def _cstring(field: bytes) -> bytes:
    end = field.find(b"\0")
    return field if end < 0 else field[:end]


def header_checksum_ok(header: bytes) -> bool:
    """Check the header checksum; accept both the unsigned and the historic signed sums."""
    try:
        stored = parse_number(header[148:156])
    except ValueError:
        return False
    unsigned = sum(header) - sum(header[148:156]) + 8 * 32
    if stored == unsigned:
        return True
    signed = (
        sum(b - 256 if b > 127 else b for b in header)
        - sum(b - 256 if b > 127 else b for b in header[148:156])
        + 8 * 32
    )
    return stored == signed


def parse_pax_records(payload: bytes, url: str, offset: int) -> dict[str, str]:
    """Parse PAX extended header records (``"%d %s=%s\\n"``)."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(payload) and payload[pos] != 0:
        space = payload.find(b" ", pos)
        if space < 0:
            raise TarFormatError(url, offset, "malformed PAX header (no record length)")
        try:
            length = int(payload[pos:space])
        except ValueError:
            raise TarFormatError(url, offset, "malformed PAX header (bad record length)") from None
        record = payload[space + 1 : pos + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise TarFormatError(url, offset, "malformed PAX header record")
        keyword, _, value = record[:-1].partition(b"=")
        records[keyword.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


class HeaderBuilder:
    """Builds the header block(s) for a regular-file member.

    Short ASCII names take a fast path that produces the same bytes as ``tarfile``;
    anything else (long or non-ASCII names, huge sizes) goes through ``tarfile`` itself
    so that the chosen format's rules (ustar prefix, GNU ``L``, PAX ``x``) apply exactly.
    """

    def __init__(self, user: str, group: str, mode: int, format: Any = tarfile.PAX_FORMAT):
        self.user = user
        self.group = group
        self.mode = mode
        self.format = format
        magic = tarfile.GNU_MAGIC if format == tarfile.GNU_FORMAT else tarfile.POSIX_MAGIC
        self._mode_uid_gid = b"%07o\0%07o\0%07o\0" % (mode & 0o7777, 0, 0)
        self._middle = b"        0" + bytes(100) + magic + _field(user, 32) + _field(group, 32) + bytes(16)
        self._tail = bytes(155 + 12)
        # Longer or non-ASCII owner names need PAX records in PAX format: tarfile decides those.
        self._fast = all(name.isascii() and len(name) < 32 for name in (user, group))

    def build(self, name: str, size: int, mtime: int) -> bytes:
        encoded = name.encode("utf-8", "surrogateescape")
        if not self._fast or len(encoded) >= 100 or not encoded.isascii() or size >= 8**11 or not 0 <= mtime < 8**11:
            return self._build_with_tarfile(name, size, mtime)
        header = b"".join(
            (
                encoded,
                bytes(100 - len(encoded)),
                self._mode_uid_gid,
                b"%011o\0%011o\0" % (size, mtime),
                self._middle,
                self._tail,
            )
        )
        checksum = sum(header)
        return header[:148] + b"%06o\0" % checksum + header[155:]

    def _build_with_tarfile(self, name: str, size: int, mtime: int) -> bytes:
        info = tarfile.TarInfo(name)
        info.size = size
        info.mtime = mtime
        info.mode = self.mode
        info.uname = self.user
        info.gname = self.group
        return info.tobuf(self.format, "utf-8", "surrogateescape")


def _field(text: str, width: int) -> bytes:
    raw = text.encode("utf-8", "surrogateescape")[:width]
    return raw + bytes(width - len(raw))


def end_of_archive(written: int) -> bytes:
    """The two zero blocks that end an archive, plus padding to a full record (as GNU tar writes)."""
    total = written + 2 * BLOCK
    return bytes(2 * BLOCK + (-total) % RECORD)


def member_padding(size: int) -> bytes:
    return bytes((-size) % BLOCK)
