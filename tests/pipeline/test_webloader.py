"""WebLoader on StatefulDataLoader: exact resume with 0..3 workers, stages in the training process,
and webdataset's own README examples running unchanged with ``import wdsraft as wds``."""

from __future__ import annotations

import contextlib
import gc
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wdsraft as wds
from wdsraft.testing import identity, resume, roundtrip, states_along

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings


@pytest.fixture(scope="module")
def urls(write_shards, corpus_records) -> list[str]:
    return write_shards("l", [{"txt": r["text"][:100], "cls": n % 7} for n, r in enumerate(corpus_records[:88])], 11)


def _loader(urls, workers: int, main_shuffle: int = 9, persistent: bool = False):
    dataset = (
        wds.WebDataset(urls, shardshuffle=8, seed=3).shuffle(5, seed=4).decode().to_tuple("__key__", "cls").batched(3)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=persistent and workers > 0)
    return loader.unbatched().shuffle(main_shuffle, seed=5).batched(4)


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_loader_resumes_exactly(urls, workers: int) -> None:
    def make():
        return _loader(urls, workers)

    stream, states = states_along(make)
    assert sorted(k for batch in stream for k in batch[0]) == [f"{n:05d}" for n in range(88)]
    for k in range(len(states)):  # the restore-at-every-step oracle, through worker processes
        assert resume(make, states[k], ("msgpack", "torch")[k % 2], seed=k) == stream[k:], f"kill before batch {k}"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workers=st.integers(0, 3), kill=st.integers(0, 22), main_shuffle=st.sampled_from([1, 4, 30]))
def test_property_loader_kill_points(urls, workers, kill, main_shuffle) -> None:
    def make():
        return _loader(urls, workers, main_shuffle)

    _stream, states = states_along(make, limit=kill + 1)
    full = [identity(b) for b in make()]
    assert resume(make, states[min(kill, len(states) - 1)]) == full[min(kill, len(states) - 1) :]


