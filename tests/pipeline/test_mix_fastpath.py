"""What a mixture costs per item (issue 17: within 5 % of one source) without changing what it hands out:
its sources' items are pulled straight from their passes (no generator of their iteration per item), the
mixer draws and stamps in one loop, and states count what each source gave when they are taken."""

from __future__ import annotations

import inspect
import io
import json
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

import wdsraft as wds
from wdsraft.core.distributed import worker_info
from wdsraft.pipeline.interleave import InterleaveSource
from wdsraft.pipeline.nested import END
from wdsraft.pipeline.stage import Context
from wdsraft.testing import assert_resumes_everywhere

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SIZES = {"a": 40, "b": 20, "c": 10}  # samples per source, 5 per shard (as the fixture of fcd98c2's states)


def _write(name: str, count: int, per: int = 5) -> list[str]:
    """Shards written with tarfile (fixed headers, no index): the same bytes whatever wdsraft's writer does."""
    Path(name).mkdir(exist_ok=True)
    urls = []
    for first in range(0, count, per):
        url = f"{name}/{name}-{first // per:04d}.tar"
        with tarfile.open(url, "w", format=tarfile.USTAR_FORMAT) as tar:
            for n in range(first, min(first + per, count)):
                data = f"{name}{n}".encode()
                info = tarfile.TarInfo(f"{name}{n:05d}.txt")
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))
        urls.append(url)
    return urls


@pytest.fixture
def urls(tmp_path, monkeypatch) -> dict[str, list[str]]:
    monkeypatch.chdir(tmp_path)  # (relative URLs: the fixture's states name them so)
    return {name: _write(name, count) for name, count in SIZES.items()}


def _sources(urls, **kw) -> list:
    return [wds.DataPipeline(wds.SimpleShardList(urls[n]), wds.tarfile_to_samples(), **kw) for n in "abc"]


def _mixture(urls, sources=None):
    return wds.interleave_datasets(
        sources or _sources(urls), [5, 3, 2], seed=4, stop="all_exhausted", repeats=[1, 2, 2]
    )


def _batched(urls):
    return wds.DataPipeline(_mixture(urls), wds.shuffle(5, seed=2), wds.batched(3, collation_fn=None))


def _names(batch) -> list[str]:
    return [f"{s['txt'].decode()}/{s['__pass__']}" for s in batch]


def test_states_saved_at_fcd98c2_resume_exactly(urls) -> None:
    """States of a mixture under a shuffle and a batch, saved by wdsraft at fcd98c2 (a whole state every 64
    items then, every 256 now): loaded now, each resumes the stream fcd98c2 handed out, batch for batch."""
    saved = json.loads((Path(__file__).parent / "data" / "interleave_states_fcd98c2.json").read_text())
    assert [_names(batch) for batch in _batched(urls)] == saved["stream"]
    assert len(saved["states"]) == 3
    for kill, state in saved["states"].items():
        pipeline = _batched(urls)
        pipeline.load_state_dict(state)
        assert [_names(batch) for batch in pipeline] == saved["stream"][int(kill) + 1 :], kill


def test_source_states_count_what_the_mixture_took(urls) -> None:
    """A source's items come straight from its pass: its state still counts them (``yielded``, ``pass_count``),
    from what the mixture took, also after a restore."""
    mixture = _mixture(urls)
    taken: Counter[tuple[int, int]] = Counter()
    for number, item in enumerate(mixture):
        taken[item["__source__"], item["__pass__"]] += 1
        if number % 7 == 3:
            for index, source in enumerate(mixture.state_dict()["stages"]["0"]["resume"]["sources"]):
                if source["state"] is not None:
                    count = taken[index, source["pass"]]
                    assert (source["count"], source["state"]["pass_count"], source["state"]["yielded"]) == (count,) * 3
    restored = _mixture(urls)
    restored.load_state_dict(state := _first_state_past(urls, 30))
    before = {i: s["count"] for i, s in enumerate(state["stages"]["0"]["resume"]["sources"]) if s["state"] is not None}
    item = next(iter(restored))
    source = restored.state_dict()["stages"]["0"]["resume"]["sources"][item["__source__"]]
    assert source["state"]["pass_count"] == source["count"] == before.get(item["__source__"], 0) + 1
    assert sum(taken.values()) == 40 + 2 * 20 + 2 * 10


