"""Openers for :class:`wdsraft.io.remote.ResumableStream`: S3 through boto3 and HTTP(S) through the
standard library, each a GET from a byte offset (``Range: bytes=N-``) that says the object's size, and
each turning the remote's answer into an error that names it: not found, access denied, or a server
or network error (retried).
"""

from __future__ import annotations

import base64
import http.client
import logging
import re
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import unquote, urlparse, urlunparse

from wdsraft.core.errors import RemoteAccessDeniedError, RemoteNotFoundError, RemoteReadError
from wdsraft.io.remote import Body, EmptyBody, Opened, Opener, RetryPolicy, permanent
from wdsraft.io.s3 import s3_reader_client, split_s3_url

logger = logging.getLogger(__name__)

_S3_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_S3_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled", "403"}
_S3_BUSY = {"SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError", "Throttling"}


def status_error(url: str, offset: int, status: int | None, remote: str) -> RemoteReadError:
    """The error for an HTTP status: not found and access denied apart; other 4xx permanent; 5xx, 408
    and 429 transient."""
    if status in (404, 410):
        return RemoteNotFoundError(url, offset, f"not found ({remote})", status)
    if status in (401, 403):
        return RemoteAccessDeniedError(url, offset, f"access denied ({remote})", status)
    if status == 412:
        return permanent(RemoteReadError(url, offset, f"object changed during the read ({remote})", status))
    error = RemoteReadError(url, offset, f"server error ({remote})", status)
    if status is not None and 400 <= status < 500 and status not in (408, 429):
        permanent(error)
    return error


def s3_error(url: str, offset: int, exn: BaseException) -> RemoteReadError:
    """A boto3 failure as a :class:`RemoteReadError`, by the status and S3's error code."""
    from botocore.exceptions import ClientError

    if not isinstance(exn, ClientError):
        return RemoteReadError(url, offset, f"network error ({type(exn).__name__}: {exn})")
    status = exn.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    error = exn.response.get("Error", {})
    code, message = str(error.get("Code", "")), error.get("Message", "")
    remote = " ".join(part for part in (str(status), code if code != str(status) else "") if part)
    remote = f"{remote}: {message}" if message else remote
    if code in _S3_NOT_FOUND:
        status = 404
    elif code in _S3_DENIED:
        status = 403
    elif code in _S3_BUSY and (status is None or status < 500):
        status = 503
    return status_error(url, offset, status, remote)


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-\d+/(\d+|\*)|bytes\s+\*/(\d+)")


def parse_content_range(header: str | None) -> tuple[int | None, int | None]:
    """``(first byte, total size)`` of a ``Content-Range`` header; None for what it does not say."""
    match = _CONTENT_RANGE.match(header or "")
    if match is None:
        return None, None
    if match.group(3) is not None:
        return None, int(match.group(3))
    total = match.group(2)
    return int(match.group(1)), (int(total) if total != "*" else None)


def s3_head(url: str, policy: RetryPolicy) -> tuple[int, str | None]:
    """The size and ETag of an S3 object (one HEAD request)."""
    bucket, key = split_s3_url(url)
    try:
        head = s3_reader_client(policy.connect_timeout, policy.read_timeout).head_object(Bucket=bucket, Key=key)
    except Exception as exn:
        raise s3_error(url, 0, exn) from exn
    return int(head["ContentLength"]), head.get("ETag")


def s3_opener(url: str, policy: RetryPolicy) -> Opener:
    """GETs of an S3 object from an offset on, through boto3 with the policy's timeouts."""
    bucket, key = split_s3_url(url)

    def open_at(offset: int, etag: str | None) -> Opened:
        request: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if offset:
            request["Range"] = f"bytes={offset}-"
        if etag:
            request["IfMatch"] = etag
        try:
            response = s3_reader_client(policy.connect_timeout, policy.read_timeout).get_object(**request)
        except Exception as exn:
            error = s3_error(url, offset, exn)
            if error.status == 416:  # at or past the end
                actual = getattr(exn, "response", {}).get("Error", {}).get("ActualObjectSize")
                return Opened(EmptyBody(), int(actual) if actual is not None else None)
            raise error from exn
        first, size = parse_content_range(response.get("ContentRange"))
        if first is None:  # the whole object
            size = int(response["ContentLength"])
            if offset:
                logger.info("%s: the endpoint ignores Range; reading and discarding %d bytes", url, offset)
                _skip(response["Body"], offset)
        elif first != offset:
            response["Body"].close()
            raise permanent(RemoteReadError(url, offset, f"the endpoint answered a range from byte {first}"))
        return Opened(response["Body"], size, response.get("ETag"))

    return open_at


def http_opener(url: str, policy: RetryPolicy) -> Opener:
    """GETs of an HTTP(S) URL from an offset on (urllib: environment proxies, redirects); the read
    timeout bounds the connection too. A server that ignores ``Range`` is read and discarded up to
    the offset."""

    target, authorization = _split_credentials(url)

    def open_at(offset: int, etag: str | None) -> Opened:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        if etag and not etag.startswith("W/"):  # a weak ETag does not promise the same bytes
            headers["If-Match"] = etag
        if authorization is not None:
            headers["Authorization"] = authorization
        try:
            request = urllib.request.Request(target, headers=headers)
            response = urllib.request.urlopen(request, timeout=policy.read_timeout)
        except urllib.error.HTTPError as exn:
            with exn:
                if exn.code == 416:
                    return Opened(EmptyBody(), parse_content_range(exn.headers.get("Content-Range"))[1])
                raise status_error(url, offset, exn.code, f"{exn.code} {exn.reason}") from exn
        except (OSError, http.client.HTTPException) as exn:
            reason = exn.reason if isinstance(exn, urllib.error.URLError) else exn
            raise RemoteReadError(url, offset, f"network error ({type(reason).__name__}: {reason})") from exn
        tag = response.headers.get("ETag")
        if response.status == 206:
            first, size = parse_content_range(response.headers.get("Content-Range"))
            if first != offset:
                response.close()
                raise permanent(RemoteReadError(url, offset, f"the server answered a range from byte {first}"))
            return Opened(response, size, tag)
        length = response.headers.get("Content-Length")
        size = int(length) if length and not response.headers.get("Content-Encoding") else None
        if offset:
            logger.info("%s: the server ignores Range; reading and discarding %d bytes", url, offset)
            _skip(response, offset)
        return Opened(response, size, tag)

    return open_at


def _split_credentials(url: str) -> tuple[str, str | None]:
    """``http://user:password@host/...`` as the URL without them and a Basic ``Authorization`` header
    (as curl, which webdataset's gopen runs, takes them)."""
    parsed = urlparse(url)
    if parsed.username is None:
        return url, None
    credentials = f"{unquote(parsed.username)}:{unquote(parsed.password or '')}".encode()
    netloc = parsed.hostname or ""
    netloc = f"[{netloc}]" if ":" in netloc else netloc
    netloc += f":{parsed.port}" if parsed.port is not None else ""
    return urlunparse(parsed._replace(netloc=netloc)), "Basic " + base64.b64encode(credentials).decode("ascii")


def _skip(body: Body, count: int) -> None:
    while count > 0:
        chunk = body.read(min(count, 1 << 22))
        if not chunk:
            return
        count -= len(chunk)
