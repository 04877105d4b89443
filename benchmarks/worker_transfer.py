"""CPU cost of handing LLM batches from DataLoader workers to the training process.

    python benchmarks/worker_transfer.py [--batches 3000] [--batch 8] [--length 2048] [--repeats 7]

Two workers run ready-made sequences through ``batched`` (``collate_sequences``), so only
batching and the crossing are measured, the three paths side by side in one process:

- **torch**: DataLoader's own path (``collate_fn=default_convert``): each tensor storage goes
  into a new shared-memory segment whose file descriptor is handed over a socket;
- **wdsraft, changed after batched**: ``WebLoader``'s default for a batch that a stage after
  ``batched`` may have changed (here a ``map`` that changes nothing): it crosses as int32
  token ids and row lengths, after a full check that labels, mask and position ids rebuild
  from them; they are rebuilt on arrival;
- **wdsraft**: the same for a batch straight from ``batched`` as the dataset's last stage,
  which needs no check.

Each path runs ``--repeats`` times, the paths alternating and their order rotating from round to
round. Reported per batch: wall time, and CPU time of the training process, of the workers and
of both, each as the median of the rounds with the range (fastest-slowest round); figures are
rounded to the first digit the spread leaves uncertain. The ratio of torch's CPU to wdsraft's is
the median over rounds of the two runs in the same round. Corpus: none (synthetic token ids).
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import time
import warnings

import numpy as np
from torch.utils.data import IterableDataset, default_convert, get_worker_info

import wdsraft as wds
from wdsraft.llm.sequences import build_sequence


class ReadySequences(IterableDataset):
    """``count`` sequences per loader (split between its workers), ready for ``batched``."""

    def __init__(self, count: int, batch: int, length: int):
        self.count, self.batch, self.length = count, batch, length

    def __iter__(self):
        rng = np.random.default_rng(0)
        sequences = []
        for row in range(self.batch):  # documents of a few hundred tokens, the last row padded
            sizes = [300, 700, 500, 548] if row else [300, 700]
            pieces = [
                (
                    rng.integers(0, 100_000, size).astype(np.uint32),
                    ("s.tar", row, 0, 0),
                    0,
                    size,
                    size,
                    ["s.tar", row, 0],
                )
                for size in sizes
            ]
            sequences.append(build_sequence(pieces, self.length, 0))
        info = get_worker_info()
        for number in range(self.count // info.num_workers):
            yield sequences[number % self.batch]


def unchanged(batch):
    return batch


def cpu_seconds() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def measure(path: str, args: argparse.Namespace) -> dict[str, float]:
    stages = [ReadySequences(args.batches * args.batch, args.batch, args.length), wds.batched(args.batch)]
    if path == "wdsraft, changed after batched":
        stages.append(wds.map(unchanged))
    extra = {"collate_fn": default_convert} if path == "torch" else {}
    loader = wds.WebLoader(wds.DataPipeline(*stages), batch_size=None, num_workers=2, prefetch_factor=16, **extra)
    start, (main0, workers0) = time.perf_counter(), cpu_seconds()
    count = sum(1 for _ in loader)
    wall = time.perf_counter() - start
    main1, workers1 = cpu_seconds()  # (workers are joined at the end of the epoch: their CPU is counted)
    return {"wall": wall / count, "main": (main1 - main0) / count, "workers": (workers1 - workers0) / count}


PATHS = ("torch", "wdsraft, changed after batched", "wdsraft")


def rounded(values: list[float]) -> str:
    """Median (fastest-slowest) in ms, to the decimal place of the spread's first digit."""
    low, mid, high = (1e3 * v for v in (min(values), statistics.median(values), max(values)))
    digits = max(0, min(3, -math.floor(math.log10(high - low)))) if high > low else 3
    return f"{mid:.{digits}f} ms ({low:.{digits}f}-{high:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=3000, help="batches per run (default 3000)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch (default 8)")
    parser.add_argument("--length", type=int, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument("--repeats", type=int, default=7, help="runs of each path; medians (default 7)")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    print(
        f"corpus: none (synthetic token ids); {args.batches} batches of [{args.batch}, {args.length}] from 2 "
        f"workers per run; medians of {args.repeats} rounds (fastest-slowest), paths alternating\n",
        flush=True,
    )
    runs: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
    for round_number in range(args.repeats):
        shift = round_number % len(PATHS)
        for path in PATHS[shift:] + PATHS[:shift]:
            runs[path].append(measure(path, args))
    print("| path | wall per batch | training-process CPU per batch | worker CPU per batch | CPU per batch in all |")
    print("|---|---:|---:|---:|---:|")
    for path, results in runs.items():
        cells = [rounded([r[key] for r in results]) for key in ("wall", "main", "workers")]
        cells.append(rounded([r["main"] + r["workers"] for r in results]))
        print(f"| {path} | " + " | ".join(cells) + " |")
    ratios = [
        (t["main"] + t["workers"]) / (w["main"] + w["workers"])
        for t, w in zip(runs["torch"], runs["wdsraft"], strict=True)
    ]
    print(
        f"\nCPU per batch: torch's path costs {statistics.median(ratios):.1f}x wdsraft's "
        f"(median of rounds; {min(ratios):.1f}-{max(ratios):.1f})"
    )


if __name__ == "__main__":
    main()
