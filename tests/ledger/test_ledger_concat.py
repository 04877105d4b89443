"""``concat_datasets`` under the ledger: an elastic resume (the DataLoader's worker count changed) hands
the consumed set on to every concatenated dataset, so nothing is served twice and nothing is lost,
whether the checkpoint fell in the first dataset or in a later one."""

from __future__ import annotations

from collections import Counter

import pytest

import wdsraft as wds

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SIZES = {"a": 30, "b": 20}  # samples per source, 5 per shard


@pytest.fixture(scope="module")
def sources(write_shards) -> dict[str, list[str]]:
    return {
        name: write_shards(f"lc{name}", [{"txt": f"{name}{n}"} for n in range(count)], 5)
        for name, count in SIZES.items()
    }


def _loader(sources, workers: int):
    datasets = [wds.WebDataset(sources[n], shardshuffle=10, seed=1).shuffle(4, seed=1) for n in "ab"]
    pipeline = wds.DataPipeline(wds.concat_datasets(datasets), wds.batched(3))
    return wds.WebLoader(pipeline, batch_size=None, num_workers=workers)


def _run(ledger, loader, saved, stop_after: int | None, step0: int) -> tuple[str, list[str], dict]:
    mode = ledger.resume(loader, saved)
    delivered: list[str] = []
    step = step0
    for step, batch in enumerate(ledger.track(loader), step0 + 1):
        delivered += [text.decode() for text in batch["txt"]]
        if stop_after is not None and step == step0 + stop_after:
            break
    return mode, delivered, ledger.checkpoint(loader, step)


@pytest.mark.parametrize(("workers", "stop_after"), [(0, 4), (2, 4), (0, 13)])
def test_an_elastic_resume_of_a_concatenation_serves_every_sample_once(tmp_path, sources, workers, stop_after) -> None:
    path = str(tmp_path / "ledger")
    _, first, saved = _run(wds.Ledger(path, run="r1"), _loader(sources, workers), None, stop_after, 0)
    assert len(first) == 3 * stop_after
    mode, rest, _ = _run(wds.Ledger(path, run="r2"), _loader(sources, 2 - workers), saved, None, stop_after)
    assert mode == "elastic"
    served = Counter(first + rest)
    expected = Counter(f"{n}{i}" for n in "ab" for i in range(SIZES[n]))
    assert served == expected, (sorted(served - expected), sorted(expected - served))
