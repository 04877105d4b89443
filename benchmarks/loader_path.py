"""CPU of raw reading through a 2-worker ``WebLoader``, part by part, for one or more wdsraft source trees
(before/after a change).

    python benchmarks/loader_path.py --shards 'DIR/*.tar' [--tree before=/path/to/old/checkout] [--rounds 5]

What a worker does with each batch, measured in one process over every shard given (warm page cache):

- ``batched``: ``WebDataset(urls, shardshuffle=False).decode().batched(64)``, the dataset a worker runs;
- ``+ convert + pickle``: plus what the loader does to hand each batch over (``convert_batch``, then
  pickling it as the worker's queue does);

then the whole thing, ``WebLoader(... .batched(64), batch_size=None, num_workers=2)``, one epoch with the
workers' start: CPU of the training process and of the workers (user + system), and wall time.

Each measurement runs in a fresh Python process with ``PYTHONPATH`` set to its tree (the current
checkout is ``--tree after=.`` by default): one warm-up epoch, then the median of five epochs. The trees
alternate within each round, their order reversed every other round; reported are the medians over
``--rounds`` rounds. CPU time is the figure to read on a shared machine; wall time moves with the load.
"""

from __future__ import annotations

import glob
import json
import pickle
import resource
import statistics
import sys
import time
import warnings

from trees import in_turn, load, parse, run_child

FIGURES = ("batched", "+ convert + pickle", "loader: training process", "loader: workers", "loader: wall")


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def measure(pattern: str) -> dict[str, float]:
    """Milliseconds per epoch of each figure (run inside the child process)."""
    warnings.filterwarnings("ignore")
    import wdsraft
    from wdsraft.pipeline.loader import convert_batch

    urls = sorted(glob.glob(pattern))

    def dataset():
        return wdsraft.WebDataset(urls, shardshuffle=False).decode().batched(64)

    def batched() -> None:
        for _ in dataset():
            pass

    def handed_over() -> None:
        for batch in dataset():
            pickle.dumps(convert_batch(batch), protocol=pickle.DEFAULT_PROTOCOL)

    def loader() -> tuple[float, float, float]:
        before, start = _cpu(), time.perf_counter()
        for _ in wdsraft.WebLoader(dataset(), batch_size=None, num_workers=2):
            pass
        wall, after = time.perf_counter() - start, _cpu()
        return after[0] - before[0], after[1] - before[1], wall

    results: dict[str, list[float]] = {figure: [] for figure in FIGURES}
    for epoch in (batched, handed_over):
        epoch()
        for _ in range(5):
            start = time.process_time()
            epoch()
            results["batched" if epoch is batched else "+ convert + pickle"].append(time.process_time() - start)
    loader()
    for _ in range(5):
        main, workers, wall = loader()
        results["loader: training process"].append(main)
        results["loader: workers"].append(workers)
        results["loader: wall"].append(wall)
    return {figure: statistics.median(values) * 1e3 for figure, values in results.items()}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(measure(sys.argv[2])))
        return
    args, trees = parse(__doc__)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for number in range(args.rounds):
        for name in in_turn(trees, number):
            results[name].append(json.loads(run_child(__file__, trees[name], args.shards)))
    print(f"load average after: {load()}\n")
    print("| ms per epoch (median of rounds) | " + " | ".join(trees) + " |")
    print("|---|" + "---:|" * len(trees))
    for figure in FIGURES:
        cells = [f"{statistics.median(r[figure] for r in results[name]):.1f}" for name in trees]
        print(f"| {figure} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
