"""A world-size change mid-epoch, wdsraft's ledger against LitData's elastic resume, for ``vs_litdata.py``.

Each rank is a real process (no torch.distributed: each library reads its rank from the
environment, ``RANK``/``WORLD_SIZE`` for wdsraft, ``GLOBAL_RANK``/``WORLD_SIZE`` for LitData),
each with a 2-worker loader in batches of ``--elastic-batch`` over the datasets ``vs_litdata.py``
converted, shuffled (wdsraft: ``shardshuffle=100`` and ``shuffle(1000)``; LitData:
``shuffle=True``). Two ranks take ``step`` batches each, save, and stop; then 1 or 3 ranks
resume from what was saved and run to the end of the epoch:

- **wdsraft**: ``WebDataset(..., nodesplitter=split_by_node)`` in a ``WebLoader``, through a
  ``wds.Ledger``: ``ledger.track(loader)``, ``ledger.checkpoint(loader, step)`` on every rank;
  each new rank loads its own checkpoint, or rank 0's if it had none (``examples/train_ledger.py``)
  and calls ``ledger.resume``, which restarts the epoch skipping every consumed position.
- **LitData**: ``StreamingDataset(dir, shuffle=True, drop_last=False)`` in a
  ``StreamingDataLoader``; rank 0 saves ``loader.state_dict()`` (as a Lightning checkpoint holds
  rank 0's) and every new rank calls ``load_state_dict`` with it: LitData drops the global prefix
  ``sample_in_epoch`` (rounded down to a multiple of new world size x batch size, so up to that
  many minus one samples come again) and restripes the rest. ``drop_last=False`` so that the
  epoch's end drops nothing on either side: what is counted is what the change does.

Counted over the epoch, against every sample of the dataset: samples delivered twice and samples
never delivered; and the time from the resume call (``ledger.resume`` / ``load_state_dict``) to
the first batch, workers' start included, of the slowest new rank, and the resume call's own
share of it. Each change runs ``min(--repeats, 3)`` rounds, the libraries alternating; times are
medians, and the counts are printed once (any round counting otherwise is printed too).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

WORKERS = 2


# -- one rank (a child process) --------------------------------------------------------------------------


def wdsraft_rank(data: dict[str, Any], rank: int, phase: str, workdir: Path) -> dict[str, Any]:
    import torch

    import wdsraft as wds

    dataset = (
        wds.WebDataset(data["urls"], shardshuffle=100, seed=1, nodesplitter=wds.split_by_node)
        .shuffle(1000, seed=2)
        .batched(data["batch"])
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=WORKERS)
    ledger = wds.Ledger(str(workdir / "ledger"), run=phase)
    saved = None
    if phase == "after":
        mine = workdir / f"state-{rank:05d}.pt"
        saved = torch.load(mine if mine.exists() else workdir / "state-00000.pt", weights_only=True)
    start = time.perf_counter()
    mode = ledger.resume(loader, saved)
    call = time.perf_counter() - start
    keys: list[str] = []
    first = None
    for step, batch in enumerate(ledger.track(loader), 1):
        if first is None:
            first = time.perf_counter() - start
        keys += batch["__key__"]
        if phase == "before" and step == data["step"]:
            torch.save(ledger.checkpoint(loader, step), workdir / f"state-{rank:05d}.pt")
            break
    return {"keys": keys, "first": first, "call": call, "mode": mode}


def litdata_rank(data: dict[str, Any], rank: int, phase: str, workdir: Path) -> dict[str, Any]:
    import litdata
    import torch

    dataset = litdata.StreamingDataset(data["directory"], shuffle=True, seed=1, drop_last=False)
    loader = litdata.StreamingDataLoader(dataset, batch_size=data["batch"], num_workers=WORKERS)
    saved = torch.load(workdir / "state-00000.pt", weights_only=False) if phase == "after" else None
    start = time.perf_counter()
    if saved is not None:
        loader.load_state_dict(saved)
    call = time.perf_counter() - start
    keys: list[str] = []
    first = None
    for step, batch in enumerate(loader, 1):
        if first is None:
            first = time.perf_counter() - start
        keys += batch["id"]
        if phase == "before" and step == data["step"]:
            if rank == 0:
                torch.save(loader.state_dict(), workdir / "state-00000.pt")
            break
    return {"keys": keys, "first": first, "call": call, "mode": "load_state_dict" if saved else "fresh"}


def child(argv: list[str]) -> None:
    """``--elastic-rank LIBRARY PHASE WORKDIR``: one rank, its rank and world size from the environment."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("litdata").setLevel(logging.ERROR)  # (drop_last=False with several ranks: on purpose)
    library, phase, workdir = argv[0], argv[1], Path(argv[2])
    data = json.loads((workdir.parent / "data.json").read_text())
    rank = int(os.environ["RANK"])
    run = wdsraft_rank if library == "wdsraft" else litdata_rank
    result = run(data, rank, phase, workdir)
    (workdir / f"{phase}-{rank}.json").write_text(json.dumps(result))