def _first_state_past(urls, items: int) -> dict:
    mixture = _mixture(urls)
    for number, _ in enumerate(mixture):
        if number + 1 == items:
            return mixture.state_dict()
    raise AssertionError("too short")


def test_a_source_that_splits_items_before_its_output_still_resumes(urls) -> None:
    """A plain function right before a source's output that yields several items per sample: its pass counts
    each item as it goes out, so that source is iterated as before (not straight), and resumes everywhere."""

    def halves(samples):
        for sample in samples:
            for half in (0, 1):
                yield {**sample, "half": half}

    def make():
        sources = [wds.DataPipeline(wds.SimpleShardList(urls[n]), wds.tarfile_to_samples(), halves) for n in "abc"]
        return _mixture(urls, sources)

    stream = assert_resumes_everywhere(make, same_shape=False)
    assert len(stream) == 2 * (40 + 2 * 20 + 2 * 10)


def test_the_one_loop_hands_out_what_fetch_does(urls) -> None:
    """The mixer's loop (draws, passes, sources leaving the draw) gives the items ``fetch`` gives one by one,
    which a restore uses to fetch again what stages after the mixture hold."""
    by_loop = [(s["txt"], s["__pass__"]) for s in _mixture(urls)]
    source = _mixture(urls).pipeline[0]
    assert isinstance(source, InterleaveSource)
    source.start(Context(0, worker_info()), None)
    by_fetch = []
    while (item := source.fetch()) is not END:
        by_fetch.append((item["txt"], item["__pass__"]))
    assert by_loop == by_fetch
    assert len(by_loop) == 40 + 2 * 20 + 2 * 10


def _resumes_per_item(make) -> float:
    """Generator runs (starts and resumes) per item in wdsraft's pipeline modules over one epoch: the per-item
    path (what runs once per epoch is mostly plain functions)."""
    calls = 0

    def profile(frame, event, arg) -> None:
        nonlocal calls
        code = frame.f_code
        if event == "call" and code.co_flags & inspect.CO_GENERATOR and "wdsraft/pipeline/" in code.co_filename:
            calls += 1

    dataset = make()
    sys.setprofile(profile)
    try:
        count = sum(1 for _ in dataset)
    finally:
        sys.setprofile(None)
    return calls / count


def test_a_mixture_adds_one_generator_per_item(urls) -> None:
    """Per item, a mixture of three sources runs one generator more than one source reading the same shards
    (the mixer's loop): not its sources' iterations (4 more at fcd98c2: theirs and the mixer's)."""
    every = urls["a"] + urls["b"] + urls["c"]
    single = _resumes_per_item(lambda: wds.DataPipeline(wds.SimpleShardList(every), wds.tarfile_to_samples()))
    mixed = _resumes_per_item(lambda: wds.interleave_datasets(_sources(urls), [5, 3, 2], seed=4, stop="all_exhausted"))
    assert mixed - single <= 1.5, (single, mixed)


def test_a_random_mix_as_a_first_stage_keeps_its_whole_state_every_256_items(urls, monkeypatch) -> None:
    """``DataPipeline(RandomMix(...), shuffle, batched)`` keeps the mix's whole state (its datasets' and its
    RNG's) before every 256th item, not every 16th or 64th, and still resumes exactly behind the
    buffers."""
    calls = []
    original = wds.RandomMix.state_dict
    monkeypatch.setattr(wds.RandomMix, "state_dict", lambda self: (calls.append(1), original(self))[1])

    def make():
        mix = wds.RandomMix(_sources(urls), [5, 3, 2], longest=True, seed=3)
        return wds.DataPipeline(mix, wds.shuffle(5, seed=2), wds.batched(3, collation_fn=None))

    assert sum(len(batch) for batch in make()) == 70
    assert len(calls) == 1, len(calls)  # (before item 0 only: 70 items, no 256th)
    stream = assert_resumes_everywhere(make, kill_points=[0, 5, 20, 22, 23], same_shape=False)
    assert sum(len(batch) for batch in stream) == 70
