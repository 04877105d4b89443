"""Remote shard streams that survive the network: a read that fails mid-body, stalls or ends short is
reopened at the byte offset reached (an HTTP ``Range`` request), with bounded retries and backoff.

A transport supplies an *opener*: ``open_at(offset, etag)`` returns the body from ``offset`` on, the
object's size (when the remote says it) and its ETag, or raises :class:`RemoteReadError` (permanent
when it is a :class:`RemoteNotFoundError`/:class:`RemoteAccessDeniedError` or has ``transient=False``
set by :func:`permanent`). Everything else a body raises while reading counts as a network error
and is retried. The ETag of the first response is sent back (``If-Match``) on every reopen, so a
shard overwritten during the read is an error rather than a splice of two versions.
"""

from __future__ import annotations

import io
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from wdsraft.core.errors import RemoteAccessDeniedError, RemoteNotFoundError, RemoteReadError
from wdsraft.io.environment import number_from_env

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How remote reads retry. ``retries`` reopens after one failure (the count starts again once bytes
    arrive); the n-th waits ``backoff * 2**(n-1)`` seconds (at most ``backoff_max``, jittered down to
    half). ``read_timeout`` bounds a wait for bytes (a stall), ``connect_timeout`` a connection."""

    retries: int = 5
    backoff: float = 0.5
    backoff_max: float = 20.0
    read_timeout: float = 60.0
    connect_timeout: float = 10.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """The defaults, with ``WDSRAFT_READ_RETRIES``, ``WDSRAFT_READ_BACKOFF``, ``WDSRAFT_READ_TIMEOUT`` and
        ``WDSRAFT_CONNECT_TIMEOUT`` where set."""
        base = cls()
        return cls(
            retries=number_from_env("WDSRAFT_READ_RETRIES", base.retries, minimum=0),
            backoff=number_from_env("WDSRAFT_READ_BACKOFF", base.backoff, minimum=0.0),
            backoff_max=base.backoff_max,
            read_timeout=number_from_env("WDSRAFT_READ_TIMEOUT", base.read_timeout, minimum=0.0),
            connect_timeout=number_from_env("WDSRAFT_CONNECT_TIMEOUT", base.connect_timeout, minimum=0.0),
        )

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        full = min(self.backoff * 2 ** (attempt - 1), self.backoff_max)
        return full * (0.5 + random.random() / 2)  # jitter: workers that failed together retry apart


#: Set to a RetryPolicy to override the environment for every remote read of this process.
POLICY: RetryPolicy | None = None


def read_policy() -> RetryPolicy:
    """The policy in force: :data:`POLICY` when set, otherwise the environment's (read at each open)."""
    return POLICY if POLICY is not None else RetryPolicy.from_env()


