"""Seeking to a sample's byte offset yields that sample and the rest of the shard, on every transport."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import boto3
import pytest
import webdataset
from shardutil import corpus_samples

import wdsraft
from wdsraft.io.gopen import open_shard


@pytest.fixture
def shard(tmp_path: Path, corpus_records) -> tuple[str, list[dict]]:
    """A wdsraft shard of 40 real documents (with one long name), and its full read."""
    samples = corpus_samples(corpus_records, 40)
    samples[9]["__key__"] = "long/" + "n" * 150  # a PAX path record: the sample starts at its PAX header
    url = str(tmp_path / "shard.tar")
    with wdsraft.TarWriter(url) as sink:
        for sample in samples:
            sink.write(sample)
    # Read without the index's checks: a reader that misplaces samples must fail the tests' comparisons
    # with the index, not this fixture (the canary's tar-chain-start-offset counts failed tests).
    return url, list(wdsraft.ShardSampleReader(url, index=None))


def _tails_match(url: str, full: list[dict], ordinals: list[int] | None = None) -> None:
    index = wdsraft.ShardIndex.load(url) if not url.startswith(("pipe:", "http")) else None
    offsets = [s["__offset__"] for s in full]
    if index is not None:
        assert list(index.offsets[:-1]) == offsets
    for ordinal in ordinals if ordinals is not None else range(len(full)):
        tail = list(wdsraft.ShardSampleReader(url, offset=offsets[ordinal], ordinal=ordinal))
        expected = [{**s, "__url__": url} for s in full[ordinal:]]
        assert tail == expected, f"resume at sample {ordinal}"


def test_seek_to_every_sample_local(shard) -> None:
    url, full = shard
    _tails_match(url, full)


def test_seek_through_file_url(shard) -> None:
    url, full = shard
    _tails_match("file://" + url, [{**s, "__url__": "file://" + url} for s in full], [0, 9, 10, 39])


def test_next_position_resumes_exactly(shard) -> None:
    """After every sample, (next_offset, next_ordinal) is a resume point that continues the stream."""
    url, full = shard
    reader = wdsraft.ShardSampleReader(url)
    for count, _sample in enumerate(reader):
        rest = list(wdsraft.ShardSampleReader(url, offset=reader.next_offset, ordinal=reader.next_ordinal))
        assert rest == full[count + 1 :]
    assert reader.exhausted and reader.next_ordinal == len(full)


def test_seek_in_a_pipe_reads_and_discards(shard, caplog) -> None:
    url, full = shard
    pipe_url = f"pipe:cat {url}"
    with caplog.at_level(logging.INFO, logger="wdsraft"):
        _tails_match(pipe_url, [{**s, "__url__": pipe_url} for s in full], [0, 5, 39])
    assert "cannot seek" in caplog.text


def test_seek_in_gzipped_shard(tmp_path: Path, corpus_records) -> None:
    url = str(tmp_path / "shard.tar.gz")
    with wdsraft.TarWriter(url) as sink:
        for sample in corpus_samples(corpus_records, 30):
            sink.write(sample)
    full = list(wdsraft.ShardSampleReader(url))
    index = wdsraft.ShardIndex.load(url)
    assert index.compression == "gzip" and index.num_samples == 30
    _tails_match(url, full, [0, 1, 17, 29])


def test_tarfile_samples_accepts_offsets(shard) -> None:
    url, full = shard
    index = wdsraft.ShardIndex.load(url)
    sources = [{"url": url, "offset": index.offset_of(30), "ordinal": 30}, {"url": url}]
    assert list(wdsraft.tarfile_samples(sources)) == full[30:] + full


def test_seek_over_http_range(shard, http_root) -> None:
    url, full = shard
    root, base = http_root
    shutil.copy(url, root / "shard.tar")
    http_url = f"{base}/shard.tar"
    stream = open_shard(http_url, full[20]["__offset__"])
    try:
        assert stream.tell() == full[20]["__offset__"]  # positioned by a Range request, not by reading
    finally:
        stream.close()
    _tails_match(http_url, [{**s, "__url__": http_url} for s in full], [0, 20, 39])


@pytest.mark.parametrize("reader", ["smart_open", "s5cmd"])
def test_s3_whole_shard_and_seek(shard, s3_bucket, monkeypatch, reader) -> None:
    if reader == "s5cmd" and shutil.which("s5cmd") is None:
        pytest.skip("s5cmd binary not installed")
    monkeypatch.setenv("WDSRAFT_S3_READER", reader)
    url, full = shard
    client = boto3.client("s3")
    client.upload_file(url, s3_bucket, "data/shard.tar")
    client.upload_file(url + ".idx", s3_bucket, "data/shard.tar.idx")
    s3_url = f"s3://{s3_bucket}/data/shard.tar"
    s3_full = [{**s, "__url__": s3_url} for s in full]
    assert list(wdsraft.ShardSampleReader(s3_url)) == s3_full
    index = wdsraft.ShardIndex.load(s3_url)
    assert index.num_samples == len(full)
    for ordinal in (1, 9, 25, 39):
        tail = list(wdsraft.ShardSampleReader(s3_url, offset=index.offset_of(ordinal), ordinal=ordinal))
        assert tail == s3_full[ordinal:]


def test_webdataset_reads_through_wdsraft_gopen_from_s3(shard, s3_bucket) -> None:
    url, full = shard
    boto3.client("s3").upload_file(url, s3_bucket, "shard.tar")
    with wdsraft.gopen(f"s3://{s3_bucket}/shard.tar") as stream:
        samples = list(webdataset.tariterators.tar_file_iterator(stream))
    assert len(samples) == 2 * len(full)


def test_compression_is_recognised_by_content_not_name(tmp_path: Path, corpus_records) -> None:
    """A gzipped shard without a .gz name resumes; a plain tar named .gz reads (as webdataset reads it)."""
    samples = corpus_samples(corpus_records, 20)
    hidden = str(tmp_path / "hidden-gzip.tar")
    with open(hidden, "wb") as raw, wdsraft.TarWriter(raw, compress=True) as sink:
        for sample in samples:
            sink.write(sample)
    full = list(wdsraft.ShardSampleReader(hidden))
    for ordinal in (7, 19):
        tail = list(wdsraft.ShardSampleReader(hidden, offset=full[ordinal]["__offset__"], ordinal=ordinal))
        assert tail == full[ordinal:]
    plain_named_gz = str(tmp_path / "plain.tar.gz")
    with wdsraft.TarWriter(plain_named_gz, compress=False) as sink:
        for sample in samples:
            sink.write(sample)
    assert [s["__key__"] for s in wdsraft.ShardSampleReader(plain_named_gz)] == [s["__key__"] for s in samples]
    named_like_bzip2 = str(tmp_path / "bzlike.tar")
    with wdsraft.TarWriter(named_like_bzip2) as sink:
        sink.write({"__key__": "BZh9_sample", "txt": "not compressed"})
    assert [s["__key__"] for s in wdsraft.ShardSampleReader(named_like_bzip2)] == ["BZh9_sample"]
