"""Records -> samples: a JSONL record checked and laid out as a sample's key and members
(``SampleEncoder``), and the bytes of a sample as a bucket holds them (``PayloadCodec``).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import msgpack

from wdsraft.convert.keys import tar_safe_key
from wdsraft.convert.options import FORMAT_TXT_JSON


class BadRecord(Exception):
    """One input record cannot become a sample; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def _json_type(value: Any) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


# JSON that Python's json module reads but would not hand on as it came: these records are bad records.
def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent, as a float (``json.dumps`` writes it back as the float's
    shortest form); one too large for a float would become Infinity, which is not JSON."""
    value = float(text)
    if math.isinf(value):
        raise BadRecord(f"invalid JSON (the number {text[:40]} is too large for a 64-bit float)")
    return value


def _not_json(name: str) -> Any:
    raise BadRecord(f"invalid JSON ({name} is not JSON: Python's json reads it, no other JSON reader does)")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object; one naming a key twice is refused (json.loads keeps the last value silently)."""
    record = dict(pairs)
    if len(record) != len(pairs):  # (the common case costs one compare)
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadRecord(f"invalid JSON (the key {key!r} appears twice in an object)")
            seen.add(key)
    return record


class SampleEncoder:
    """Checks one JSONL record and lays it out as a sample: a key and the bytes of its fields.

    ``txt+json``: the text field as ``.txt`` (UTF-8) and the other fields as ``.json`` (encoded
    as webdataset encodes ``.json``); ``msgpack``: the whole record as ``.msgpack``. The key is
    the ``id_field`` value (escaped with :func:`tar_safe_key`) or ``INPUTNAME-LINE``.
    """

    def __init__(self, fmt: str, text_field: str, id_field: str | None):
        self.format = fmt
        self.text_field = text_field
        self.id_field = id_field
        # The order TarWriter writes members in (sorted), which is the order payloads store them.
        self.extensions = extensions_of(fmt)

    def encode(self, raw: bytes, input_name: str, line: int) -> tuple[bytes, tuple[bytes, ...]]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exn:
            raise BadRecord(
                f"not valid UTF-8 ({exn.reason}: byte 0x{raw[exn.start]:02x} at column {exn.start + 1})"
            ) from None
        try:
            record = json.loads(text, parse_float=_finite_float, parse_constant=_not_json, object_pairs_hook=_object)
        except json.JSONDecodeError as exn:
            raise BadRecord(f"invalid JSON ({exn.msg} at column {exn.colno})") from None
        except RecursionError:
            raise BadRecord("invalid JSON (nested too deeply)") from None
        except ValueError as exn:  # (an integer of more digits than Python converts: 4300)
            raise BadRecord(f"invalid JSON ({exn})") from None
        if not isinstance(record, dict):
            raise BadRecord(f"not a JSON object (a JSON {_json_type(record)})")
        body = record.get(self.text_field)
        if not isinstance(body, str):
            if self.text_field not in record:
                raise BadRecord(f"no text field {self.text_field!r}")
            raise BadRecord(f"text field {self.text_field!r} is a JSON {_json_type(body)}, not a string")
        key = self._key(record, input_name, line)
        if self.format == FORMAT_TXT_JSON:
            try:
                txt = body.encode("utf-8")
            except UnicodeEncodeError as exn:
                raise BadRecord(
                    f"text field {self.text_field!r} holds a lone surrogate \\u{ord(body[exn.start]):04x} "
                    "that UTF-8 cannot encode"
                ) from None
            del record[self.text_field]
            members: tuple[bytes, ...] = (json.dumps(record).encode("ascii"), txt)
        else:
            try:
                members = (msgpack.packb(record, use_bin_type=True),)
            except (OverflowError, UnicodeEncodeError, ValueError, TypeError) as exn:
                raise BadRecord(f"cannot encode as msgpack ({exn})") from None
        if any(len(member) > 0xFFFFFFFF for member in members):
            raise BadRecord("a field is larger than 4 GiB")
        return key, members

    def _key(self, record: dict[str, Any], input_name: str, line: int) -> bytes:
        if self.id_field is None:
            return f"{input_name}-{line:09d}".encode("ascii")
        value = record.get(self.id_field)
        if isinstance(value, str) and value:
            key = tar_safe_key(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            key = str(value)
        elif self.id_field not in record:
            raise BadRecord(f"no id field {self.id_field!r}")
        else:
            raise BadRecord(f"id field {self.id_field!r} is {_json_type(value)!s}, not a non-empty string or integer")
        if len(key) > 0xFFFF:
            raise BadRecord(f"id field {self.id_field!r} is too long for a key")
        return key.encode("ascii")


class PayloadCodec:
    """The bytes of one sample in a bucket: ``u16 key length, u32 length per field, key, fields``."""

    def __init__(self, extensions: Sequence[str]):
        self.extensions = tuple(extensions)
        self.header = struct.Struct("<H" + "I" * len(self.extensions))

    def tar_size(self, key: bytes, members: Sequence[bytes]) -> int:
        """Bytes the sample takes in a tar: a 512-byte header per member (two more blocks of PAX
        header for a name of 100 bytes or more) plus the data padded to 512."""
        total = 0
        for ext, member in zip(self.extensions, members, strict=True):
            total += 512 + ((len(member) + 511) & ~511)
            if len(key) + len(ext) >= 99:
                total += 1024
        return total

    def decode(self, buffer: memoryview, start: int) -> tuple[str, list[tuple[str, memoryview]]]:
        """The key and the (extension, bytes) members of the payload at ``start``."""
        lengths = self.header.unpack_from(buffer, start)
        at = start + self.header.size
        end = at + lengths[0]
        key = bytes(buffer[at:end]).decode("ascii")
        members = []
        for ext, length in zip(self.extensions, lengths[1:], strict=True):
            at, end = end, end + length
            members.append((ext, buffer[at:end]))
        return key, members


def extensions_of(fmt: str) -> tuple[str, ...]:
    """The members of a sample, in the (sorted) order TarWriter writes them."""
    return ("json", "txt") if fmt == FORMAT_TXT_JSON else ("msgpack",)
