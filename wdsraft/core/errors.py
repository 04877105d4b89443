"""Exceptions that name where things went wrong: the shard URL and byte offset, or the state field."""

from __future__ import annotations

import tarfile


class TarFormatError(tarfile.ReadError):
    """A shard is not a valid tar archive at some byte offset (corrupt, truncated, garbage).

    Subclasses ``tarfile.ReadError`` so code written against webdataset (which surfaces
    ``tarfile`` errors) keeps catching it.
    """

    def __init__(self, url: str, offset: int, reason: str):
        super().__init__(f"{url}: {reason} at byte offset {offset}")
        self.url = url
        self.offset = offset
        self.reason = reason

    def __reduce__(self):  # keep the fields when the error crosses a DataLoader worker boundary
        return (type(self), (self.url, self.offset, self.reason))


class IndexFormatError(ValueError):
    """An index or manifest file is unreadable, of a foreign format, or inconsistent with its shard."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason

    def __reduce__(self):
        return (type(self), (self.url, self.reason))


class StateMismatchError(ValueError):
    """A saved state does not belong to this configuration (other shards, seed, stages, rank or worker)."""


class RankFailedError(RuntimeError):
    """Another rank of the process group failed where the ranks exchange (even ends' per-step flag, its
    lengths): this rank stops with it, naming it, instead of waiting in a collective until the timeout."""


class LedgerError(IndexFormatError):
    """A ledger file is unreadable, torn, foreign, or does not belong to this ledger."""


class ShardIntegrityError(TarFormatError):
    """A shard disagrees with its index: a sample not where the index puts it, fewer or more samples,
    an archive ending early (a torn copy), another size, or a sample whose bytes changed.

    Subclasses ``TarFormatError`` (so handlers that skip damaged shards skip these too) and names the
    shard, the byte offset and, where one is known, the sample's ordinal as the shard was written.
    """

    def __init__(self, url: str, offset: int, reason: str, ordinal: int | None = None):
        where = f"sample {ordinal}: " if ordinal is not None else ""
        super().__init__(url, offset, where + reason)
        self.reason = reason
        self.ordinal = ordinal

    def __reduce__(self):
        return (type(self), (self.url, self.offset, self.reason, self.ordinal))


class RemoteReadError(OSError):
    """A remote shard (S3, HTTP) could not be read: names the URL, the byte offset reached in the stored
    object, and the remote's own reason. Network and server errors raise it once the retries are spent.

    An ``OSError``, as the transports' own errors are, so handlers catching those keep working.
    """

    def __init__(self, url: str, offset: int, reason: str, status: int | None = None):
        super().__init__(f"{url}: {reason} at byte offset {offset}")
        self.url = url
        self.offset = offset
        self.reason = reason
        #: The HTTP status the remote answered with, None for a network error.
        self.status = status

    def __reduce__(self):  # keep the fields when the error crosses a DataLoader worker boundary
        return (type(self), (self.url, self.offset, self.reason, self.status))


class RemoteNotFoundError(RemoteReadError, FileNotFoundError):
    """The remote says the shard does not exist (HTTP 404/410, S3 NoSuchKey/NoSuchBucket). Not retried."""


class RemoteAccessDeniedError(RemoteReadError, PermissionError):
    """The remote refuses the shard (HTTP 401/403, S3 AccessDenied, a bad key or signature). Not retried."""
