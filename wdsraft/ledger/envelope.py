"""The checksummed envelope of the ledger's files (rank files, snapshots): a msgpack map naming the
format and its version, the body as msgpack bytes, and the body's sha256. A torn or altered file is
told from a foreign one before the body is parsed; parsing is plain msgpack, never code."""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from wdsraft.core.errors import LedgerError


def seal(fmt: str, version: int, record: dict[str, Any]) -> bytes:
    """The bytes of a file holding ``record``, in the envelope of ``fmt`` at ``version``."""
    body = msgpack.packb(record, use_bin_type=True)
    envelope = {"format": fmt, "version": version, "sha256": hashlib.sha256(body).hexdigest(), "body": body}
    return msgpack.packb(envelope, use_bin_type=True)


def unseal(url: str, raw: bytes, fmt: str, version: int, kind: str) -> dict[str, Any]:
    """The record of a file sealed as ``fmt``/``version``; ``LedgerError`` naming ``url`` (a ``kind``, in
    words) where it is not msgpack, another format or version, or its checksum does not hold."""
    try:
        outer = msgpack.unpackb(raw, raw=False)
    except Exception as exn:
        raise LedgerError(url, f"unreadable {kind} (torn or not msgpack: {exn})") from None
    if not isinstance(outer, dict) or outer.get("format") != fmt:
        raise LedgerError(url, f"not a wdsraft {kind}")
    if outer.get("version") != version:
        raise LedgerError(url, f"unsupported {kind} version {outer.get('version')!r}")
    body = outer.get("body", b"")
    if not isinstance(body, bytes) or hashlib.sha256(body).hexdigest() != outer.get("sha256"):
        raise LedgerError(url, f"checksum mismatch: the {kind} is torn or corrupt")
    try:
        record = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exn:  # (the checksum held: written so)
        raise LedgerError(url, f"checksum right but the {kind}'s body is not msgpack ({exn})") from None
    if not isinstance(record, dict):
        raise LedgerError(url, f"checksum right but not the structure of a {kind} (the body is not a map)")
    return record
