"""Shared fixtures: the bundled corpus, a real S3 endpoint (moto server) and an HTTP server with Range support."""

from __future__ import annotations

import functools
import http.server
import io
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard
from shardutil import free_port

REPO = Path(__file__).resolve().parent.parent
SAMPLE_CORPUS = REPO / "examples" / "data" / "kernel-docs-sample.jsonl.zst"


@pytest.fixture(autouse=True)
def _tokenizers_parallelism_per_test(monkeypatch) -> None:
    """tokenize sets TOKENIZERS_PARALLELISM in the process that encodes: each test starts without it and
    leaves none behind (so results do not depend on test order)."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "recorded-for-undo")  # (a bare delenv of an unset one records nothing)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")


@functools.lru_cache(maxsize=1)
def _corpus_records() -> tuple[dict, ...]:
    with open(SAMPLE_CORPUS, "rb") as raw:
        text = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
        return tuple(json.loads(line) for line in text)


@pytest.fixture(scope="session")
def corpus_records() -> tuple[dict, ...]:
    """The bundled slice of the Linux kernel documentation (434 real documents)."""
    return _corpus_records()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3 HTTP endpoint on 127.0.0.1 (moto in server mode), reached like any S3."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {key: os.environ.get(key) for key in _S3_ENV}
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    try:
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


@pytest.fixture
def s3_bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> str:
    """A fresh bucket on the moto endpoint; returns its name."""
    import boto3

    name = "wdsraft-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40]
    name = "".join(c for c in name if c.isalnum() or c == "-").strip("-")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=name)
    return name


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with single-range ``Range: bytes=N-`` / ``bytes=N-M`` support (as object stores have)."""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def send_head(self):  # type: ignore[no-untyped-def]
        header = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not header or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        first, _, last = header.removeprefix("bytes=").partition("-")
        start = int(first)
        end = int(last) if last else size - 1
        if start >= size:
            self.send_error(416)
            return None
        with open(path, "rb") as handle:
            handle.seek(start)
            body = handle.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        return io.BytesIO(body)


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # type: ignore[no-untyped-def]
        # A reader that seeks or stops early closes its connection mid-body, as clients of object
        # stores do: the server's broken pipe is expected, not a failure worth a traceback.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory served over HTTP on 127.0.0.1; yields (directory, base URL)."""
    root = tmp_path / "http"
    root.mkdir()
    handler = functools.partial(_RangeHandler, directory=str(root))
    server = _QuietServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def write_shards(tmp_path_factory):
    """Shards of numbered samples for a test module: ``write_shards(prefix, samples, per_shard)`` writes
    ``PREFIX-NN.tar`` (``maxcount=per_shard``) with keys ``00000``, ``00001``... and returns their URLs."""
    import wdsraft as wds

    def write(prefix: str, samples: list[dict], per_shard: int, digits: int = 2) -> list[str]:
        directory = tmp_path_factory.mktemp(prefix)
        with wds.ShardWriter(str(directory / f"{prefix}-%0{digits}d.tar"), maxcount=per_shard, verbose=0) as sink:
            for number, sample in enumerate(samples):
                sink.write({"__key__": f"{number:05d}", **sample})
        return sorted(str(p) for p in directory.glob(f"{prefix}-*.tar"))

    return write
