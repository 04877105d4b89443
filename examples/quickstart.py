"""The main job on the bundled defaults: corpus -> shards -> train loop -> checkpoint -> resume.

    python examples/quickstart.py [--corpus FILE.jsonl.zst] [--output DIR]

1. converts the bundled JSONL corpus (a slice of the Linux kernel documentation) into
   globally shuffled WebDataset shards with ``wdsraft convert`` (index and manifest included);
2. reads every sample back with wdsraft and with webdataset and checks both give the
   same samples, and that every record arrived intact;
3. jumps to a sample in the middle of a shard through the index (a byte seek, no
   re-reading) and checks the stream from there equals the tail of the full read;
4. runs a training loop over a shuffled ``WebLoader`` with two worker processes,
   checkpoints the data state with ``torch.save`` mid-epoch, "crashes", restores into a
   freshly built loader and checks the resumed batches are exactly those the
   uninterrupted run delivered.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import time

import torch
import webdataset
import zstandard

import wdsraft
import wdsraft as wds
from wdsraft.convert import ConvertOptions, convert, parse_size

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CORPUS = os.path.join(HERE, "data", "kernel-docs-sample.jsonl.zst")


def read_jsonl_zst(path: str) -> list[dict]:
    with open(path, "rb") as raw:
        text = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
        return [json.loads(line) for line in text if line.strip()]


def content_digest(texts: list[bytes]) -> str:
    digest = hashlib.sha256()
    for text in sorted(texts):
        digest.update(hashlib.sha256(text).digest())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=DEFAULT_CORPUS, help="JSONL(.zst) corpus with 'id' and 'text' fields")
    parser.add_argument("--output", default="quickstart-output", help="directory for the shards (recreated)")
    parser.add_argument("--samples-per-shard", type=int, default=100)
    args = parser.parse_args()

    records = read_jsonl_zst(args.corpus)
    print(f"corpus: {len(records)} documents from {args.corpus}")

    shutil.rmtree(args.output, ignore_errors=True)
    options = ConvertOptions(
        inputs=[args.corpus],
        output=args.output,
        name="kernel-docs",
        samples_per_shard=args.samples_per_shard,
        memory=parse_size("64M"),
        workers=2,
    )
    report = convert(options)
    manifest = wdsraft.Manifest.load(os.path.join(args.output, "manifest.json"))
    urls = manifest.urls(os.path.join(args.output, "manifest.json"))
    print(
        f"converted {manifest.num_samples} records into {len(urls)} globally shuffled shards "
        f"({manifest.size / 1e6:.1f} MB) with index and manifest (finalized: {report.finalized})"
    )

    start = time.perf_counter()
    ours = list(wdsraft.tarfile_samples({"url": url} for url in urls))
    elapsed = time.perf_counter() - start
    theirs = list(webdataset.tarfile_samples({"url": url} for url in urls))
    same = [(s["__key__"], s["txt"]) for s in ours] == [(s["__key__"], s["txt"]) for s in theirs]
    intact = content_digest([s["txt"] for s in ours]) == content_digest([r["text"].encode() for r in records])
    print(
        f"read back {len(ours)} samples in {elapsed * 1000:.0f} ms; "
        f"same as webdataset: {same}; content intact: {intact}"
    )

    shard = urls[len(urls) // 2]
    index = wdsraft.ShardIndex.load(shard)
    ordinal = index.num_samples // 2
    offset = index.offset_of(ordinal)
    tail = list(wdsraft.ShardSampleReader(shard, offset=offset, ordinal=ordinal))
    expected = [s for s in ours if s["__url__"] == shard][ordinal:]
    resumed = [s["__key__"] for s in tail] == [s["__key__"] for s in expected]
    first = tail[0]
    print(
        f"seek: {os.path.basename(shard)} sample #{ordinal} at byte {offset} -> key {first['__key__']} "
        f"({json.loads(first['json'])['id']}); rest of shard identical: {resumed}"
    )
    exact = train_checkpoint_resume(urls, os.path.join(args.output, "checkpoint.pt"))
    if not (same and intact and resumed and exact):
        raise SystemExit("quickstart FAILED")
    print("quickstart OK")


def make_loader(urls: list[str]) -> wds.WebLoader:
    """The training input: shuffled shards and samples in two workers, re-shuffled across workers."""
    dataset = (
        wds.WebDataset(urls, shardshuffle=100, seed=17)
        .shuffle(200, seed=1)
        .decode()
        .to_tuple("__key__", "txt")
        .batched(8)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=2)
    return loader.unbatched().shuffle(64, seed=2).batched(16)


def train_checkpoint_resume(urls: list[str], checkpoint: str, crash_at: int = 11) -> bool:
    reference = [list(keys) for keys, _texts in make_loader(urls)]

    loader = make_loader(urls)
    seen = []
    for step, (keys, _texts) in enumerate(loader):
        seen.append(list(keys))  # ... a training step would run here ...
        if step == crash_at:
            torch.save({"step": step, "data": loader.state_dict()}, checkpoint)
            break  # the job is preempted

    saved = torch.load(checkpoint, weights_only=True)  # a new job: plain data, no code runs
    resumed_loader = make_loader(urls)
    resumed_loader.load_state_dict(saved["data"])
    resumed = [list(keys) for keys, _texts in resumed_loader]
    exact = seen + resumed == reference
    print(
        f"train loop: {len(reference)} batches per epoch; checkpoint after step {saved['step']} "
        f"({os.path.getsize(checkpoint) / 1e3:.1f} KB), resumed {len(resumed)} batches in a fresh loader; "
        f"identical to the uninterrupted run: {exact}"
    )
    return exact


if __name__ == "__main__":
    main()
