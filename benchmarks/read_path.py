"""CPU per sample of the read path, stage by stage, for one or more wdsraft source trees (before/after a change).

    python benchmarks/read_path.py --shards 'DIR/*.tar' [--tree before=/path/to/old/checkout] [--rounds 5]

Three levels, each over every shard given (warm page cache, one process):

- ``tarfile_samples``: the tar walk, grouping and the index checks;
- ``WebDataset``: plus the pipeline (source stage, positions, ``__local_path__``, its passes);
- ``WebDataset.decode()``: plus webdataset's default decoding.

Each measurement runs in a fresh Python process with ``PYTHONPATH`` set to its tree (the current
checkout is ``--tree after=.`` by default): one warm-up epoch, then the median CPU time
(``time.process_time``) of five epochs, divided by the samples, and the process's minor page
faults per epoch (fresh pages the C allocator maps in: they cost CPU, and a process may take
none or thousands for the same work, depending on the allocator's history). The trees alternate within each
round, their order reversed every other round; reported are the medians over ``--rounds`` rounds.
CPU time rather than wall time, because the machines these figures come from are shared: CPU time
moves much less with the other work on the cores (it still grows somewhat with it).
"""

from __future__ import annotations

import glob
import resource
import statistics
import sys
import time
import warnings

from trees import in_turn, load, parse, run_child

LEVELS = ("tarfile_samples", "WebDataset", "WebDataset.decode()")


def measure(level: str, pattern: str) -> tuple[float, float]:
    """CPU microseconds per sample of ``level`` over the shards, and page faults per epoch (run inside the
    child process)."""
    warnings.filterwarnings("ignore")
    import wdsraft

    urls = sorted(glob.glob(pattern))

    def epoch() -> int:
        if level == "tarfile_samples":
            samples = wdsraft.tarfile_samples({"url": url} for url in urls)
        elif level == "WebDataset":
            samples = wdsraft.WebDataset(urls, shardshuffle=False)
        else:
            samples = wdsraft.WebDataset(urls, shardshuffle=False).decode()
        return sum(1 for _ in samples)

    epoch()
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        start = time.process_time()
        count = epoch()
        times.append(time.process_time() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return statistics.median(times) / count * 1e6, faults / 5


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(*measure(sys.argv[2], sys.argv[3]))
        return
    args, trees = parse(__doc__)
    results: dict[tuple[str, str], list[float]] = {(level, name): [] for level in LEVELS for name in trees}
    faults: dict[tuple[str, str], list[float]] = {(level, name): [] for level in LEVELS for name in trees}
    for number in range(args.rounds):
        for level in LEVELS:
            for name in in_turn(trees, number):
                cpu, page_faults = run_child(__file__, trees[name], level, args.shards).split()
                results[(level, name)].append(float(cpu))
                faults[(level, name)].append(float(page_faults))
    print(f"\n| level | {' | '.join(trees)} |")
    print(f"|---|{'---:|' * len(trees)}")
    for level in LEVELS:
        cells = [
            f"{statistics.median(results[(level, name)]):.2f} us ({statistics.median(faults[(level, name)]):,.0f})"
            for name in trees
        ]
        print(f"| {level} | {' | '.join(cells)} |")
    print(f"\nCPU per sample (page faults per epoch), medians of {args.rounds} rounds; load average after: {load()}")


if __name__ == "__main__":
    main()
