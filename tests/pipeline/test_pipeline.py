"""Checkpointable pipelines: the same stream as webdataset, and exact resume from every step.

The oracle: capture the state before every element of an uninterrupted run; restoring any
of them into a *fresh* pipeline (built after reseeding the global RNGs differently) must
yield exactly the rest of the uninterrupted stream.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgpack
import pytest
import webdataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wdsraft as wds
from wdsraft.testing import assert_resumes_everywhere, identity, resume, roundtrip, states_along

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings

SHARDS = 6
PER_SHARD = 13  # odd sizes: batches and buffers straddle shard boundaries


@pytest.fixture(scope="module")
def urls(write_shards, corpus_records) -> list[str]:
    records = corpus_records[: SHARDS * PER_SHARD]
    return write_shards("p", [{"txt": r["text"][:200], "json": {"id": r["id"]}} for r in records], PER_SHARD)


def sample_buffer(state: dict[str, Any]) -> list:
    """The saved buffer of the last shuffle stage (the sample-level one)."""
    return [stage for stage in state["stages"].values() if stage and "buffer" in stage][-1]["buffer"]["columns"][0]


# -- the same stream as webdataset -----------------------------------------------------------------


def _classic(lib, urls, shardshuffle=4, bufsize=10, batch=3):
    return (
        lib.WebDataset(urls, shardshuffle=shardshuffle, seed=7)
        .shuffle(bufsize, seed=3)
        .decode()
        .to_tuple("__key__", "txt", "json")
        .batched(batch)
    )


def test_webdataset_stream_is_identical(urls) -> None:
    ours = [identity(b) for b in _classic(wds, urls)]
    theirs = [identity(b) for b in _classic(webdataset, urls)]
    assert ours == theirs and len(ours) == -(-SHARDS * PER_SHARD // 3)


def test_samples_equal_webdataset_webdataset_fields(urls) -> None:
    ours = list(wds.WebDataset(urls, shardshuffle=False))
    theirs = list(webdataset.WebDataset(urls, shardshuffle=False))
    assert [{k: v for k, v in s.items() if k not in ("__ordinal__", "__offset__")} for s in ours] == theirs


def test_datapipeline_stream_is_identical(urls) -> None:
    def build(lib):
        return lib.DataPipeline(
            lib.SimpleShardList(urls),
            lib.split_by_worker,
            lib.tarfile_to_samples(),
            lib.shuffle(20, seed=5),
            lib.decode(),
            lib.to_tuple("__key__", "txt"),
            lib.batched(4),
        )

    assert [identity(b) for b in build(wds)] == [identity(b) for b in build(webdataset)]


def test_resampled_deterministic_stream_is_identical(urls) -> None:
    def build(lib):
        return lib.DataPipeline(
            lib.ResampledShards(urls, deterministic=True, seed=11),
            lib.tarfile_to_samples(),
            lib.to_tuple("__key__"),
        ).with_epoch(50)

    assert [identity(x) for x in build(wds)] == [identity(x) for x in build(webdataset)]


# -- exact resume at every step --------------------------------------------------------------------


@pytest.mark.parametrize("bufsize", [1, 2, 10, 1000])
def test_restore_at_every_step(urls, bufsize: int) -> None:
    stream = assert_resumes_everywhere(lambda: _classic(wds, urls, bufsize=bufsize))
    assert len(stream) == 26


def test_restore_at_every_step_unbatched_samples(urls) -> None:
    assert_resumes_everywhere(lambda: wds.WebDataset(urls, shardshuffle=3, seed=1).shuffle(17).decode())


def test_restore_without_seeds(urls) -> None:
    """No seeds anywhere: the seeds drawn (shard shuffle) and RNG states (buffer) travel in the state."""
    assert_resumes_everywhere(lambda: wds.WebDataset(urls, shardshuffle=5).shuffle(9).to_tuple("__key__"))


def test_restore_across_epochs(urls) -> None:
    def make():
        return wds.WebDataset(urls, shardshuffle=4, seed=2).shuffle(8, seed=4).to_tuple("__key__").repeat(2)

    stream = assert_resumes_everywhere(make, kill_points=[0, 1, 77, 78, 79, 80, 120, 155, 156])
    assert len(stream) == 2 * SHARDS * PER_SHARD
    first, second = stream[: SHARDS * PER_SHARD], stream[SHARDS * PER_SHARD :]
    assert sorted(first) == sorted(second) and first != second  # a real reshuffle in epoch 2


def test_restore_resampled_with_epoch(urls) -> None:
    def make():
        return (
            wds.WebDataset(urls, resampled=True, seed=3, shardshuffle=False)
            .shuffle(6, seed=1)
            .to_tuple("__key__")
            .batched(4)
            .with_epoch(9)
        )

    stream = assert_resumes_everywhere(make)
    assert len(stream) == 9


@pytest.mark.parametrize("where", ["dataset", "webloader"])
def test_state_at_the_end_of_a_with_epoch_window_starts_the_next_epoch(urls, where) -> None:
    """A checkpoint taken inside the loop right after a window's last item: the resumed run's next
    iter() must go on with the following epoch, as the uninterrupted one does (it replayed the
    window's epoch once)."""

    def make():
        dataset = wds.WebDataset(urls, shardshuffle=4, seed=1).shuffle(4, seed=2).to_tuple("__key__")
        if where == "dataset":
            return dataset.with_epoch(5)
        loader = wds.WebLoader(dataset.batched(2), batch_size=None, num_workers=2)
        return loader.unbatched().shuffle(3, seed=5).batched(2).with_epoch(4)

    pipeline = make()
    first, state = [], None
    for item in pipeline:
        first.append(identity(item))
        state = pipeline.state_dict()
    following = [identity(item) for item in pipeline]
    assert following and following != first
    for how in ("msgpack", "json"):
        restored = make()
        restored.load_state_dict(roundtrip(state, how))
        assert [identity(item) for item in restored] == []
        assert [identity(item) for item in restored] == following


def test_restore_datapipeline_with_slice_and_partial_batches(urls) -> None:
    def make(lib=wds):
        return lib.DataPipeline(
            lib.SimpleShardList(urls),
            lib.shuffle(3, seed=8),
            lib.tarfile_to_samples(),
            lib.shuffle(11, seed=9),
            lib.slice(2, 61, 3),
            lib.to_tuple("__key__"),
            lib.batched(6, partial=False),
        )

    stream = assert_resumes_everywhere(make)
    assert stream == [identity(b) for b in make(webdataset)]
    assert len(stream) == 3  # 20 items sliced, full batches of 6 only


def test_detshuffle_follows_the_pipeline_epoch(urls) -> None:
    def make(epoch: int):
        pipeline = wds.WebDataset(urls, shardshuffle=6, detshuffle=True, seed=5).to_tuple("__key__")
        pipeline.set_epoch(epoch)
        return pipeline

    orders = [[identity(x) for x in make(epoch)] for epoch in (0, 1, 0)]
    assert orders[0] == orders[2] != orders[1]
    stream, states = states_along(lambda: make(1))
    assert resume(lambda: make(1), states[40]) == stream[40:]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bufsize=st.sampled_from([1, 2, 5, 40, 500]),
    shardshuffle=st.sampled_from([False, 2, 100]),
    batch=st.integers(1, 7),
    kill=st.lists(st.integers(0, 80), min_size=1, max_size=4),
    resume_twice=st.booleans(),
)
def test_property_resume_anywhere(urls, bufsize, shardshuffle, batch, kill, resume_twice) -> None:
    def make():
        return _classic(wds, urls, shardshuffle=shardshuffle, bufsize=bufsize, batch=batch)

    stream, states = states_along(make)
    for k in kill:
        k = min(k, len(states) - 1)
        if not resume_twice:
            assert resume(make, states[k]) == stream[k:]
            continue
        pipeline = make()  # restore, go on a little, save again, restore that
        pipeline.load_state_dict(roundtrip(states[k], "msgpack"))
        iterator = iter(pipeline)
        head = [identity(x) for x in itertools.islice(iterator, 3)]
        again = pipeline.state_dict()
        if len(head) == 3:  # (a shorter head ran into the end, which the reference run had not yet seen)
            assert again == states[k + 3]  # the same state as the uninterrupted run at that point
        if again.get("finished"):  # saved at the end of the epoch: resuming starts the next one
            following = make()
            following.set_epoch(1)
            assert head == stream[k:] and resume(make, again) == [identity(x) for x in following]
        else:
            assert head + resume(make, again) == stream[k:]


