"""Fixtures for remote reads under injected faults: a fault proxy in front of moto's S3 and in front of
the test HTTP server, short retry/timeout settings, and one multi-shard dataset on both."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest
from faultproxy import FaultProxy

READERS = ("s5cmd", "boto3", "http")


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries with millisecond backoff and one-second stall timeouts: faults cost little test time."""
    monkeypatch.setenv("WDSRAFT_READ_RETRIES", "3")
    monkeypatch.setenv("WDSRAFT_READ_BACKOFF", "0.01")
    monkeypatch.setenv("WDSRAFT_READ_TIMEOUT", "1")
    monkeypatch.setenv("WDSRAFT_CONNECT_TIMEOUT", "1")


def _proxy_for(base_url: str) -> FaultProxy:
    parsed = urlparse(base_url)
    return FaultProxy((parsed.hostname or "127.0.0.1", parsed.port or 80))


@pytest.fixture
def s3_proxy(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A fault proxy in front of moto; boto3 and s5cmd reach S3 through it (AWS_ENDPOINT_URL)."""
    proxy = _proxy_for(s3_endpoint)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def http_proxy(http_root: tuple[Path, str]) -> Iterator[tuple[Path, FaultProxy]]:
    """A fault proxy in front of the HTTP server; yields (served directory, proxy)."""
    root, base = http_root
    proxy = _proxy_for(base)
    try:
        yield root, proxy
    finally:
        proxy.close()


@pytest.fixture(scope="session")
def dataset_shards(write_shards) -> list[str]:
    """Three local shards of 24 samples each, 1-6 KB of random bytes per sample (about 90 KB a shard)."""
    rng = random.Random(15)
    samples = [{"bin": rng.randbytes(rng.randrange(1000, 6000)), "txt": f"sample {n}"} for n in range(72)]
    return write_shards("faulty", samples, per_shard=24)


@dataclass
class Remote:
    """The dataset as one reader sees it: its shard URLs, their bytes, and the proxy on the way."""

    reader: str
    urls: list[str]
    data: dict[str, bytes]
    proxy: FaultProxy
    local_paths: list[str]  # the shards as written, each with its index beside it

    def name(self, url: str) -> str:
        return url.rsplit("/", 1)[1]


@pytest.fixture(params=READERS)
def remote(request: pytest.FixtureRequest, dataset_shards: list[str], monkeypatch: pytest.MonkeyPatch) -> Remote:
    """The dataset behind a fault proxy, read with s5cmd (S3), boto3 (S3, ranged) or HTTP."""
    reader = request.param
    data = {Path(path).name: Path(path).read_bytes() for path in dataset_shards}
    if reader == "http":
        root, proxy = request.getfixturevalue("http_proxy")
        for path in dataset_shards:
            shutil.copy(path, root / Path(path).name)
        urls = [f"{proxy.url}/{name}" for name in sorted(data)]
    else:
        if reader == "s5cmd" and shutil.which("s5cmd") is None:
            pytest.skip("s5cmd binary not installed")
        import boto3

        bucket = request.getfixturevalue("s3_bucket")
        endpoint = request.getfixturevalue("s3_endpoint")
        client = boto3.client("s3", endpoint_url=endpoint)  # (uploads go straight to moto)
        for name, body in data.items():
            client.put_object(Bucket=bucket, Key=f"data/{name}", Body=body)
        proxy = request.getfixturevalue("s3_proxy")
        monkeypatch.setenv("WDSRAFT_S3_READER", "s5cmd" if reader == "s5cmd" else "smart_open")
        urls = [f"s3://{bucket}/data/{name}" for name in sorted(data)]
    return Remote(reader, urls, {url: data[url.rsplit("/", 1)[1]] for url in urls}, proxy, dataset_shards)


@pytest.fixture
def put_remote(request: pytest.FixtureRequest):
    """``put_remote(remote, name, body)`` stores one more object where ``remote``'s shards are; returns its URL."""

    def put(remote: Remote, name: str, body: bytes) -> str:
        if remote.reader == "http":
            root, _ = request.getfixturevalue("http_proxy")
            (root / name).write_bytes(body)
            return f"{remote.proxy.url}/{name}"
        import boto3

        bucket = request.getfixturevalue("s3_bucket")
        endpoint = request.getfixturevalue("s3_endpoint")
        boto3.client("s3", endpoint_url=endpoint).put_object(Bucket=bucket, Key=f"data/{name}", Body=body)
        return f"s3://{bucket}/data/{name}"

    return put
