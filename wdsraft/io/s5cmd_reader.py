"""Whole S3 shards streamed by the ``s5cmd`` binary, as the first response of a
:class:`~wdsraft.io.remote.ResumableStream`: when s5cmd fails, stalls or stops short, the stream goes on
from the byte reached with the ranged boto3 reader (a pipe cannot seek).

One HEAD request (boto3) first gives the size, against which a short output is caught, the ETag,
which the ranged reader then holds the object to, and the reason when the object is missing or
refused, which s5cmd's own messages do not say apart.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import subprocess
import tempfile

from wdsraft.io.ranged import s3_head
from wdsraft.io.remote import Opened, Opener, RetryPolicy
from wdsraft.io.s3 import s5cmd_command

logger = logging.getLogger(__name__)


class S5cmdError(OSError):
    """s5cmd exited with an error or sent nothing for too long; carries its stderr."""


class S5cmdBody:
    """The stdout of ``s5cmd cat URL``; each read waits at most ``read_timeout`` for bytes (a stall)."""

    def __init__(self, binary: str, url: str, read_timeout: float):
        self.url = url
        self.read_timeout = read_timeout
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        # --retry-count 0: s5cmd does not retry behind our back; a failure falls back to the ranged reader
        command = s5cmd_command(binary, "--retry-count", "0", "cat", url)
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr, bufsize=0
        )
        assert self._process.stdout is not None
        self._fd = self._process.stdout.fileno()
        with contextlib.suppress(OSError, AttributeError):  # fewer, larger reads (Linux; up to pipe-max-size)
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, 1 << 20)

    def read(self, n: int = -1, /) -> bytes:
        ready, _, _ = select.select([self._fd], [], [], self.read_timeout)
        if not ready:
            raise S5cmdError(f"s5cmd sent nothing for {self.read_timeout:g}s (a stalled connection?)")
        data = os.read(self._fd, n if n >= 0 else 1 << 20)
        if not data:
            try:
                code = self._process.wait(timeout=self.read_timeout)
            except subprocess.TimeoutExpired:
                raise S5cmdError("s5cmd closed its output but does not exit") from None
            if code != 0:
                # (s5cmd says nothing about a failed GET: the ranged reader's reopen finds the reason)
                raise S5cmdError(f"s5cmd exited with status {code}: {self.stderr() or 'no message'}")
        return data

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read(4096).decode("utf-8", "replace").strip()

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.kill()  # a reader that stops early (or a stall): the rest is not wanted
        self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._stderr.close()


def s5cmd_opener(binary: str, url: str, policy: RetryPolicy) -> Opener:
    """The first open of a whole-shard read: HEAD for the size and ETag, then ``s5cmd cat``."""

    def open_at(offset: int, etag: str | None) -> Opened:
        if offset:
            raise ValueError(f"{url}: s5cmd streams whole objects only, not from byte {offset}")
        size, tag = s3_head(url, policy)
        return Opened(S5cmdBody(binary, url, policy.read_timeout), size, tag)

    return open_at
