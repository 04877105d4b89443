"""README claims that had no test of their own.

- Limits "raising a clear error rather than resuming wrong": a buffering stage after a stage that
  merges items in the same pipeline (``batched`` then ``shuffle``) cannot save its buffer; ``unbatched``
  in the middle of a batch made inside the same pipeline cannot either (after a DataLoader, in
  ``WebLoader``, it can).
- Loading a state into another configuration raises ``StateMismatchError`` naming what differs, "for
  example ``stages.6.bufsize: saved 10, now 11``".
"""

from __future__ import annotations

import random
import re

import pytest
import webdataset

import wdsraft as wds
from wdsraft.testing import identity, resume, states_along

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings


@pytest.fixture(scope="module")
def urls(write_shards, corpus_records) -> list[str]:
    return write_shards("c", [{"txt": r["text"][:80], "cls": n % 5} for n, r in enumerate(corpus_records[:40])], 10)


# -- limits that raise rather than resume wrong ----------------------------------------------------


@pytest.mark.parametrize("taken", [1, 5, 13])
def test_a_shuffle_after_batched_refuses_to_save_its_buffer(urls, taken) -> None:
    """The shuffle holds batches, which have no position in the shards: its state cannot be saved. The
    error says which stage and what to do, and comes from state_dict itself (no state is produced)."""
    pipeline = wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__").batched(2).shuffle(6, seed=1)
    iterator = iter(pipeline)
    for _ in range(taken):
        next(iterator)
    with pytest.raises(wds.StateMismatchError, match=r"cannot save stage \d+ \(shuffle\).*shuffle before batching"):
        pipeline.state_dict()


def test_a_shuffle_after_batched_in_a_loader_refuses_too(urls) -> None:
    dataset = wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__").batched(2).shuffle(6, seed=1)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=0)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(wds.StateMismatchError, match=r"\(shuffle\).*shuffle before batching"):
        loader.state_dict()


def test_the_same_shuffle_before_batched_saves_and_resumes(urls) -> None:
    """(What the error advises works: the counterpart, at every step.)"""

    def make():
        return wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__").shuffle(6, seed=1).batched(2)

    stream, states = states_along(make)
    for k in range(len(states)):
        assert resume(make, states[k]) == stream[k:], k


def _inner_unbatched(urls):
    return wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__", "cls").batched(4).unbatched()


@pytest.mark.parametrize("taken", [1, 2, 3, 5, 11])
def test_unbatched_in_the_middle_of_an_inner_batch_refuses_to_save(urls, taken) -> None:
    pipeline = _inner_unbatched(urls)
    iterator = iter(pipeline)
    for _ in range(taken):
        next(iterator)
    with pytest.raises(wds.StateMismatchError, match=r"\(unbatched\): it is in the middle of a batch"):
        pipeline.state_dict()


def test_unbatched_between_inner_batches_saves_and_resumes(urls) -> None:
    """Between two batches nothing is held: those states are taken and resume exactly."""
    stream = [identity(item) for item in _inner_unbatched(urls)]
    assert len(stream) == 40
    for taken in (0, 4, 8, 36, 40):
        pipeline = _inner_unbatched(urls)
        iterator = iter(pipeline)
        for _ in range(taken):
            next(iterator)
        assert resume(lambda: _inner_unbatched(urls), pipeline.state_dict()) == stream[taken:], taken


@pytest.mark.parametrize("workers", [0, 2])
def test_unbatched_after_a_webloader_resumes_in_the_middle_of_a_batch(urls, workers) -> None:
    """After a DataLoader, in WebLoader, unbatched saves mid-batch and resumes item for item."""

    def make():
        dataset = wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__", "cls").batched(4)
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers).unbatched()

    stream, states = states_along(make)
    assert len(stream) == 40
    for k in (1, 2, 3, 6, 17, 39):  # all in the middle of a batch of 4
        assert resume(make, states[k]) == stream[k:], k


# -- StateMismatchError names the differing field ---------------------------------------------------


def _classic(urls, bufsize: int = 10, seed: int = 3, batch: int = 4, shards=None):
    shards = urls if shards is None else shards
    return wds.WebDataset(shards, shardshuffle=4, seed=7).shuffle(bufsize, seed=seed).to_tuple("__key__").batched(batch)


@pytest.mark.parametrize(
    ("change", "fields"),
    [
        ({"bufsize": 11}, [r"stages\.\d+\.bufsize: saved 10, now 11"]),  # the README's own example
        ({"seed": 4}, [r"stages\.\d+\.seed: saved 3, now 4"]),
        ({"batch": 5}, [r"stages\.\d+\.batchsize: saved 4, now 5"]),
        ({"shards": "drop-last"}, [r"stages\.0\.num_urls: saved 4, now 3", r"stages\.0\.urls: saved '\w+', now '\w+'"]),
    ],
    ids=["bufsize", "seed", "batchsize", "shards"],
)
def test_a_state_loaded_into_another_configuration_names_what_differs(urls, change, fields) -> None:
    _stream, states = states_along(lambda: _classic(urls), limit=3)
    if change.get("shards") == "drop-last":
        change = {"shards": urls[:-1]}
    other = _classic(urls, **change)
    with pytest.raises(wds.StateMismatchError) as caught:
        other.load_state_dict(states[-1])
        list(other)
    message = str(caught.value)
    assert "different pipeline configuration" in message
    for field in fields:
        assert re.search(field, message), (field, message)
    assert len(re.findall(r"[\w.]+: saved ", message)) == len(fields), message  # those fields, nothing else


def test_a_loader_state_in_another_worker_count_names_it(urls) -> None:
    def make(workers: int):
        dataset = wds.WebDataset(urls, shardshuffle=4, seed=7).to_tuple("__key__").batched(2)
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers)

    loader = make(2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    del iterator
    other = make(1)
    with pytest.raises(wds.StateMismatchError) as caught:
        other.load_state_dict(state)
        list(other)
    assert re.search(r"stages\.\d+\.num_workers: saved 2, now 1\)", str(caught.value)), str(caught.value)


def test_rsample_takes_states_but_refuses_to_resume_from_them(urls) -> None:
    """rsample keeps items by draws from the global random generator, as webdataset's does (same stream for
    the same global seed); no restore can replay them, so loading a state taken with it is refused rather
    than resuming a different stream (taking the state works, so plain training is never stopped)."""
    random.seed(3)
    ours = [s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False).rsample(0.3)]
    random.seed(3)
    theirs = [s["__key__"] for s in webdataset.WebDataset(urls, shardshuffle=False).rsample(0.3)]
    assert ours == theirs and ours

    dataset = wds.WebDataset(urls, shardshuffle=False).rsample(0.5)
    iterator = iter(dataset)
    next(iterator)
    state = dataset.state_dict()
    fresh = wds.WebDataset(urls, shardshuffle=False).rsample(0.5)
    fresh.load_state_dict(state)
    with pytest.raises(wds.StateMismatchError, match=r"cannot resume stage \d+ \(rsample\)"):
        next(iter(fresh))
