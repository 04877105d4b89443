"""``RandomMix`` and ``RoundRobin`` (issue 14, item 4): webdataset's streams, and checkpointable: the mix's
RNG and each dataset's own state in the checkpoint, so a restore reads nothing again."""

from __future__ import annotations

import random

import pytest
import webdataset

import wdsraft as wds
from wdsraft.testing import assert_resumes_everywhere, identity, resume, states_along

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _two(lib, text_urls, audio_urls, counter=None):
    def count(sample):
        if counter is not None:
            counter.append(sample["__key__"])
        return sample

    first = lib.WebDataset(text_urls, shardshuffle=False).shuffle(5, seed=1, **_once(lib)).map(count)
    second = lib.WebDataset(audio_urls, shardshuffle=False).map(count)
    return [first.to_tuple("__key__", "__url__"), second.to_tuple("__key__", "__url__")]


def _once(lib):  # (wdsraft reshuffles each epoch unless told; webdataset repeats a seeded order)
    return {"reshuffle_each_epoch": False} if lib is wds else {}


@pytest.mark.parametrize("longest", [False, True])
@pytest.mark.parametrize("probs", [None, [0.2, 0.8]])
def test_random_mix_is_webdatasets_stream_for_the_same_global_seed(text_urls, audio_urls, longest, probs) -> None:
    random.seed(5)
    ours = [identity(x) for x in wds.RandomMix(_two(wds, text_urls, audio_urls), probs, longest=longest)]
    after_ours = random.random()
    random.seed(5)
    theirs = [identity(x) for x in webdataset.RandomMix(_two(webdataset, text_urls, audio_urls), probs, longest)]
    assert ours == theirs and after_ours == random.random()  # the global generator advanced as much
    assert len(ours) == 50 if longest else len(ours) < 50


def _three(lib, text_urls, audio_urls):
    return [*_two(lib, text_urls, audio_urls), lib.WebDataset(audio_urls[:1], shardshuffle=False).to_tuple("__key__")]


@pytest.mark.parametrize("longest", [False, True])
def test_round_robin_is_webdatasets_stream(text_urls, audio_urls, longest) -> None:
    ours = [identity(x) for x in wds.RoundRobin(_three(wds, text_urls, audio_urls), longest=longest)]
    theirs = [identity(x) for x in webdataset.RoundRobin(_three(webdataset, text_urls, audio_urls), longest=longest)]
    assert ours == theirs and len(ours) == (56 if longest else 20)


@pytest.mark.parametrize(
    "make_mix",
    [
        lambda ds: wds.RandomMix(ds, longest=True),
        lambda ds: wds.DataPipeline(wds.RoundRobin(ds), wds.shuffle(5, seed=1)),
        lambda ds: wds.DataPipeline(ds[0], wds.shuffle(5, seed=1)),  # a pipeline as another's source
    ],
    ids=["random-mix", "round-robin-nested", "nested-pipeline"],
)
def test_the_next_epoch_after_a_restore_between_epochs_is_the_uninterrupted_one(text_urls, make_mix) -> None:
    """Datasets with drawn seeds and shard shuffles: their epoch and seeds follow the outer pipeline's."""

    def make():
        datasets = [
            wds.WebDataset(text_urls, shardshuffle=5).shuffle(4).to_tuple("__key__"),
            wds.WebDataset(text_urls[:2], shardshuffle=5).to_tuple("__key__"),
        ]
        return make_mix(datasets)

    pipeline = make()
    first = [identity(x) for x in pipeline]
    state = pipeline.state_dict()
    second = [identity(x) for x in pipeline]
    fresh = make()
    fresh.load_state_dict(state)
    assert [identity(x) for x in fresh] == second != first


@pytest.mark.parametrize(
    "make_mix",
    [
        lambda ds: wds.RandomMix(ds, [0.4, 0.6], seed=9),
        lambda ds: wds.RandomMix(ds, longest=True),  # from the global generator, carried in the state
        lambda ds: wds.RoundRobin(ds, longest=True),
    ],
    ids=["random-seeded", "random-global", "round-robin"],
)
def test_mixes_resume_everywhere_across_epochs(text_urls, audio_urls, make_mix) -> None:
    random.seed(1)  # (the unseeded mix copies the global generator at its first pass)
    stream = assert_resumes_everywhere(lambda: make_mix(_two(wds, text_urls, audio_urls)).repeat(2), same_shape=False)
    assert len(stream) > 40


def test_a_restored_mix_reads_only_what_is_left(text_urls, audio_urls) -> None:
    """Each dataset restores from its own state: nothing before the checkpoint is read again (no replay)."""

    def make(counter=None):
        return wds.RandomMix(_two(wds, text_urls, audio_urls, counter), longest=True, seed=4)

    stream, states = states_along(make)
    for k in (10, 33):
        read: list = []
        assert resume(lambda read=read: make(read), states[k]) == stream[k:]
        assert len(read) <= len(stream) - k + 5, (k, len(read))  # (+ the shuffle buffer's refill)


@pytest.mark.parametrize("every", [None, 2, 5])
@pytest.mark.parametrize("mixer", ["RandomMix", "RoundRobin"])
def test_a_mix_with_a_buffer_after_it_resumes(text_urls, audio_urls, monkeypatch, mixer, every) -> None:
    """Read as a pipeline's first stage, a mix keeps its whole state every ``nested_snapshot_every`` items (256):
    a restore goes back to the newest one before what the buffer after it holds. Small intervals here, so that
    restores start from later snapshots too, not only the first."""
    if every is not None:
        monkeypatch.setattr(getattr(wds, mixer), "nested_snapshot_every", every)

    def make():
        datasets = _two(wds, text_urls, audio_urls)
        mix = wds.RandomMix(datasets, longest=True, seed=2) if mixer == "RandomMix" else wds.RoundRobin(datasets, True)
        return wds.DataPipeline(mix, wds.shuffle(4, seed=3), wds.batched(3))

    assert len(assert_resumes_everywhere(make, same_shape=False)) == 17


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mix_in_a_webloader_resumes(text_urls, audio_urls, workers) -> None:
    def make():
        mix = wds.RandomMix(_two(wds, [u for u in text_urls], audio_urls), longest=True, seed=6)
        return wds.WebLoader(
            wds.DataPipeline(mix, wds.batched(2)), batch_size=None, num_workers=workers, snapshot_every_n_steps=3
        )

    assert_resumes_everywhere(make, kill_points=[0, 4, 9, 13], same_shape=False)


def test_a_mix_of_something_without_state_refuses_when_asked(text_urls) -> None:
    mix = wds.RoundRobin([wds.WebDataset(text_urls, shardshuffle=False), [{"__key__": "x"}] * 5], longest=True)
    iterator = iter(mix)
    next(iterator)
    with pytest.raises(wds.StateMismatchError, match=r"dataset 1 \(list\) has no state_dict"):
        mix.state_dict()
    assert len(list(iterator)) == 34
