"""Atomic writes: a crash never leaves a half-written file under its final name.

Local files are written to a temporary name in the same directory, flushed to disk and
renamed over the final name. S3 objects become visible only when their upload
completes, so they are written directly; a failed upload is terminated (``abort_write``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from typing import IO, Any, cast
from urllib.parse import urlparse
from urllib.request import url2pathname

from wdsraft.io.gopen import gopen
from wdsraft.io.s3 import s3_client

logger = logging.getLogger(__name__)


def local_path(url: str) -> str | None:
    """The filesystem path of a local URL (plain path or ``file:``), else None."""
    parsed = urlparse(url)
    if parsed.scheme == "":
        return url
    if parsed.scheme == "file":
        return url2pathname(parsed.path)
    return None


def is_s3(url: str) -> bool:
    return url.startswith("s3://")


class AtomicLocalFile:
    """A binary file written under a temporary name and renamed into place on ``close``."""

    def __init__(self, path: str, fsync: bool = True):
        self.path = path
        self.fsync = fsync
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self.temp_path = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            self._file = open(self.temp_path, "wb")  # noqa: SIM115 - closed by close()/abort()
        except OSError as exn:  # (named by the file being written, not its temporary name)
            raise OSError(exn.errno, exn.strerror, path) from None

    def write(self, data: bytes) -> int:
        try:
            return self._file.write(data)
        except OSError as exn:
            raise _naming(exn, self.path) from None

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as exn:
            raise _naming(exn, self.path) from None

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        """Commit: flush to disk and rename over the final name."""
        if self._file.closed:
            return
        try:
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.temp_path, self.path)
        except BaseException as exn:
            self.abort()
            if isinstance(exn, OSError):
                raise _naming(exn, self.path) from None
            raise

    def abort(self) -> None:
        """Drop what was written; the final name is untouched."""
        if not self._file.closed:
            # Closing flushes what is buffered, which fails again on a full disk: the file is closed
            # all the same, and the temporary file must go whatever happened.
            with contextlib.suppress(OSError):
                self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temp_path)

    def __enter__(self) -> AtomicLocalFile:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _naming(exn: OSError, path: str) -> OSError:
    """The error of a write, naming the file being written (a failed write names none: "[Errno 28] No
    space left on device" would not say which of a conversion's many files filled the disk)."""
    if exn.filename is not None or exn.errno is None:
        return exn
    return OSError(exn.errno, exn.strerror or os.strerror(exn.errno), path)


def open_atomic(url: str, fsync: bool = True) -> IO[bytes]:
    """Open a URL for writing such that the result appears whole or not at all (where the target allows)."""
    path = local_path(url)
    if path is not None:
        return cast(IO[bytes], AtomicLocalFile(path, fsync=fsync))
    return gopen(url, "wb")


def remove(url: str) -> None:
    """Delete a local file or an S3 object."""
    path = local_path(url)
    if path is not None:
        os.remove(path)
        return
    if is_s3(url):
        bucket, _, key = url.removeprefix("s3://").partition("/")
        s3_client().delete_object(Bucket=bucket, Key=key)
        return
    raise ValueError(f"cannot remove {url}")


def exists(url: str) -> bool:
    """Whether a local file or an S3 object is there."""
    path = local_path(url)
    if path is not None:
        return os.path.exists(path)
    bucket, _, key = url.removeprefix("s3://").partition("/")
    try:
        s3_client().head_object(Bucket=bucket, Key=key)
    except Exception as exn:  # botocore's ClientError: 404 means absent, anything else is a real failure
        if getattr(exn, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True


def abort_write(stream: Any) -> bool:
    """Give up on a stream from ``open_atomic`` so that nothing appears under its name: a local
    temporary file is removed (``abort``), an S3 upload terminated (smart_open's ``terminate``:
    a multipart upload left open is billed until a lifecycle rule removes it). False when the
    stream has neither (a pipe, say): the caller closes it."""
    cancel = getattr(stream, "abort", None) or getattr(stream, "terminate", None)
    if cancel is None:
        return False
    cancel()
    return True


def abandon_write(stream: Any) -> None:
    """``abort_write``, or close a stream that cannot be aborted (what it wrote then stays)."""
    if not abort_write(stream):
        stream.close()


def write_bytes_atomic(url: str, data: bytes) -> None:
    stream = open_atomic(url)
    try:
        stream.write(data)
        stream.close()  # (an S3 upload is completed here, and may fail here)
    except BaseException:
        try:
            abort_write(stream)
        except Exception:  # the original failure is the one to report
            logger.warning("could not discard the failed write of %s", url, exc_info=True)
        raise