# -- the state protocol ----------------------------------------------------------------------------


def test_a_pipeline_iterated_here_still_pickles(urls) -> None:
    """Into spawned DataLoader workers, say: the copy holds no iteration (its next one is the next epoch,
    as the original's); the original goes on where it was."""
    import pickle

    pipeline = _classic(wds, urls)
    iterator = iter(pipeline)
    head = [next(iterator) for _ in range(3)]
    copy = pickle.loads(pickle.dumps(pipeline))
    assert [keys for keys, *_ in head + list(iterator)] == [keys for keys, *_ in _classic(wds, urls)]
    assert [keys for keys, *_ in copy] == [keys for keys, *_ in pipeline]  # (epoch 1 of both)


def test_state_is_fresh_plain_data(urls) -> None:
    pipeline = _classic(wds, urls)
    iterator = iter(pipeline)
    for _ in range(5):
        next(iterator)
    state = pipeline.state_dict()
    copy = json.loads(json.dumps(state))
    sample_buffer(state).clear()  # a fresh object: mutating it changes nothing inside
    assert pipeline.state_dict() == copy
    loaded = _classic(wds, urls)
    loaded.load_state_dict(copy)
    assert loaded.state_dict() == copy  # saving right after loading gives the same state


@pytest.mark.parametrize(
    "change",
    [
        lambda urls: _classic(wds, urls, shardshuffle=5),
        lambda urls: _classic(wds, urls[:-1]),
        lambda urls: _classic(wds, urls, batch=4),
        lambda urls: _classic(wds, urls, bufsize=11),
        lambda urls: wds.WebDataset(urls, shardshuffle=4, seed=8).shuffle(10, seed=3).decode(),
    ],
    ids=["shardshuffle", "shards", "batchsize", "bufsize", "seed-and-stages"],
)
def test_changed_configuration_fails_loudly(urls, change) -> None:
    _stream, states = states_along(lambda: _classic(wds, urls), limit=5)
    other = change(urls)
    with pytest.raises(wds.StateMismatchError, match="different pipeline configuration"):
        other.load_state_dict(states[-1])
        list(other)


