"""``interleave_datasets`` (issue 17, item 1): a weighted mixture of pipelines with per-source passes,
deterministic from its seed and resumable at every item, also under a WebLoader with workers."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wdsraft as wds
from wdsraft.pipeline.interleave import pass_epoch, uniform, uniforms
from wdsraft.testing import assert_resumes_everywhere, identity, resume, roundtrip, states_along

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SIZES = {"a": 40, "b": 20, "c": 10}  # samples per source, 5 per shard


@pytest.fixture(scope="module")
def sources(write_shards) -> dict[str, list[str]]:
    return {
        name: write_shards(f"mix{name}", [{"txt": f"{name}{n}"} for n in range(count)], 5)
        for name, count in SIZES.items()
    }


def _datasets(sources, shuffled: bool = False) -> list:
    if shuffled:
        return [wds.WebDataset(sources[n], shardshuffle=10, seed=3).shuffle(4, seed=5) for n in "abc"]
    return [wds.WebDataset(sources[n], shardshuffle=False) for n in "abc"]


def _who(item) -> tuple[str, int]:
    return (item["txt"].decode(), item["__pass__"])


def test_passes_and_stop_rules(sources) -> None:
    mix = wds.interleave_datasets(_datasets(sources), [5, 3, 2], seed=1, stop="all_exhausted", repeats=[1, 2, 3])
    got = Counter(_who(item) for item in mix)
    expected = Counter(
        (f"{name}{n}", p)
        for name, passes in zip("abc", (1, 2, 3), strict=True)
        for p in range(passes)
        for n in range(SIZES[name])
    )
    assert got == expected  # every sample once per pass, each pass numbered

    first = list(wds.interleave_datasets(_datasets(sources), [1, 1, 8], seed=1, repeats=1))
    # first_exhausted: c (10 samples, drawn 80% of the time) ends the mixture, a and b are cut short
    assert sum(1 for item in first if item["__source__"] == 2) == SIZES["c"]
    assert all(sum(1 for item in first if item["__source__"] == s) < SIZES[n] for s, n in ((0, "a"), (1, "b")))


def test_each_pass_runs_its_own_epoch(sources) -> None:
    """Pass p of epoch e runs the source at pass_epoch(e, p): a shuffled source reshuffles every pass."""
    assert len({pass_epoch(e, p) for e in range(30) for p in range(30)}) == 900
    shards_shuffled = wds.WebDataset(sources["a"], shardshuffle=10, seed=3)  # (its order: (seed, epoch) only)
    items = list(wds.interleave_datasets([shards_shuffled], repeats=3))
    orders = [[item["txt"] for item in items if item["__pass__"] == p] for p in range(3)]
    assert sorted(orders[0]) == sorted(orders[1]) == sorted(orders[2]) and len(orders[0]) == SIZES["a"]
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]


@pytest.mark.timeout(30)
def test_a_source_for_ever_and_an_empty_source(sources) -> None:
    """repeats=None goes on for ever; a source that gives nothing is exhausted, not re-read for ever."""
    endless = wds.interleave_datasets(_datasets(sources)[2:], repeats=None)
    taken = [item for _, item in zip(range(95), endless, strict=False)]
    assert len(taken) == 95 and max(item["__pass__"] for item in taken) == 9
    empty = wds.WebDataset(sources["b"], shardshuffle=False).select(lambda sample: False)
    mix = wds.interleave_datasets([_datasets(sources)[2], empty], stop="all_exhausted", repeats=[1, None])
    assert len(list(mix)) == SIZES["c"]


def test_draws_do_not_depend_on_how_they_are_grouped() -> None:
    """The mixer draws 256 at a time with numpy: the same floats as splitmix64 one by one, wherever a
    block starts (a restore starts one at the draw it stopped at)."""
    key = (1 << 63) - 12345
    assert uniforms(key, 1000, 300).tolist() == [uniform(key, n) for n in range(1000, 1300)]
    assert uniforms(key, 7, 5).tolist() == uniforms(key, 0, 12).tolist()[7:]
    draws = uniforms(key, 0, 20000)
    assert draws.min() >= 0 and draws.max() < 1 and abs(draws.mean() - 0.5) < 0.01


def test_the_seed_decides_the_stream(sources) -> None:
    def keys(seed):
        return [item["txt"] for item in wds.interleave_datasets(_datasets(sources), seed=seed)]

    assert keys(1) == keys(1) and keys(1) != keys(2)


@pytest.mark.parametrize("weights", [[5, 3, 2], [1, 1, 1], [0.1, 0.3, 0.6]])
def test_observed_proportions_match_the_weights(sources, weights) -> None:
    """Each draw picks source i with probability w_i / sum(w): over N items the count of source i is
    Binomial(N, p_i); every count must lie within 4.5 standard deviations (a chance of about 1e-5 each)."""
    n = 3000
    mix = wds.interleave_datasets(_datasets(sources), weights, seed=7, repeats=None)
    counts = Counter(item["__source__"] for _, item in zip(range(n), mix, strict=False))
    total = sum(weights)
    for index, weight in enumerate(weights):
        p = weight / total
        assert abs(counts[index] - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)), (index, counts, weights)


def test_resumes_before_every_item(sources) -> None:
    def make():
        return wds.interleave_datasets(
            _datasets(sources, shuffled=True), [5, 3, 2], seed=4, stop="all_exhausted", repeats=[1, 2, 3]
        )

    assert len(assert_resumes_everywhere(make, same_shape=False)) == 40 + 40 + 30


def test_sources_that_drew_their_own_seeds_resume_in_later_passes(sources) -> None:
    """Sources shuffled without a seed draw one: the mixture's states carry it, so a restored mixture's later
    passes (begun after the restore) shuffle as the uninterrupted ones did."""

    def make():
        unseeded = [wds.WebDataset(sources[n], shardshuffle=False).shuffle(6) for n in "bc"]
        return wds.interleave_datasets(unseeded, [1, 1], stop="all_exhausted", repeats=[2, 3])

    assert len(assert_resumes_everywhere(make, kill_points=[0, 3, 17, 41], same_shape=False)) == 70
    batches = assert_resumes_everywhere(lambda: wds.DataPipeline(make(), wds.batched(4)), same_shape=False)
    assert len(batches) == 18


def test_resumes_as_a_pipeline_source_with_buffers_after_it(sources) -> None:
    def make():
        mix = wds.interleave_datasets(_datasets(sources, shuffled=True), [5, 3, 2], seed=4, repeats=[1, 2, None])
        return wds.DataPipeline(mix, wds.shuffle(7, seed=2), wds.batched(3))

    assert len(assert_resumes_everywhere(make, same_shape=False)) > 20


def test_snapshots_pruned_while_a_buffer_holds_items_still_resume(sources, monkeypatch) -> None:
    """A whole state every item (instead of every 64): the mixer prunes its snapshots as it goes, keeping
    the one a restore of the items the shuffle buffer holds needs."""
    from wdsraft.pipeline.interleave import InterleaveSource

    monkeypatch.setattr(InterleaveSource, "snapshot_every", 1)

    def make():
        mix = wds.interleave_datasets(_datasets(sources), [5, 3, 2], seed=4, stop="all_exhausted", repeats=[2, 2, 2])
        return wds.DataPipeline(mix, wds.shuffle(20, seed=2), wds.batched(3))

    assert len(assert_resumes_everywhere(make, kill_points=[30, 45, 52, 60], same_shape=False)) == 47


def _loader(sources, workers: int):
    mix = wds.interleave_datasets(_datasets(sources, shuffled=True), [5, 3, 2], seed=4, repeats=[1, 2, 2])
    return wds.WebLoader(
        wds.DataPipeline(mix, wds.batched(3)), batch_size=None, num_workers=workers, snapshot_every_n_steps=2
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_every_worker_reads_its_share_of_each_source(sources, workers) -> None:
    """Each DataLoader worker's copy of a source reads its own shards: until the first source runs out, no
    sample is served twice in one pass, and with stop="all_exhausted" every sample is served once per pass."""
    mix = wds.interleave_datasets(_datasets(sources), [5, 3, 2], seed=4, stop="all_exhausted", repeats=[1, 2, 2])
    loader = wds.WebLoader(wds.DataPipeline(mix, wds.batched(3)), batch_size=None, num_workers=workers)
    got = Counter((text, int(p)) for batch in loader for text, p in zip(batch["txt"], batch["__pass__"], strict=True))
    assert got == Counter(
        (f"{name}{n}".encode(), p)
        for name, passes in zip("abc", (1, 2, 2), strict=True)
        for p in range(passes)
        for n in range(SIZES[name])
    )


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_webloader_over_a_mixture_resumes_at_any_step(sources, data) -> None:
    workers = data.draw(st.sampled_from([0, 2]))
    stream, states = states_along(lambda: _loader(sources, workers))
    kill = data.draw(st.integers(0, len(states) - 1))
    assert resume(lambda: _loader(sources, workers), states[kill], seed=kill) == stream[kill:]


def test_a_webloader_with_two_workers_resumes_at_every_step(sources) -> None:
    assert_resumes_everywhere(lambda: _loader(sources, 2), same_shape=False)


def test_a_changed_weight_is_refused_by_an_exact_resume(sources) -> None:
    def make(weights):
        return wds.interleave_datasets(_datasets(sources), weights, seed=4)

    _, states = states_along(lambda: make([5, 3, 2]), limit=5)
    with pytest.raises(wds.StateMismatchError, match="weights"):
        list(resume(lambda: make([5, 3, 3]), states[3]))


def test_bad_arguments_are_refused(sources) -> None:
    a, b, c = _datasets(sources)
    with pytest.raises(ValueError, match="2 weights for 3"):
        wds.interleave_datasets([a, b, c], [1, 2])
    for weights in ([0, 0], [1, float("inf")], [1, float("nan")], [1, -1]):
        with pytest.raises(ValueError, match="positive sum"):
            wds.interleave_datasets([a, b], weights)
    with pytest.raises(ValueError, match="stop must be"):
        wds.interleave_datasets([a, b], stop="longest")
    with pytest.raises(ValueError, match="repeats itself"):
        wds.interleave_datasets([a, wds.WebDataset(sources["b"]).repeat(2)])
    for inner_repeats, outer_repeats in ((2, 1), (1, 2)):
        inner = wds.interleave_datasets(_datasets(sources)[:2], repeats=inner_repeats)
        with pytest.raises(ValueError, match="source 0 is a mixture"):
            wds.interleave_datasets([wds.DataPipeline(inner, wds.map(dict)), c], repeats=[outer_repeats, 1])
    nested = wds.interleave_datasets([wds.interleave_datasets([a, b]), c])  # (no passes: allowed)
    assert len(list(nested)) > 0
    with pytest.raises(ValueError, match="same dataset object"):
        wds.interleave_datasets([a, a])
    assert identity(next(iter(wds.interleave_datasets([a, b], [0, 1]))))  # a zero weight is never drawn
    assert all(item["__source__"] == 1 for item in wds.interleave_datasets([a, b], [0, 1]))


def test_a_buffer_spanning_many_snapshots_is_walked_rarely(sources, monkeypatch) -> None:
    """With a snapshot every item and a shuffle buffer holding more than 64 of them, pruning walks the
    buffer's addresses a few times per pass, not at every snapshot (it used to: a 3x per-item cost), and the
    pipeline still resumes exactly."""
    from wdsraft.pipeline.interleave import InterleaveSource
    from wdsraft.pipeline.nested import SnapshotSource

    monkeypatch.setattr(InterleaveSource, "snapshot_every", 1)
    calls = []
    original = SnapshotSource._prune
    monkeypatch.setattr(SnapshotSource, "_prune", lambda self, ctx: (calls.append(1), original(self, ctx))[1])

    def make():
        mix = wds.interleave_datasets(_datasets(sources), [5, 3, 2], seed=4, stop="all_exhausted", repeats=[3, 3, 3])
        return wds.DataPipeline(mix, wds.shuffle(100, seed=2))

    stream = assert_resumes_everywhere(make, kill_points=[0, 90, 120], same_shape=False)
    calls.clear()
    assert len([identity(item) for item in make()]) == len(stream) > 100
    assert 0 < len(calls) <= 6, len(calls)


def test_fluent_stages_on_a_mixture_and_a_concatenation(sources) -> None:
    """epochraft's chains (``interleave_datasets(...).shuffle(n).batched(b)``) work on what the factories
    return, resume at every step, and make the stream the explicit pipeline makes."""

    def mixed():
        return (
            wds.interleave_datasets(_datasets(sources, shuffled=True), [5, 3, 2], seed=4).shuffle(7, seed=2).batched(3)
        )

    def concatenated():
        return wds.concat_datasets(_datasets(sources, shuffled=True)).shuffle(7, seed=2).batched(3)

    explicit = wds.DataPipeline(
        wds.interleave_datasets(_datasets(sources, shuffled=True), [5, 3, 2], seed=4),
        wds.shuffle(7, seed=2),
        wds.batched(3),
    )
    assert [identity(batch) for batch in mixed()] == [identity(batch) for batch in explicit]
    assert isinstance(mixed(), wds.Interleave) and isinstance(concatenated(), wds.ConcatDatasets)
    for make in (mixed, concatenated):
        assert len(assert_resumes_everywhere(make, same_shape=False)) > 10


class _Characters(wds.llm.TokenizerAdapter):
    """One token per character (a tokenizer that needs no files)."""

    name = "characters"

    def encode_batch(self, texts):
        return [np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).copy() for text in texts]


@pytest.mark.parametrize("stage", ["concat_chunk", "pack_bestfit"])
def test_a_state_taken_before_a_restored_source_is_drawn_again_holds_its_sequence_stage(sources, stage) -> None:
    """A mixture restores every source at once, but draws from some of them only later; a state taken in between
    must still hold what those sources' sequence stages held (they adopt it only as they start). The mix fast path
    began the sources' passes at the restore, and such a second resume lost those tokens, silently."""

    def make():
        def source(name):
            tokens = wds.WebDataset(sources[name], shardshuffle=False).tokenize(_Characters(), text="txt", batch_size=2)
            return getattr(tokens, stage)(8)

        return wds.interleave_datasets([source("a"), source("b")], [1, 1], seed=3, stop="all_exhausted")

    full = [identity(item["input_ids"]) for item in make()]
    for k in range(1, len(full) - 2):
        first = make()
        iterator = iter(first)
        for _ in range(k):
            next(iterator)
        second = make()
        second.load_state_dict(roundtrip(first.state_dict(), "json"))
        items = iter(second)
        head = identity(next(items)["input_ids"])  # one draw: the other source not drawn again yet
        third = make()
        third.load_state_dict(roundtrip(second.state_dict(), "json"))
        assert [head, *(identity(item["input_ids"]) for item in third)] == full[k:], k