class Body(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


class Opened(NamedTuple):
    """One response: its body, positioned at the offset asked for; the object's size; its ETag."""

    body: Body
    size: int | None
    etag: str | None = None


Opener = Callable[[int, "str | None"], Opened]


def permanent(error: RemoteReadError) -> RemoteReadError:
    """Mark an error the opener raises as not worth a retry (a 400, a changed object...)."""
    error.transient = False  # type: ignore[attr-defined]
    return error


def is_transient(error: BaseException) -> bool:
    if isinstance(error, (RemoteNotFoundError, RemoteAccessDeniedError)):
        return False
    return bool(getattr(error, "transient", True))


class EmptyBody:
    """The body past an object's end."""

    def read(self, n: int = -1, /) -> bytes:
        return b""

    def close(self) -> None:
        pass


class ResumableStream(io.RawIOBase):
    """A read-only, seekable stream of one remote object that reopens where it stopped after a failure.

    ``first`` opens the first response at offset 0 (an s5cmd pipe, say); reopening always goes
    through ``opener``. ``start``: where the first response starts (a seek known in advance costs
    no request from byte 0). A read returns the bytes asked for unless the object ends; an error
    after the retries raises :class:`RemoteReadError` naming the URL and the offset reached.
    """

    def __init__(
        self,
        url: str,
        opener: Opener,
        policy: RetryPolicy | None = None,
        first: Opener | None = None,
        start: int = 0,
    ):
        super().__init__()
        self.url = url
        self.policy = policy if policy is not None else read_policy()
        self._opener = opener
        self._first = first  # used for the first response only (say, an s5cmd pipe); reopens use opener
        self._pos = start
        self._body: Body | None = None
        self._size: int | None = None
        self._etag: str | None = None
        self._failures = 0  # consecutive failures without a byte in between
        self._open()  # fail now (404, 403) rather than at the first read

    @property
    def size(self) -> int | None:
        """The object's size in bytes, when the remote said it."""
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._pos
        elif whence == io.SEEK_END:
            if self._size is None:
                raise OSError(f"{self.url}: cannot seek from the end: the remote did not say the size")
            offset += self._size
        if offset < 0:
            raise ValueError(f"{self.url}: negative seek position {offset}")
        if offset != self._pos:
            self._drop_body()  # the next read opens at the new offset
            self._pos = offset
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        memoryview(buffer)[: len(data)] = data
        return len(data)

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            return self._read_all()
        chunks: list[bytes] = []
        while n > 0 and not self._at_end():
            if self._body is None:
                self._open()
                continue
            try:
                chunk = self._body.read(n)
            except Exception as exn:  # any failure of a body mid-read is the network's: reopen
                self._retry(f"{type(exn).__name__}: {exn}", exn)
                continue
            if not chunk:
                if self._size is None:
                    break  # no size to check against: the end is where the body ends
                self._retry(f"body ended early, {self._size - self._pos} of {self._size} bytes missing", None)
                continue
            chunks.append(chunk)
            self._pos += len(chunk)
            n -= len(chunk)
            self._failures = 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _read_all(self) -> bytes:
        chunks = []
        while chunk := self.read(1 << 22):
            chunks.append(chunk)
        return b"".join(chunks)

    def _at_end(self) -> bool:
        return self._size is not None and self._pos >= self._size

    def _open(self) -> None:
        while True:
            opener = self._first if self._first is not None and self._pos == 0 else self._opener
            try:
                opened = opener(self._pos, self._etag)
            except Exception as exn:
                if isinstance(exn, RemoteReadError) and not is_transient(exn):
                    raise
                self._retry(_reason(exn), exn)
                continue
            self._first = None
            self._adopt(opened, self._pos)
            return

    def _adopt(self, opened: Opened, offset: int) -> None:
        if self._size is not None and opened.size is not None and opened.size != self._size:
            opened.body.close()
            raise permanent(
                RemoteReadError(
                    self.url, offset, f"object changed during the read (size {self._size} -> {opened.size})"
                )
            )
        self._body = opened.body
        self._size = opened.size if opened.size is not None else self._size
        self._etag = self._etag or opened.etag

    def _retry(self, reason: str, cause: BaseException | None) -> None:
        """Count a failure at the current offset: wait and return (the caller reopens), or raise when spent."""
        self._drop_body()
        self._failures += 1
        if self._failures > self.policy.retries:
            status = getattr(cause, "status", None)
            error = RemoteReadError(
                self.url, self._pos, f"gave up after {self.policy.retries} retries: {reason}", status
            )
            raise error from cause
        wait = self.policy.delay(self._failures)
        logger.warning(
            "%s: read failed at byte offset %d (%s); retry %d of %d in %.2fs",
            self.url,
            self._pos,
            reason,
            self._failures,
            self.policy.retries,
            wait,
        )
        time.sleep(wait)

    def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            try:
                body.close()
            except Exception:  # a broken connection may fail to close too; it is being dropped anyway
                logger.debug("%s: closing a failed response", self.url, exc_info=True)

    def close(self) -> None:
        self._drop_body()
        super().close()


def _reason(exn: BaseException) -> str:
    if isinstance(exn, RemoteReadError):
        return exn.reason
    return f"{type(exn).__name__}: {exn}"
