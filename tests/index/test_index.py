"""Shard indexes, the manifest, the `wdsraft index` command and atomic writes."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import boto3
import msgpack
import pytest
import webdataset
from shardutil import corpus_samples

import wdsraft
import wdsraft.io.storage
from wdsraft.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]


def _webdataset_shards(directory: Path, corpus_records, count: int = 130, per_shard: int = 40) -> list[str]:
    with webdataset.ShardWriter(str(directory / "theirs-%04d.tar"), maxcount=per_shard, verbose=0) as sink:
        for sample in corpus_samples(corpus_records, count):
            sink.write(sample)
    return sorted(str(p) for p in directory.glob("theirs-*.tar"))


def test_writer_index_equals_built_index(tmp_path: Path, corpus_records) -> None:
    url = str(tmp_path / "shard.tar")
    with wdsraft.TarWriter(url) as sink:
        for sample in corpus_samples(corpus_records, 50):
            sink.write(sample)
    saved = wdsraft.ShardIndex.load(url)
    built = wdsraft.build_index(url)
    assert saved == built
    assert saved.num_samples == 50 and saved.size == os.path.getsize(url)
    assert saved.sha256 == hashlib.sha256(Path(url).read_bytes()).hexdigest()
    samples = list(wdsraft.ShardSampleReader(url))
    assert list(saved.offsets[:-1]) == [s["__offset__"] for s in samples]


def test_index_file_is_plain_msgpack(tmp_path: Path, corpus_records) -> None:
    url = str(tmp_path / "shard.tar")
    with wdsraft.TarWriter(url) as sink:
        for sample in corpus_samples(corpus_records, 5):
            sink.write(sample)
    record = msgpack.unpackb(Path(url + ".idx").read_bytes())
    assert record["format"] == "wdsraft-shard-index" and record["num_samples"] == 5
    assert len(record["offsets"]) == 8 * 6


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[: len(raw) // 2],  # torn write
        lambda raw: b"\x80\x04\x95 pickle-looking bytes",
        lambda raw: msgpack.packb({"format": "something-else"}),
        lambda raw: json.dumps({"format": "wdsraft-shard-index"}).encode(),
    ],
)
def test_foreign_or_torn_index_is_rejected(tmp_path: Path, corpus_records, damage) -> None:
    url = str(tmp_path / "shard.tar")
    with wdsraft.TarWriter(url) as sink:
        for sample in corpus_samples(corpus_records, 5):
            sink.write(sample)
    Path(url + ".idx").write_bytes(damage(Path(url + ".idx").read_bytes()))
    with pytest.raises(wdsraft.IndexFormatError, match=r"shard\.tar\.idx"):
        wdsraft.ShardIndex.load(url)


def test_missing_index_says_how_to_build_one(tmp_path: Path) -> None:
    with pytest.raises(wdsraft.IndexFormatError, match="wdsraft index"):
        wdsraft.ShardIndex.load(str(tmp_path / "nothing.tar"))


def test_shard_writer_manifest(tmp_path: Path, corpus_records) -> None:
    committed = []
    with wdsraft.ShardWriter(str(tmp_path / "ds-%05d.tar"), maxcount=100, verbose=0, post=committed.append) as sink:
        for sample in corpus_samples(corpus_records):
            sink.write(sample)
    manifest_path = str(tmp_path / "manifest.json")
    manifest = wdsraft.Manifest.load(manifest_path)
    assert manifest.num_samples == len(corpus_records)
    assert [e.num_samples for e in manifest.shards] == [100, 100, 100, 100, 34]
    assert manifest.urls(manifest_path) == committed == [str(tmp_path / f"ds-{n:05d}.tar") for n in range(5)]
    for entry, url in zip(manifest.shards, committed, strict=False):
        assert entry.sha256 == hashlib.sha256(Path(url).read_bytes()).hexdigest()
        assert entry.size == os.path.getsize(url)
    record = json.loads(Path(manifest_path).read_text())
    assert record["__kind__"] == "wids-shard-index-v1"
    assert record["shardlist"][0] == {
        "url": "ds-00000.tar",
        "nsamples": 100,
        "filesize": manifest.shards[0].size,
        "sha256": manifest.shards[0].sha256,
        "index": "ds-00000.tar.idx",
    }


def test_index_command_on_webdataset_shards(tmp_path: Path, corpus_records, capsys) -> None:
    urls = _webdataset_shards(tmp_path, corpus_records)
    assert cli_main(["index", str(tmp_path / "theirs-*.tar"), "--workers", "2", "--quiet"]) == 0
    assert "indexed 4 of 4 shards, 130 samples" in capsys.readouterr().out
    manifest = wdsraft.Manifest.load(str(tmp_path / "manifest.json"))
    assert [e.url for e in manifest.shards] == [os.path.basename(u) for u in urls]
    assert manifest.num_samples == 130
    for url in urls:
        index = wdsraft.ShardIndex.load(url)
        samples = list(wdsraft.ShardSampleReader(url))
        assert list(index.offsets[:-1]) == [s["__offset__"] for s in samples]
        tail = list(wdsraft.ShardSampleReader(url, offset=index.offset_of(7), ordinal=7))
        assert tail == samples[7:]


def test_index_command_reports_bad_shards_and_goes_on(tmp_path: Path, corpus_records, capsys) -> None:
    urls = _webdataset_shards(tmp_path, corpus_records)
    Path(urls[1]).write_bytes(Path(urls[1]).read_bytes()[:3000])
    assert cli_main(["index", *urls, "--workers", "1", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "indexed 3 of 4 shards" in captured.out
    assert "theirs-0001.tar" in captured.err and "byte offset" in captured.err
    assert not os.path.exists(urls[1] + ".idx")
    assert "no manifest written: 1 of 4 shards failed" in captured.err
    assert not os.path.exists(tmp_path / "manifest.json")  # (one of the good shards only: a silently smaller dataset)


def test_index_command_keeps_the_manifest_convert_wrote(tmp_path: Path, capsys) -> None:
    """Re-indexing converted shards rewrites their indexes (the same bytes) but not convert's manifest,
    which records the inputs and the conversion; another --manifest path is written as asked."""
    corpus = REPO / "examples" / "data" / "kernel-docs-sample.jsonl.zst"
    assert (
        cli_main(["convert", str(corpus), "--output", str(tmp_path / "out"), "-q", "--samples-per-shard", "200"]) == 0
    )
    manifest = tmp_path / "out" / "manifest.json"
    written = manifest.read_bytes()
    assert wdsraft.Manifest.load(str(manifest)).conversion is not None
    capsys.readouterr()
    assert cli_main(["index", str(tmp_path / "out" / "out-*.tar"), "--workers", "1", "-q"]) == 1
    assert "written by wdsraft convert" in capsys.readouterr().err
    assert manifest.read_bytes() == written
    other = tmp_path / "out" / "reindexed.json"
    assert (
        cli_main(["index", str(tmp_path / "out" / "out-*.tar"), "--workers", "1", "-q", "--manifest", str(other)]) == 0
    )
    assert wdsraft.Manifest.load(str(other)).num_samples == 434


def test_index_command_on_s3_prefix(tmp_path: Path, corpus_records, s3_bucket, capsys) -> None:
    urls = _webdataset_shards(tmp_path, corpus_records, count=90, per_shard=30)
    client = boto3.client("s3")
    for url in urls:
        client.upload_file(url, s3_bucket, f"ds/{os.path.basename(url)}")
    assert cli_main(["index", f"s3://{s3_bucket}/ds/", "--quiet", "--workers", "2"]) == 0
    manifest_url = f"s3://{s3_bucket}/ds/manifest.json"
    manifest = wdsraft.Manifest.load(manifest_url)
    assert manifest.num_samples == 90 and len(manifest.shards) == 3
    remote = manifest.urls(manifest_url)
    index = wdsraft.ShardIndex.load(remote[2])
    assert index.sha256 == hashlib.sha256(Path(urls[2]).read_bytes()).hexdigest()
    tail = list(wdsraft.ShardSampleReader(remote[2], offset=index.offset_of(29), ordinal=29))
    assert len(tail) == 1 and tail[0]["__key__"] == f"{89:08d}"


def test_exception_inside_writer_leaves_nothing(tmp_path: Path, corpus_records) -> None:
    url = tmp_path / "shard.tar"
    with pytest.raises(RuntimeError), wdsraft.TarWriter(str(url)) as sink:
        for sample in corpus_samples(corpus_records, 10):
            sink.write(sample)
        raise RuntimeError("crash while writing")
    assert os.listdir(tmp_path) == []


def test_killed_writer_never_leaves_a_partial_shard(tmp_path: Path) -> None:
    """SIGKILL in the middle of a shard: committed shards are whole, the one in progress is absent."""
    script = textwrap.dedent(
        f"""
        import os, sys, wdsraft
        with wdsraft.ShardWriter({str(tmp_path / "ds-%03d.tar")!r}, maxcount=50, verbose=0) as sink:
            for n in range(10_000):
                sink.write({{"__key__": f"{{n:06d}}", "txt": "x" * 2000}})
                if n == 120:
                    print("ready", flush=True)
                    os.kill(os.getpid(), 9)
        """
    )
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert process.returncode == -signal.SIGKILL and "ready" in process.stdout
    shards = sorted(p.name for p in tmp_path.glob("ds-*.tar"))
    assert shards == ["ds-000.tar", "ds-001.tar"]  # shard 2 was being written: not under its final name
    for name in shards:
        assert len(list(wdsraft.ShardSampleReader(str(tmp_path / name)))) == 50


def test_cli_help_explains_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "wdsraft.cli", "index", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0 and "manifest" in result.stdout and "s3://" in result.stdout


def test_cli_ls_seeks_through_the_index(tmp_path: Path, corpus_records, capsys) -> None:
    url = str(tmp_path / "shard.tar")
    with wdsraft.TarWriter(url) as sink:
        for sample in corpus_samples(corpus_records, 20):
            sink.write(sample)
    assert cli_main(["ls", url, "--ordinal", "15", "--limit", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("15\t") and "00000015" in lines[1] and len(lines) == 3


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar not installed")
def test_index_covers_bytes_after_the_end_blocks(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    shard = tmp_path / "big-blocking.tar"
    subprocess.run(["tar", "-b", "4096", "-cf", str(shard), "-C", str(tmp_path), "a.txt"], check=True)
    index = wdsraft.build_index(str(shard))
    assert index.size == shard.stat().st_size == 2 << 20
    assert index.sha256 == hashlib.sha256(shard.read_bytes()).hexdigest()


def test_writer_index_follows_what_readers_see(tmp_path: Path) -> None:
    url = str(tmp_path / "odd.tar")
    with wdsraft.TarWriter(url) as sink:
        for sample in (
            {"__key__": "a", "txt": "1"},
            {"__key__": "empty"},  # writes nothing
            {"__key__": "a", "jpg": b"2"},  # same key again: readers merge it into "a"
            {"__key__": "x.1", "txt": "3"},  # keys with dots: readers see key "x"
            {"__key__": "x.2", "txt": "4"},
            {"__key__": "m", "_meta": "skipped"},
        ):
            sink.write(sample)
    assert wdsraft.ShardIndex.load(url) == wdsraft.build_index(url)
    assert wdsraft.ShardIndex.load(url).num_samples == len(list(wdsraft.ShardSampleReader(url))) == 2


def test_writer_edge_inputs(tmp_path: Path) -> None:
    import numpy as np

    url = str(tmp_path / "mv.tar")
    with wdsraft.TarWriter(url, format=tarfile.USTAR_FORMAT, encoder=False) as sink:
        sink.write({"__key__": "a", "bin": memoryview(np.arange(4.0))})
    (sample,) = wdsraft.ShardSampleReader(url)
    assert sample["bin"] == np.arange(4.0).tobytes()
    assert Path(url).read_bytes()[257:263] == b"ustar\x00"  # format=0 (USTAR) honoured, not taken as "unset"
    target = tmp_path / "piped.tar"
    with wdsraft.TarWriter(f"pipe:cat > {target}") as sink:
        sink.write({"__key__": "a", "txt": "x"})
    assert [s["__key__"] for s in wdsraft.ShardSampleReader(str(target))] == ["a"]
    assert not (tmp_path / "piped.tar.idx").exists() and not list(Path.cwd().glob("pipe:*"))


def test_aborted_s3_write_leaves_no_object(s3_bucket) -> None:
    with pytest.raises(RuntimeError), wdsraft.TarWriter(f"s3://{s3_bucket}/a.tar") as sink:
        sink.write({"__key__": "a", "txt": "x"})
        raise RuntimeError("crash")
    listing = boto3.client("s3").list_objects_v2(Bucket=s3_bucket)
    assert listing.get("KeyCount", 0) == 0


def test_failed_atomic_s3_write_leaves_no_open_upload(s3_bucket) -> None:
    url = f"s3://{s3_bucket}/ledger.bin"
    # The write fails after smart_open has started a multipart upload. Left to the garbage collector,
    # the writer's close() would complete it as an empty object under the final name.
    with pytest.raises(TypeError):
        wdsraft.io.storage.write_bytes_atomic(url, "not bytes")  # type: ignore[arg-type]
    client = boto3.client("s3")
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert client.list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0
    wdsraft.io.storage.write_bytes_atomic(url, b"whole")
    assert client.get_object(Bucket=s3_bucket, Key="ledger.bin")["Body"].read() == b"whole"


def test_index_of_a_foreign_shard_skips_metadata_members_as_readers_do(tmp_path: Path) -> None:
    url = tmp_path / "meta.tar"
    with tarfile.open(url, "w", format=tarfile.GNU_FORMAT) as tar:
        for name in ("__meta__/info.txt", "a.txt", "b.txt"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    samples = list(wdsraft.ShardSampleReader(str(url)))
    index = wdsraft.build_index(str(url))
    assert index.num_samples == len(samples) == 2
    assert [index.offset_of(n) for n in range(2)] == [s["__offset__"] for s in samples]
    assert wdsraft.build_index(str(url), checksum=False).sha256 is None


def test_shard_names_with_url_characters_restore(tmp_path: Path) -> None:
    """A local shard named like a URL fragment (``run#2.tar``) is re-read by its path on restore."""
    url = str(tmp_path / "run#2.tar")
    with wdsraft.ShardWriter(url.replace("#2", "#%d"), maxcount=100, start_shard=2, verbose=0) as sink:
        for n in range(6):
            sink.write({"__key__": f"{n:03d}", "txt": str(n)})
    assert Path(url).exists()

    def make():
        return wdsraft.WebDataset([url], shardshuffle=False).shuffle(10, seed=1).to_tuple("__key__")

    pipeline = make()
    iterator = iter(pipeline)
    head = [next(iterator) for _ in range(2)]
    state = pipeline.state_dict()
    rest = list(iterator)
    fresh = make()
    fresh.load_state_dict(state)
    assert list(fresh) == rest and len(head + rest) == 6


def test_gopen_rewrite_is_applied_once(tmp_path: Path, monkeypatch) -> None:
    real = tmp_path / "v2"
    real.mkdir()
    with wdsraft.ShardWriter(str(real / "s-%02d.tar"), maxcount=10, verbose=0) as sink:
        for n in range(3):
            sink.write({"__key__": f"{n}", "txt": str(n)})
    monkeypatch.setenv("GOPEN_REWRITE", f"{tmp_path}/={tmp_path}/v2/")  # (a target under the prefix)
    url = f"{tmp_path}/s-00.tar"
    assert wdsraft.ShardIndex.load(url).num_samples == 3
    assert [s["__key__"] for s in wdsraft.ShardSampleReader(url)] == ["0", "1", "2"]


def test_an_index_that_cannot_be_read_is_no_missing_index_whatever_the_shard_is_called(monkeypatch) -> None:
    """Only a missing index reads as "no index": an index refused (403) for a shard whose name holds "404"
    raises, rather than the shard being read unchecked (messages used to be matched, URL included)."""
    from wdsraft.core.errors import RemoteAccessDeniedError
    from wdsraft.index import shard_index

    url = "s3://bucket/train/shard-000404.tar"

    def refused(index_url, mode="rb"):
        raise RemoteAccessDeniedError(index_url, 0, "access denied (403 AccessDenied)", 403)

    monkeypatch.setattr(shard_index, "gopen", refused)
    with pytest.raises(RemoteAccessDeniedError):
        shard_index.ShardIndex.beside(url)
