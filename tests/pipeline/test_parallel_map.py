"""parallel_map and parallel_filter_map (issue 17, item 2): threads and processes, input order kept,
items in flight saved as positions (not payloads), exact resume with 0 and 2 DataLoader workers, and a
failing function names the sample."""

from __future__ import annotations

import random
import time

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import wdsraft as wds
from wdsraft.testing import assert_resumes_everywhere, resume, states_along

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings

N = 30
KEYS = [f"{n:05d}" for n in range(N)]


@pytest.fixture(scope="module")
def urls(write_shards) -> list[str]:
    return write_shards("pm", [{"txt": str(n)} for n in range(N)], 8)


def _base(urls, shardshuffle=False):
    return wds.WebDataset(urls, shardshuffle=shardshuffle, seed=1).decode()


# (module-level functions: the process pool pickles them)
def square(sample):
    return {**sample, "sq": int(sample["txt"]) ** 2}


def slow_square(sample):
    time.sleep(random.random() * 0.004)  # finish out of order
    return square(sample)


def odd_only(sample):
    return square(sample) if int(sample["txt"]) % 2 else None


def huge(sample):
    return {**sample, "blob": b"x" * 200_000}


def fails_on_seven(sample):
    if sample["txt"] == "7":
        raise ValueError("bad sample")
    return sample


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_results_come_in_input_order(urls, executor) -> None:
    mapped = _base(urls).parallel_map(slow_square, max_workers=4, prefetch_factor=2, executor=executor)
    assert [(s["__key__"], s["sq"]) for s in mapped] == [(k, n * n) for n, k in enumerate(KEYS)]
    filtered = _base(urls).parallel_filter_map(odd_only, max_workers=3, executor=executor)
    assert [s["sq"] for s in filtered] == [n * n for n in range(1, N, 2)]


def test_map_keeps_none_and_filter_map_drops_it(urls) -> None:
    assert list(_base(urls).parallel_map(lambda s: None, max_workers=2)) == [None] * N
    assert list(_base(urls).parallel_filter_map(lambda s: None, max_workers=2)) == []


@pytest.mark.parametrize("stage", [wds.parallel_map, wds.parallel_filter_map])
def test_resumes_at_every_step_on_threads(urls, stage) -> None:
    def make():
        pipeline = _base(urls, shardshuffle=3).shuffle(4, seed=2)
        fn = square if stage is wds.parallel_map else odd_only
        return (
            pipeline.compose(stage(fn, max_workers=3, prefetch_factor=2)).shuffle(3, seed=5).to_tuple("__key__", "sq")
        )

    stream = assert_resumes_everywhere(make)
    assert len(stream) == (N if stage is wds.parallel_map else N // 2)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kill=st.integers(0, N))
def test_resumes_on_processes(urls, kill) -> None:
    def make():
        mapped = _base(urls).parallel_map(square, max_workers=2, prefetch_factor=3, executor="process")
        return mapped.to_tuple("__key__", "sq")

    if "process" not in _runs:
        _runs["process"] = states_along(make)
    stream, states = _runs["process"]
    k = min(kill, len(states) - 1)
    assert resume(make, states[k], seed=k) == stream[k:]


_runs: dict[str, tuple[list, list]] = {}


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kill=st.integers(0, N), where=st.sampled_from(["threads in the workers", "processes after the loader"]))
@example(kill=7, where="threads in the workers")
@example(kill=12, where="processes after the loader")
def test_resumes_through_two_workers(urls, kill, where) -> None:
    def make():
        # (workers snapshot every 2 steps: restores load the workers' stage states taken mid-stream)
        if where == "threads in the workers":
            dataset = _base(urls, shardshuffle=3).parallel_filter_map(odd_only, max_workers=2, prefetch_factor=2)
            return wds.WebLoader(
                dataset.to_tuple("__key__", "sq"), batch_size=None, num_workers=2, snapshot_every_n_steps=2
            )
        loader = wds.WebLoader(_base(urls, shardshuffle=3), batch_size=None, num_workers=2, snapshot_every_n_steps=2)
        return loader.parallel_map(square, max_workers=2, prefetch_factor=2, executor="process").to_tuple(
            "__key__", "sq"
        )

    if where not in _runs:
        _runs[where] = states_along(make)
    stream, states = _runs[where]
    k = min(kill, len(states) - 1)
    assert resume(make, states[k], seed=k) == stream[k:], f"{where}: resume before element {k}"


def test_state_holds_positions_not_payloads(urls) -> None:
    """The items in flight are saved as addresses: the state is as big with 200 KB results as with none."""

    def state_size(fn) -> int:
        pipeline = _base(urls).parallel_map(fn, max_workers=2, prefetch_factor=5)
        iterator = iter(pipeline)
        next(iterator)
        state = pipeline.state_dict()
        in_flight = next(s for s in state["stages"].values() if isinstance(s, dict) and "in_flight" in s)
        assert len(in_flight["in_flight"]["columns"][0]) == 9  # (10 in flight, one went out)
        return len(msgpack.packb(in_flight))

    assert state_size(huge) == state_size(square) < 300


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_failing_function_names_the_sample(urls, executor) -> None:
    mapped = _base(urls).parallel_map(fails_on_seven, max_workers=2, executor=executor)
    with pytest.raises(ValueError, match="bad sample") as raised:
        list(mapped)
    note = "\n".join([str(raised.value), *getattr(raised.value, "__notes__", [])])  # (notes from Python 3.11)
    assert "'00007'" in note and urls[0] in note and "(parallel_map)" in note


def test_processes_inside_a_dataloader_worker_are_refused_clearly(urls) -> None:
    dataset = _base(urls).parallel_map(square, max_workers=2, executor="process")
    with pytest.raises(Exception, match="cannot start processes inside a DataLoader worker"):
        list(wds.WebLoader(dataset, batch_size=None, num_workers=1))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="executor must be one of"):
        wds.parallel_map(square, executor="gpu")
    with pytest.raises(ValueError, match="max_workers"):
        wds.parallel_map(square, max_workers=0)


def test_items_without_a_position_make_the_state_refused_by_name(urls) -> None:
    """Batches made inside the pipeline have no position in the shards: in flight, they cannot be saved."""
    mapped = _base(urls).to_tuple("__key__").batched(2).parallel_map(len, max_workers=2)
    iterator = iter(mapped)
    next(iterator)
    with pytest.raises(wds.StateMismatchError, match=r"cannot save stage \d+ \(parallel_map\): items in flight"):
        mapped.state_dict()