@pytest.mark.parametrize("persistent", [False, True])
def test_each_loader_epoch_reshuffles_in_the_workers(urls, persistent: bool) -> None:
    """webdataset's workers start every epoch from the same copy (same order); here epochs differ."""
    dataset = wds.WebDataset(urls, shardshuffle=8, seed=3).shuffle(5, seed=4).to_tuple("__key__").batched(3)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=2, persistent_workers=persistent)
    epochs = [[k for batch in loader for k in batch[0]] for _ in range(3)]
    assert all(sorted(e) == [f"{n:05d}" for n in range(88)] for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = wds.WebLoader(dataset, batch_size=None, num_workers=2, persistent_workers=persistent)
    assert [k for batch in again for k in batch[0]] == epochs[0]  # and epoch 0 is reproducible


def test_loader_state_survives_torch_save(urls) -> None:
    loader = _loader(urls, 2)
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    state = roundtrip(loader.state_dict(), "torch")
    fresh = _loader(urls, 2)
    fresh.load_state_dict(state)
    assert [identity(b) for b in fresh] == [identity(b) for b in iterator]


def test_changed_worker_count_fails_loudly(urls) -> None:
    loader = _loader(urls, 2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    other = _loader(urls, 3)
    with pytest.raises(wds.StateMismatchError, match="num_workers"):
        other.load_state_dict(state)
        list(other)


# -- webdataset's README examples, unchanged but for the import -----------------------------------


def test_readme_webdataset_example(urls, corpus_records) -> None:
    dataset = wds.WebDataset(urls, shardshuffle=100).shuffle(1000).decode().to_tuple("txt", "cls").batched(16)
    batches = list(dataset)
    assert [len(b[0]) for b in batches] == [16] * 5 + [8]
    # webdataset's collation: the texts as a list, the class numbers as an int64 numpy array
    assert all(isinstance(b[0], list) and isinstance(b[1], np.ndarray) and b[1].dtype == np.int64 for b in batches)
    pairs = Counter((text, int(cls)) for b in batches for text, cls in zip(b[0], b[1], strict=True))
    written = Counter((r["text"][:100], n % 7) for n, r in enumerate(corpus_records[:88]))
    assert pairs == written  # every sample once, each text with its own class


def test_readme_datapipeline_example(urls) -> None:
    dataset = wds.DataPipeline(
        wds.ResampledShards(urls),
        wds.tarfile_to_samples(),
        wds.shuffle(100),
        wds.decode(),
        wds.to_tuple("txt", "cls"),
        wds.batched(16),
    )
    iterator = iter(dataset)
    first = [next(iterator) for _ in range(3)]
    assert all(len(b[0]) == 16 for b in first)


def test_readme_webloader_example(urls) -> None:
    dataset = (
        wds.WebDataset(urls, resampled=True, shardshuffle=False, nodesplitter=wds.split_by_node)
        .shuffle(100)
        .decode()
        .to_tuple("txt", "cls")
        .batched(8)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=2)
    loader = loader.unbatched().shuffle(50).batched(12).with_epoch(5)
    batches = list(loader)
    assert len(batches) == 5 and all(len(b[0]) == 12 for b in batches)
    state = loader.state_dict()
    assert state["format"] == "wdsraft-pipeline-state"


def test_split_by_node_with_ranks(urls, monkeypatch) -> None:
    seen = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        dataset = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node).to_tuple("__key__")
        seen.append({x[0] for x in dataset})
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 88


def test_slurm_variables_give_the_rank(urls, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert tuple(wds.distributed.worker_info())[:2] == (1, 4)


@pytest.mark.parametrize("workers", [0, 2])
def test_seeds_drawn_by_the_dataset_travel_through_the_loader(urls, workers) -> None:
    """No seeds anywhere: a state taken before the first batch, or later, restores the same draws."""

    def make():
        dataset = wds.WebDataset(urls).shuffle(6).to_tuple("__key__").batched(3)
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers)

    loader = make()
    before = loader.state_dict()
    stream = [identity(b) for b in loader]
    assert resume(make, before) == stream
    # Another loader draws other seeds: restoring its state mid-epoch gives its stream, item for item.
    other, states = states_along(make)
    assert other != stream  # (so the comparison below tells the two runs' draws apart)
    assert resume(make, states[4]) == other[4:]


@pytest.mark.parametrize("workers", [1, 3])
def test_loader_state_right_after_resume(urls, workers) -> None:
    def make():
        return _loader(urls, workers)

    stream, states = states_along(make)
    loader = make()
    loader.load_state_dict(states[5])
    iterator = iter(loader)
    first = identity(next(iterator))
    again = loader.state_dict()
    assert [first, *resume(make, again)] == stream[5:]


def test_resume_between_worker_snapshots(urls) -> None:
    """Workers send their state every ``snapshot_every_n_steps`` batches (32 by default with 2
    workers): a state taken between two snapshots restores by re-running the batches since the last
    one."""

    def make(every: int | None = None):
        dataset = wds.WebDataset(urls, shardshuffle=8, seed=3).shuffle(5, seed=4).to_tuple("__key__").batched(1)
        kw = {} if every is None else {"snapshot_every_n_steps": every}
        return wds.WebLoader(dataset, batch_size=None, num_workers=2, **kw)

    assert make().loader.snapshot_every_n_steps == 32 and make(1).loader.snapshot_every_n_steps == 1
    stream, states = states_along(make)
    assert len(stream) == 88
    for k in (0, 1, 31, 32, 33, 47, 63, 64, 65, 87, 88):
        assert resume(make, states[k], seed=k) == stream[k:], k
    _stream, states = states_along(lambda: make(5), limit=20)
    assert resume(lambda: make(5), states[12]) == stream[12:]


@pytest.mark.parametrize(("workers", "prefetch"), [(1, 2), (2, 8), (2, 64), (3, 64)])
def test_workers_send_their_state_with_few_batches(urls, monkeypatch, workers, prefetch) -> None:
    """A worker ships its state only with its last batch before a snapshot step (``workers``
    of the ``16 * workers`` steps of the default interval), whatever the ``prefetch_factor``.
    torchdata asks with every batch requested within ``workers * (prefetch_factor + 1) + 1`` steps
    before a snapshot step: with a prefetch of 64, every batch for any interval under 131 steps."""
    calls = multiprocessing.get_context("fork").Value("i", 0)
    original = wds.pipeline.DataPipeline.state_dict

    def counted(self):
        with calls.get_lock():
            calls.value += 1
        return original(self)

    monkeypatch.setattr(wds.pipeline.DataPipeline, "state_dict", counted)  # (forked workers inherit it)
    # 88 samples, 12 passes (an epoch each): about a thousand batches crossing from the workers.
    dataset = wds.WebDataset(urls, shardshuffle=8, seed=3).to_tuple("__key__").batched(1).repeat(12)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers, prefetch_factor=prefetch)
    assert loader.loader.snapshot_every_n_steps == max(32, 16 * workers)
    batches = sum(1 for _ in loader)
    assert batches == 1056
    # (plus the first batch's state for each worker at start and each worker's state at its end)
    assert calls.value <= batches * workers / max(32, 16 * workers) + 3 * workers


