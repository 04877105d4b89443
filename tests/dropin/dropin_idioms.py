"""Pipelines written the way large public training repositories write them (their idioms, not their
code), parametrised by the library (``wdsraft`` or ``webdataset``) so that both run the same text."""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import torch
from webdataset.tariterators import base_plus_ext, valid_sample


def group_by_keys_nothrow(data, keys=base_plus_ext, lcase=True, suffixes=None, handler=None):
    """A grouper that starts a new sample where a suffix repeats instead of raising (CLIP-style), and
    keeps only ``__key__`` and ``__url__`` of the members' fields."""
    current = None
    for filesample in data:
        if filesample == {}:  # (the end of a shard)
            if valid_sample(current):
                yield current
            current = None
            continue
        fname, value = filesample["fname"], filesample["data"]
        prefix, suffix = keys(fname)
        if prefix is None:
            continue
        if lcase:
            suffix = suffix.lower()
        if current is None or prefix != current["__key__"] or suffix in current:
            if valid_sample(current):
                yield current
            current = {"__key__": prefix, "__url__": filesample["__url__"]}
        if suffixes is None or suffix in suffixes:
            current[suffix] = value
    if valid_sample(current):
        yield current


def make_reader(lib):
    def tarfile_samples_nothrow(src, handler=lib.warn_and_continue):
        streams = lib.tariterators.url_opener(src, handler=handler)
        files = lib.tariterators.tar_file_expander(streams, handler=handler)
        return group_by_keys_nothrow(files, handler=handler)

    return lib.pipelinefilter(tarfile_samples_nothrow)


def has_text(sample: dict) -> bool:
    return "txt" in sample


def clip_style(lib, urls, resampled: bool, seed: int = 7, batch_size: int = 3, epoch_batches: int = 0):
    """get_wds_dataset's shape: shard list (resampled or detshuffled and split), a client-built reader,
    a sample shuffle with its own live RNG, select, decode, rename, map_dict, to_tuple, batched."""
    if resampled:
        pipeline: list[Any] = [lib.ResampledShards(urls, deterministic=True, seed=seed)]
    else:
        pipeline = [lib.SimpleShardList(urls), lib.detshuffle(bufsize=5, initial=2, seed=seed)]
        pipeline += [lib.split_by_node, lib.split_by_worker]
    pipeline += [
        make_reader(lib)(),
        lib.shuffle(bufsize=9, initial=3, rng=random.Random(seed)),
        lib.select(has_text),
        lib.decode(),
        lib.rename(text="txt", meta="json"),
        lib.map_dict(text=len),
        lib.to_tuple("__key__", "text", "meta"),
        lib.batched(batch_size, partial=not resampled),
    ]
    dataset = lib.DataPipeline(*pipeline)
    if epoch_batches:
        dataset = dataset.with_epoch(epoch_batches)
    return dataset


def lm_manifest(lib, manifest_path: str, seed: int = 3):
    """An LM loader fed by a manifest (one shard per line), shards shuffled and split by node."""
    with open(manifest_path) as manifest:
        urls = [line.strip() for line in manifest if line.strip()]
    return (
        lib.WebDataset(urls, shardshuffle=len(urls), nodesplitter=lib.split_by_node, seed=seed)
        .shuffle(7, seed=seed, **({"reshuffle_each_epoch": False} if lib.__name__ == "wdsraft" else {}))
        .decode()
        .map(lambda sample: {"ids": [ord(c) % 97 for c in sample.get("txt", "")[:8]], "key": sample["__key__"]})
        .to_tuple("key", "ids")
        .batched(4, collation_fn=None)
    )


def timm_style(lib, urls, seed: int = 5, epoch: int = -1):
    """timm's reader shape: detshuffle with an epoch, its own node/worker splitting function,
    tarfile_to_samples with a handler, shuffle with a live RNG seeded by the worker seed."""

    def split_by_node_and_worker(src):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            yield from list(src)[info.id :: info.num_workers]
        else:
            yield from src

    return lib.DataPipeline(
        lib.SimpleShardList(urls),
        lib.detshuffle(6, seed=seed, epoch=epoch),
        split_by_node_and_worker,
        lib.tarfile_to_samples(handler=lib.warn_and_continue),
        lib.shuffle(8, rng=random.Random(seed + 1)),
        lib.decode(),
        lib.to_tuple("__key__", "json"),
    )


def audio_style(lib, urls, seed: int = 11):
    """Pre-encoded features (``.npy``) with labels, padded into batches by a collate function."""

    def pad_collate(items):
        keys, feats, labels = zip(*items, strict=True)
        width = max(len(f) for f in feats)
        out = torch.zeros(len(feats), width)
        for row, feat in enumerate(feats):
            out[row, : len(feat)] = torch.from_numpy(feat)
        return list(keys), out, torch.tensor(labels)

    return (
        lib.WebDataset(urls, shardshuffle=False, seed=seed)
        .shuffle(6, seed=seed, **({"reshuffle_each_epoch": False} if lib.__name__ == "wdsraft" else {}))
        .decode()
        .to_tuple("__key__", "npy", "cls")
        .batched(3, collation_fn=pad_collate)
    )


def audio_sample(number: int) -> dict:
    feature = np.arange(number % 5 + 1, dtype=np.float32) + number
    buffer = io.BytesIO()
    np.save(buffer, feature)
    return {"npy": buffer.getvalue(), "cls": number % 4}