# -- the driver ------------------------------------------------------------------------------------------


def ranks(script: str, library: str, phase: str, workdir: Path, world: int) -> list[dict[str, Any]]:
    """``world`` rank processes at once; their results."""
    processes = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), GLOBAL_RANK=str(rank), WORLD_SIZE=str(world), WDSRAFT_RUN=phase)
        env.pop("LOCAL_RANK", None)
        command = [sys.executable, script, "--elastic-rank", library, phase, str(workdir)]
        processes.append(subprocess.Popen(command, env=env))
    for process in processes:
        if process.wait() != 0:
            raise SystemExit(f"{library} {phase} rank failed ({process.args})")
    return [json.loads((workdir / f"{phase}-{rank}.json").read_text()) for rank in range(world)]


def scenario(script: str, library: str, root: Path, world: int, step: int, number: int) -> dict[str, Any]:
    workdir = root / f"{library}-2to{world}-at{step}-round{number}"
    workdir.mkdir(parents=True)
    before = ranks(script, library, "before", workdir, 2)
    after = ranks(script, library, "after", workdir, world)
    slowest = max((r for r in after if r["first"] is not None), key=lambda r: r["first"])
    return {
        "before": sum(len(r["keys"]) for r in before),
        "after": sum(len(r["keys"]) for r in after),
        "delivered": Counter(key for result in before + after for key in result["keys"]),
        "first": slowest["first"],
        "call": slowest["call"],
        "fresh": max(r["first"] for r in before),
        "modes": sorted({r["mode"] for r in after}),
    }


def counted(result: dict[str, Any], every: set[str]) -> tuple[int, int]:
    """(samples delivered twice, samples never delivered) over the epoch."""
    delivered = result["delivered"]
    foreign = len(delivered.keys() - every)
    if foreign:
        raise SystemExit(f"{foreign} delivered keys are not in the dataset")
    return sum(count - 1 for count in delivered.values() if count > 1), len(every - delivered.keys())


def elastic_section(
    script: str,
    urls: list[str],
    directory: str,
    every: dict[str, set[str]],
    root: Path,
    batch: int,
    steps: list[int],
    rounds: int,
) -> None:
    root.mkdir(parents=True, exist_ok=True)
    libraries = ["wdsraft", "litdata"]
    rows = []
    for world in (1, 3):
        for step in steps:
            (root / "data.json").write_text(
                json.dumps({"urls": urls, "directory": directory, "batch": batch, "step": step})
            )
            results: dict[str, list[dict[str, Any]]] = {name: [] for name in libraries}
            for number in range(rounds):
                for library in libraries if number % 2 == 0 else libraries[::-1]:
                    result = scenario(script, library, root, world, step, number)
                    result["counts"] = counted(result, every[library])
                    results[library].append(result)
                    print(
                        f"  2 -> {world} at {step} round {number}: {library}: {result['modes']} "
                        f"twice, never {result['counts']}, first {result['first']:.2f} s",
                        flush=True,
                    )
            rows += [(world, step, library, results[library]) for library in libraries]
    print(
        f"\n### World size 2 -> 1 and 2 -> 3 mid-epoch: 2 ranks take N batches of {batch} each, then the new "
        f"ranks resume and end the epoch ({WORKERS} workers per rank; times: median and range of {rounds} rounds)\n"
    )
    print(
        "| change | N | library | delivered before + after | delivered twice | never delivered "
        "| resume call to the first batch, slowest new rank | of which the resume call "
        "| fresh start to the first batch, slowest first rank |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for world, step, library, runs in rows:
        name = "wdsraft ledger" if library == "wdsraft" else "LitData elastic"
        counts = {(r["before"], r["after"], r["counts"]) for r in runs}
        if len(counts) > 1:
            print(f"(the rounds counted differently: {sorted(counts)})")
        (before, after, (twice, never)) = runs[0]["before"], runs[0]["after"], runs[0]["counts"]
        firsts, calls, fresh = ([r[key] for r in runs] for key in ("first", "call", "fresh"))
        print(
            f"| 2 -> {world} | {step} | {name} | {before:,} + {after:,} | {twice:,} | {never:,} "
            f"| {statistics.median(firsts):.2f} s ({min(firsts):.2f}-{max(firsts):.2f}) "
            f"| {statistics.median(calls):.3f} s | {statistics.median(fresh):.2f} s |"
        )
    sys.stdout.flush()
