"""The fault proxy does what a test scripts, and moto answers ranged GETs through it as S3 does."""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request

import boto3
import pytest
from faultproxy import Drop, Stall, Status, Truncate

pytestmark = pytest.mark.timeout(60)


def _get(url: str, headers: dict[str, str] | None = None, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as response:
        return response.read()


def test_moto_answers_ranges_through_the_proxy(s3_bucket, s3_endpoint, s3_proxy) -> None:
    body = bytes(range(256)) * 100
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=s3_bucket, Key="k", Body=body)
    client = boto3.client("s3", endpoint_url=s3_proxy.url)
    part = client.get_object(Bucket=s3_bucket, Key="k", Range="bytes=1000-")
    assert part["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert part["ContentRange"] == f"bytes 1000-{len(body) - 1}/{len(body)}"
    assert part["Body"].read() == body[1000:]
    with pytest.raises(client.exceptions.ClientError, match="InvalidRange"):
        client.get_object(Bucket=s3_bucket, Key="k", Range=f"bytes={len(body)}-")
    assert [r.range_start for r in s3_proxy.requests("/k")] == [1000, len(body)]


def test_faults_apply_as_scripted(http_proxy) -> None:
    root, proxy = http_proxy
    body = bytes(range(256)) * 400
    (root / "f.bin").write_bytes(body)
    url = f"{proxy.url}/f.bin"
    proxy.inject(Truncate(after=3000), path="f.bin", skip=1)  # the 2nd request
    proxy.inject(Status(503), path="f.bin")
    assert _get(url) == body  # 1st: let through by the first rule (skip=1)
    with pytest.raises(http.client.IncompleteRead) as short:  # 2nd: full length announced, 3000 bytes sent
        _get(url)
    assert len(short.value.partial) == 3000 and short.value.expected == len(body) - 3000
    with pytest.raises(urllib.error.HTTPError, match="503"):
        _get(url)
    assert _get(url) == body  # the rules are spent
    assert [type(r.fault).__name__ for r in proxy.requests("f.bin")] == ["NoneType", "Truncate", "Status", "NoneType"]


def test_drop_and_stall(http_proxy) -> None:
    root, proxy = http_proxy
    body = bytes(range(256)) * 4000
    (root / "f.bin").write_bytes(body)
    url = f"{proxy.url}/f.bin"
    proxy.inject(Drop(after=5000), path="f.bin")
    with pytest.raises((ConnectionResetError, http.client.IncompleteRead)):
        _get(url)
    proxy.inject(Stall(after=100, seconds=30), path="f.bin")
    with pytest.raises(TimeoutError):
        _get(url, timeout=0.5)
    proxy.inject(Stall(after=None, seconds=30), path="f.bin")
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        _get(url, timeout=0.5)
    assert _get(url, {"Range": "bytes=10-"}) == body[10:]