def test_deep_restore_re_runs_a_bounded_number_of_batches(urls) -> None:
    """With the default settings and a deep prefetch, a state taken at any step restores by re-running
    fewer than ``16 * workers`` batches, however deep into the epoch (the old default, 1,048 steps
    with 2 workers and a prefetch of 64, re-ran up to 1,047), and exactly."""

    def make():
        dataset = wds.WebDataset(urls, shardshuffle=8, seed=3).shuffle(5, seed=4).to_tuple("__key__").batched(1)
        return wds.WebLoader(dataset.repeat(4), batch_size=None, num_workers=2, prefetch_factor=64)

    stream, states = states_along(make)
    assert len(stream) == 352
    # (the state before the first batch holds no loader state)
    re_runs = [state["stages"]["0"]["loader"]["_steps_since_snapshot"] for state in states[1:]]
    assert max(re_runs) < 32 and re_runs[299] == 300 % 32
    for k in (95, 300, 351):
        assert resume(make, states[k], seed=k) == stream[k:], k


def test_snapshot_skipped_when_a_worker_ends_early(write_shards, corpus_records) -> None:
    """A worker that runs out of data early (12 samples against 100) shifts the steps at which the
    batches already requested from the other one are handed out, so the batches that ship a state
    are not all the last ones before a snapshot step: such a snapshot is skipped rather than taken
    with a worker's older state. States taken at every step around it resume exactly."""
    samples = [{"txt": r["text"][:20]} for r in corpus_records[:112]]
    urls = [*write_shards("short", samples[:12], 12), *write_shards("long", samples[12:], 100)]

    def make():
        dataset = wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__").batched(1)
        return wds.WebLoader(dataset, batch_size=None, num_workers=2, prefetch_factor=16)

    stream, states = states_along(make)
    assert len(stream) == 112
    re_runs = [state["stages"]["0"]["loader"]["_steps_since_snapshot"] for state in states[1:]]
    assert max(re_runs) >= 32  # (a snapshot was skipped)
    for k in range(28, 72, 3):
        assert resume(make, states[k], seed=k) == stream[k:], k