def test_changed_rank_fails_loudly(urls, monkeypatch) -> None:
    def make():
        return wds.WebDataset(urls, shardshuffle=4, seed=1, nodesplitter=wds.split_by_node).to_tuple("__key__")

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    _stream, states = states_along(make, limit=4)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(wds.StateMismatchError, match="worker"):
        pipeline = make()
        pipeline.load_state_dict(states[-1])
        list(pipeline)


def test_foreign_state_is_rejected(urls) -> None:
    with pytest.raises(wds.StateMismatchError, match="not a wdsraft pipeline state"):
        _classic(wds, urls).load_state_dict({"epoch": 3})


def test_state_size_and_cost_stay_small(urls) -> None:
    pipeline = wds.WebDataset(urls, shardshuffle=4, seed=1).shuffle(60, seed=2).to_tuple("__key__")
    iterator = iter(pipeline)
    for _ in range(40):
        next(iterator)
    state = pipeline.state_dict()
    buffered = len(sample_buffer(state))
    assert buffered >= 30
    packed = msgpack.packb(state)
    rng_text = 2 * 3340  # two Mersenne Twister states as base64 (shard shuffle at epoch start, buffer now)
    assert (len(packed) - rng_text - 1500) / buffered <= 16  # positions, not sample bytes (samples are ~300 bytes)


# -- regressions found in review -------------------------------------------------------------------


def test_state_taken_right_after_a_resume_keeps_the_resume_point(urls) -> None:
    def make():
        return _classic(wds, urls, bufsize=10)

    stream, states = states_along(make)
    pipeline = make()
    pipeline.load_state_dict(states[9])
    iter(pipeline)  # started, nothing taken yet
    assert resume(make, pipeline.state_dict()) == stream[9:]


def test_end_of_epoch_state_starts_the_next_epoch(urls) -> None:
    def make():
        return wds.WebDataset(urls, shardshuffle=4, seed=2).shuffle(8, seed=4).to_tuple("__key__")

    pipeline = make()
    first = [identity(x) for x in pipeline]
    saved = pipeline.state_dict()
    second = [identity(x) for x in pipeline]
    assert saved.get("finished") and first != second
    assert resume(make, saved) == second


@pytest.mark.parametrize(
    "change",
    [
        lambda urls: wds.WebDataset(urls, shardshuffle=4, seed=7).shuffle(10, seed=3).to_tuple("__key__", "json"),
        lambda urls: (
            wds.WebDataset(urls, shardshuffle=4, seed=7, handler=wds.warn_and_continue)
            .shuffle(10, seed=3)
            .to_tuple("__key__", "txt")
        ),
    ],
    ids=["to_tuple-arguments", "handler"],
)
def test_stage_arguments_are_part_of_the_fingerprint(urls, change) -> None:
    base = wds.WebDataset(urls, shardshuffle=4, seed=7).shuffle(10, seed=3).to_tuple("__key__", "txt")
    _stream, states = states_along(lambda: base, limit=3)
    other = change(urls)
    with pytest.raises(wds.StateMismatchError, match="different pipeline configuration"):
        other.load_state_dict(states[-1])
        list(other)


# -- the oracle itself -----------------------------------------------------------------------------


def test_the_oracle_fails_a_resume_that_alters_payloads_under_the_right_keys(urls) -> None:
    """A restored pipeline whose samples keep their keys but carry other bytes must fail the oracle."""
    restored = {"now": False}

    def make():
        def alter(sample):
            if restored["now"]:
                sample = {**sample, "txt": sample["txt"][:-1]}  # a payload cut by one byte
            return sample

        return wds.WebDataset(urls, shardshuffle=False).map(alter)

    stream, states = states_along(make)
    assert resume(make, states[3]) == stream[3:]
    restored["now"] = True
    with pytest.raises(AssertionError):
        assert resume(make, states[3]) == stream[3:]
