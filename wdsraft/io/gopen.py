"""Opening shards by URL, positioned at a byte offset.

``gopen`` keeps webdataset's contract (same schemes, ``pipe:``, ``GOPEN_REWRITE``) and adds
``s3://`` through smart_open/boto3. ``open_shard`` is what the readers use: it returns a
stream of the *uncompressed* tar positioned at a given offset, seeking where the
transport can (local ``seek``, HTTP/S3 ``Range`` requests) and otherwise reading and
discarding up to the offset.

Whole-shard S3 reads go through the ``s5cmd`` binary when it is installed
(``WDSRAFT_S3_READER=auto``, the default) or always (``s5cmd``) or never (``smart_open``: the ranged
boto3 reader); see ``wdsraft.io.s3``. Remote shards (S3, HTTP) are resumable streams: a
dropped, stalled or short response is reopened at the byte reached (``wdsraft.io.remote``).
"""

from __future__ import annotations

import io
import logging
import lzma
import zlib
from typing import IO, Any, BinaryIO, cast
from urllib.parse import urlparse
from urllib.request import url2pathname

from webdataset.gopen import gopen as webdataset_gopen
from webdataset.gopen import rewrite_url

from wdsraft.core.errors import RemoteReadError, TarFormatError
from wdsraft.io.compression import uncompressed
from wdsraft.io.ranged import http_opener, s3_opener
from wdsraft.io.remote import ResumableStream, read_policy
from wdsraft.io.s3 import s3_client, s5cmd_binary
from wdsraft.io.s5cmd_reader import s5cmd_opener

logger = logging.getLogger(__name__)


def _smart_open(url: str, mode: str) -> BinaryIO:
    import smart_open

    params: dict[str, Any] = {}
    if url.startswith("s3://"):
        params = {"client": s3_client()}
    return cast(BinaryIO, smart_open.open(url, mode, transport_params=params, compression="disable"))


def gopen(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> IO[bytes]:
    """Open a URL like webdataset's ``gopen``, with ``s3://`` added: read by ranged requests that resume
    where a failure stopped them (see ``wdsraft.io.remote``), written by smart_open/boto3."""
    if mode not in ("rb", "wb"):
        raise ValueError(f"gopen: unsupported mode {mode!r} for {url}")
    target = rewrite_url(url)
    if urlparse(target).scheme == "s3":
        if mode == "rb":  # indexes, manifests, ledger files: the same retries as shard reads
            policy = read_policy()
            return io.BufferedReader(ResumableStream(target, s3_opener(target, policy), policy), 1 << 20)
        return _smart_open(target, mode)
    return cast(IO[bytes], webdataset_gopen(url, mode, bufsize, **kw))  # (which applies GOPEN_REWRITE itself)


def _open_raw(url: str, offset: int, plain: bool = False) -> IO[bytes]:
    """Open the stored bytes of a shard from the start; ``offset`` says where the caller will go next
    (a whole-shard read may stream through s5cmd; a later seek needs a seekable reader). A remote
    ``plain`` shard (no look at its first bytes) opens at ``offset`` directly."""
    original, url = url, rewrite_url(url)
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        path = url if parsed.scheme == "" else url2pathname(parsed.path)
        return open(path, "rb", buffering=0)
    if parsed.scheme == "s3":
        policy = read_policy()
        binary = s5cmd_binary() if offset == 0 else None
        first = s5cmd_opener(binary, url, policy) if binary is not None else None
        start = offset if plain else 0
        return cast(IO[bytes], ResumableStream(url, s3_opener(url, policy), policy, first=first, start=start))
    if parsed.scheme in ("http", "https"):
        policy = read_policy()
        return cast(IO[bytes], ResumableStream(url, http_opener(url, policy), policy, start=offset if plain else 0))
    return cast(IO[bytes], webdataset_gopen(original, "rb"))  # (which applies GOPEN_REWRITE itself)


def _can_seek(stream: IO[bytes]) -> bool:
    seekable = getattr(stream, "seekable", None)
    try:
        return bool(seekable()) if seekable is not None else False
    except (OSError, ValueError):
        return False


def discard(stream: IO[bytes], count: int, url: str) -> None:
    """Read and drop ``count`` bytes from a stream that cannot seek."""
    if count <= 0:
        return
    logger.info("%s: stream cannot seek; reading and discarding %d bytes", url, count)
    left = count
    try:
        while left > 0:
            chunk = stream.read(min(left, 1 << 22))
            if not chunk:
                raise TarFormatError(url, count - left, f"stream ends before offset {count}")
            left -= len(chunk)
    except RemoteReadError:
        raise  # already names the shard, the offset and the remote's reason
    except (EOFError, OSError, lzma.LZMAError, zlib.error) as exn:
        raise TarFormatError(url, count - left, f"cannot read the stream ({type(exn).__name__}: {exn})") from exn


def open_shard(url: str, offset: int = 0, *, plain: bool = False) -> IO[bytes]:
    """Open a shard as an uncompressed tar stream positioned at ``offset``.

    Compressed shards (gzip, bz2, xz, zstd) are recognised by their first bytes, whatever
    their name, and decompressed on the fly; offsets count uncompressed bytes, so seeking
    into them decompresses up to the offset. Plain shards seek (local ``seek``, HTTP/S3
    ``Range``) where the transport can, and otherwise read and discard up to the offset.
    ``plain``: the caller knows the shard is an uncompressed tar (its index says so), so its
    first bytes are not read to recognise it: on S3 or HTTP a seek is one request, not two.
    """
    raw = _open_raw(url, offset, plain)
    try:
        if plain and _can_seek(raw):
            raw.seek(offset)  # (a remote stream opened there already: no request)
            return raw
        stream, kind = uncompressed(raw)
        if kind is None and offset == 0 and isinstance(raw, ResumableStream):
            return stream  # (the first bytes read stay in front: seeking back would cost a request)
        if kind is None and _can_seek(raw):
            raw.seek(offset)
            return raw
        discard(stream, offset, url)
        return stream
    except BaseException:
        raw.close()
        raise