def test_dropped_iterator_stops_its_workers_at_once(urls) -> None:
    """An iterator dropped mid-epoch is freed at once (nothing of wdsraft's holds it in a reference
    cycle), which shuts its workers down, without waiting for a garbage collection that may run in
    a forked worker instead."""
    loader = wds.WebLoader(wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__"), batch_size=None, num_workers=2)
    inner = loader.loader
    gc.disable()
    try:
        iterator = iter(inner)
        next(iterator)
        workers = list(iterator._workers)
        del iterator
        inner._iterator = None
        assert not any(worker.is_alive() for worker in workers)
    finally:
        gc.enable()


@pytest.mark.parametrize("main_stages", [False, True])
def test_persistent_workers_resume_into_the_following_epochs(urls, main_stages) -> None:
    """States taken mid-epoch and between epochs resume the uninterrupted run's later epochs too,
    with workers that live across epochs; also when loaded into the loader that saved them."""

    def make():
        dataset = wds.WebDataset(urls, shardshuffle=8, seed=3).shuffle(5, seed=4).to_tuple("__key__").batched(3)
        loader = wds.WebLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
        return loader.unbatched().shuffle(7, seed=5).batched(4) if main_stages else loader

    loader = make()
    epochs, between, middle = [], [], None
    for epoch in range(3):
        keys = []
        for batch in loader:
            keys.append(identity(batch))
            if epoch == 1 and len(keys) == 5:
                middle = loader.state_dict()
        epochs.append(keys)
        between.append(loader.state_dict())
    assert epochs[0] != epochs[1] != epochs[2]
    fresh = make()
    fresh.load_state_dict(roundtrip(between[0], "torch"))
    assert [[identity(b) for b in fresh] for _ in range(2)] == epochs[1:]
    fresh = make()
    fresh.load_state_dict(roundtrip(middle, "msgpack"))
    assert [[identity(b) for b in fresh] for _ in range(2)] == [epochs[1][5:], epochs[2]]
    loader.load_state_dict(between[0])  # the same loader, its workers still alive
    assert [[identity(b) for b in loader] for _ in range(2)] == epochs[1:]


@pytest.mark.parametrize("persistent", [False, True])
def test_state_after_an_epochs_last_batch_resumes_the_next_epoch(urls, persistent) -> None:
    """The usual loop saves inside the loop: after the last batch of an epoch, before the loader ends.
    Also a training-process ``with_epoch`` whose epochs span loader epochs, killed at every batch."""

    def make(epoch: int | None = None):
        dataset = wds.WebDataset(urls, shardshuffle=8, seed=3).shuffle(5, seed=4).to_tuple("__key__").batched(3)
        loader = wds.WebLoader(dataset, batch_size=None, num_workers=2, persistent_workers=persistent)
        staged = loader.unbatched().shuffle(7, seed=5).batched(4)
        return staged.with_epoch(epoch) if epoch else staged

    loader = make()
    epochs, last = [], None
    for _ in range(2):
        epochs.append([])
        for batch in loader:
            epochs[-1].append(identity(batch))
            if len(epochs) == 1:
                last = loader.state_dict()
    fresh = make()
    fresh.load_state_dict(roundtrip(last, "torch"))
    assert [identity(b) for b in fresh] == [] and [identity(b) for b in fresh] == epochs[1]
    per_epoch = len(epochs[0])
    stream, states = states_along(lambda: make(per_epoch + per_epoch // 2))
    for k in (0, per_epoch - 1, per_epoch, per_epoch + 1, len(stream) - 1):
        assert resume(lambda: make(per_epoch + per_epoch // 2), states[k], seed=k) == stream[k:], k


_RANK_WITH_WORKERS = """
import os, sys, time
import wdsraft as wds

def padded(sample):  # batches of about 1 MB: a few of them fill a worker's result pipe
    return {**sample, "padding": b"x" * (1 << 19)}

urls = sys.argv[1:]
dataset = wds.WebDataset(urls, shardshuffle=False).map(padded).batched(2)
loader = wds.WebLoader(dataset, batch_size=None, num_workers=2, prefetch_factor=8)
iterator = iter(loader)
next(iterator)
print("ready", flush=True)
time.sleep(600)  # the prefetch queue and the pipes fill while the rank sits here, until it is killed
"""


def _children(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent:
                found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"  # (a zombie waiting for init counts as gone)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_rank_killed_by_sigkill(urls) -> None:
    rank = subprocess.Popen([sys.executable, "-c", _RANK_WITH_WORKERS, *urls], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        workers = _children(rank.pid)
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)
        time.sleep(1)  # (workers fill the queue: they block writing their result pipe)
        rank.kill()
        rank.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers), "a DataLoader worker outlived its SIGKILLed rank"
    finally:
        rank.kill()
        for pid in locals().get("workers", []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_training_process_buffer_restores_from_a_few_batches_back_whatever_the_depth(tmp_path) -> None:
    """``.unbatched().shuffle(b)`` after a WebLoader saves the loader's state from just before the oldest
    batch its buffer still holds items of, and re-fetches from there: the batches to re-run follow the
    buffer (the oldest of ``b`` items is typically ``b ln b`` picks old; measured here: about 30 batches
    of 4 for ``b = 32``, at most 84), not the depth (500 batches at the end)."""
    with wds.ShardWriter(str(tmp_path / "s-%02d.tar"), maxcount=500, verbose=0) as sink:
        for number in range(2000):
            sink.write({"__key__": f"{number:05d}", "txt": str(number)})
    urls = sorted(str(p) for p in tmp_path.glob("s-*.tar"))
    buffer, inner = 32, 4
    dataset = wds.WebDataset(urls, shardshuffle=False).batched(inner)
    loader = wds.WebLoader(dataset, batch_size=None).unbatched().shuffle(buffer, seed=1).batched(8)
    replays = []
    for _ in loader:
        replays.append(loader.state_dict()["stages"]["0"]["replay"])
    assert len(replays) == 250  # 500 inner batches deep at the end
    bound = 4 * int(buffer * math.log(buffer)) // inner  # (111 batches: four times the typical oldest)
    assert max(replays) <= bound, (max(replays), bound)
    assert sorted(replays)[len(replays) // 2] >= 1  # (the buffer holds items: something to re-run)


def test_persistent_workers_started_from_a_thread_that_ended_live_on(urls) -> None:
    """The workers watch their parent process, not the thread that started them (PR_SET_PDEATHSIG would
    have killed them when the thread that ran the first epoch ended)."""
    import threading

    loader = wds.WebLoader(
        wds.WebDataset(urls, shardshuffle=False).batched(4), batch_size=None, num_workers=2, persistent_workers=True
    )
    first: list[int] = []
    thread = threading.Thread(target=lambda: first.append(sum(1 for _ in loader)))
    thread.start()
    thread.join()
    time.sleep(1.5)  # (three looks at the parent)
    assert first == [sum(1 for _ in loader)] and first[0] > 0
