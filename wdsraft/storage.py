"""Atomic writes: a crash never leaves a half-written file under its final name.

Local files are written to a temporary name in the same directory, flushed to disk and
renamed over the final name. S3 objects become visible only when their upload
completes, so they are written directly (smart_open aborts a failed multipart upload).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import IO, cast
from urllib.parse import urlparse
from urllib.request import url2pathname

from .gopen import gopen


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
        self._file = open(self.temp_path, "wb")  # noqa: SIM115 - closed by close()/abort()

    def write(self, data: bytes) -> int:
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

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
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop what was written; the final name is untouched."""
        if not self._file.closed:
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
        from .gopen import s3_client

        bucket, _, key = url.removeprefix("s3://").partition("/")
        s3_client().delete_object(Bucket=bucket, Key=key)
        return
    raise ValueError(f"cannot remove {url}")


def exists(url: str) -> bool:
    """Whether a local file or an S3 object is there."""
    path = local_path(url)
    if path is not None:
        return os.path.exists(path)
    from .gopen import s3_client

    bucket, _, key = url.removeprefix("s3://").partition("/")
    try:
        s3_client().head_object(Bucket=bucket, Key=key)
    except Exception as exn:  # botocore's ClientError: 404 means absent, anything else is a real failure
        if getattr(exn, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True


def write_bytes_atomic(url: str, data: bytes) -> None:
    stream = open_atomic(url)
    try:
        stream.write(data)
    except BaseException:
        abort = getattr(stream, "abort", None)
        if abort is not None:
            abort()
        raise
    stream.close()
