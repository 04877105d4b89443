"""The LLM dataset toolbox (issue 17, item 2): take, stride, enumerate, concat_datasets and cache, each
resumed at every step (0 workers) and at drawn kill points through 2 DataLoader workers."""

from __future__ import annotations

import builtins
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wdsraft as wds
from wdsraft.core.errors import StateMismatchError
from wdsraft.pipeline.slice import check_empty
from wdsraft.testing import assert_resumes_everywhere, identity, resume, states_along

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings

N = 40
KEYS = [f"{n:05d}" for n in range(N)]


@pytest.fixture(scope="module")
def urls(write_shards) -> list[str]:
    return write_shards("tb", [{"txt": str(n)} for n in range(N)], 7)


@pytest.fixture(scope="module")
def other_urls(write_shards) -> list[str]:
    return write_shards("tc", [{"txt": str(100 + n)} for n in range(12)], 5)


def _base(urls, shardshuffle=False):
    return wds.WebDataset(urls, shardshuffle=shardshuffle, seed=1)


def _loader(dataset, workers: int):
    # Workers snapshot their dataset's state every 2 steps (not 32): restores then load the stages' states
    # taken mid-stream in the workers, rather than re-run the workers from their start.
    return wds.WebLoader(dataset, batch_size=None, num_workers=workers, snapshot_every_n_steps=2)


def _keys(pipeline) -> list:
    """Each sample's key (other items' identities); the resume oracle compares contents too."""
    return [item["__key__"] if isinstance(item, dict) and "__key__" in item else identity(item) for item in pipeline]


#: kill-point checks through 2 workers: the states of one uninterrupted run, drawn from by hypothesis
_runs: dict[str, tuple[list, list]] = {}


def _check_kill_point(name: str, make, kill: int) -> None:
    if name not in _runs:
        _runs[name] = states_along(make)
    stream, states = _runs[name]
    k = min(kill, len(states) - 1)
    assert resume(make, states[k], seed=k) == stream[k:], f"{name}: resume before element {k}"


# -- take and stride --------------------------------------------------------------------------------------


def test_take_and_stride_give_epochrafts_items(urls) -> None:
    pulled = []

    def note(sample):
        pulled.append(sample["__key__"])
        return sample

    assert _keys(_base(urls).map(note).take(11)) == KEYS[:11]
    assert pulled == KEYS[:11]  # nothing more is read once n went out
    assert _keys(_base(urls).stride(3, 1)) == KEYS[1::3]
    assert _keys(_base(urls).stride(4)) == KEYS[::4]
    assert _keys(_base(urls).take(0)) == []
    with pytest.raises(ValueError, match="offset"):
        wds.stride(3, 3)
    with pytest.raises(ValueError, match="k must be"):
        wds.stride(0)


@pytest.mark.parametrize("stage", ["take", "stride"])
def test_take_and_stride_resume_at_every_step(urls, stage) -> None:
    def make():
        dataset = _base(urls, shardshuffle=4).shuffle(6, seed=2)
        return dataset.take(23) if stage == "take" else dataset.stride(3, 2)

    stream = assert_resumes_everywhere(make)
    assert len(stream) == (23 if stage == "take" else len(range(2, N, 3)))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kill=st.integers(0, 30), stage=st.sampled_from(["take", "stride"]))
def test_take_and_stride_resume_through_two_workers(urls, kill, stage) -> None:
    def make():
        dataset = _base(urls, shardshuffle=4).take(9) if stage == "take" else _base(urls, shardshuffle=4).stride(2, 1)
        return _loader(dataset, 2).shuffle(3, seed=5)

    _check_kill_point(f"loader-{stage}", make, kill)


# -- enumerate ------------------------------------------------------------------------------------------


def test_enumerate_numbers_each_pass_from_zero(urls) -> None:
    dataset = _base(urls).enumerate().to_tuple("__key__", "step")
    assert list(dataset) == list(zip(KEYS, range(N), strict=True))
    assert [s["n"] for s in _base(urls).take(3).enumerate("n")] == [0, 1, 2]
    assert list(dataset) == list(zip(KEYS, range(N), strict=True))  # the next pass starts again
    with pytest.raises(TypeError, match=r"samples must be dicts .* enumerate before to_tuple"):
        list(_base(urls).to_tuple("__key__").enumerate())


@pytest.mark.parametrize("after", ["shuffle", "batched", "none"])
def test_enumerate_resumes_at_every_step(urls, after) -> None:
    """A shuffle or a partial batch after enumerate holds numbered samples; re-read on restore, they get
    their numbers back (the numbers are part of the state)."""

    def make():
        dataset = _base(urls, shardshuffle=4).enumerate()
        if after == "shuffle":
            dataset = dataset.shuffle(8, seed=3)
        dataset = dataset.to_tuple("__key__", "step")
        return dataset.batched(3) if after == "batched" else dataset

    stream = assert_resumes_everywhere(make)
    flat = [pair for keys, steps in stream for pair in zip(keys, steps, strict=True)] if after == "batched" else stream
    assert sorted(step for _, step in flat) == list(range(N))


def test_enumerate_saves_the_numbers_of_what_is_held_after_it(urls) -> None:
    dataset = _base(urls).enumerate().shuffle(30, initial=30, seed=1)
    iterator = iter(dataset)
    out = {next(iterator)["step"] for _ in range(5)}
    state = next(s for s in dataset.state_dict()["stages"].values() if isinstance(s, dict) and "numbers" in s)
    assert sorted(state["numbers"]) == sorted(set(range(state["count"])) - out)  # those the shuffle holds
    assert 25 <= len(state["numbers"]) <= 30  # no more than the buffer (older numbers dropped)


def test_enumerate_remembers_a_bounded_number_of_samples(urls) -> None:
    stage = wds.enumerate()
    stage.keep = 8
    pipeline = _base(urls).compose(stage).shuffle(3, initial=3, seed=1)
    iterator = iter(pipeline)
    for _ in range(30):
        next(iterator)
    assert len(stage._numbers) <= 8 + 1  # (pruned to what the shuffle holds whenever it passes keep)
    assert pipeline.state_dict()  # and what is held still has its number


@pytest.mark.parametrize("after", ["shuffle", "parallel_map"])
def test_enumerate_pruning_keeps_the_number_of_the_sample_going_out(urls, after) -> None:
    """Pruning (more than ``keep`` numbers remembered) happens as a sample is numbered, before any stage
    after it holds that sample: its number must survive, or a state taken while it is held cannot give
    it back (a shuffle buffer or the items in flight, smaller than keep, hold it next)."""

    def make():
        stage = wds.enumerate()
        stage.keep = 8
        dataset = _base(urls).compose(stage)
        if after == "shuffle":
            dataset = dataset.shuffle(5, initial=5, seed=1)
        else:
            dataset = dataset.parallel_map(lambda sample: sample, max_workers=1, prefetch_factor=6)
        return dataset.to_tuple("__key__", "step")

    stream = assert_resumes_everywhere(make, kill_points=list(range(0, N + 1, 3)))
    assert sorted(step for _, step in stream) == list(range(N))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kill=st.integers(0, 45))
def test_enumerate_resumes_through_two_workers(urls, kill) -> None:
    def make():
        dataset = _base(urls, shardshuffle=4).enumerate().shuffle(5, seed=2).to_tuple("__key__", "step")
        return _loader(dataset, 2)

    _check_kill_point("loader-enumerate", make, kill)


# -- concat_datasets ------------------------------------------------------------------------------------


def test_concat_gives_each_dataset_in_turn(urls, other_urls) -> None:
    concat = wds.concat_datasets([_base(urls), _base(other_urls)])
    assert _keys(concat) == KEYS + [f"{n:05d}" for n in range(12)]
    assert [s["txt"] for s in wds.concat_datasets([_base(other_urls), _base(urls)])][:13] == [
        *(str(100 + n).encode() for n in range(12)),
        b"0",
    ]
    with pytest.raises(ValueError, match="at least one"):
        wds.concat_datasets([])


def test_concat_resumes_at_every_step(urls, other_urls) -> None:
    def make():
        parts = [_base(urls[:3], shardshuffle=3), _base(other_urls, shardshuffle=3), _base(urls[3:])]
        return wds.concat_datasets(parts).compose(wds.shuffle(6, seed=4))

    stream = assert_resumes_everywhere(make, same_shape=False)  # (the state names the dataset being read)
    assert len(stream) == N + 12


def test_concat_runs_every_dataset_at_its_epoch(urls, other_urls) -> None:
    """After a restore into the first dataset, the later ones still run the concatenation's epoch (their
    shard order is that epoch's), not their own counter's."""

    def make():
        return wds.concat_datasets([_base(urls[:2], shardshuffle=5), _base(other_urls, shardshuffle=5)]).repeat(3)

    assert_resumes_everywhere(make, kill_points=[3, 20, 30], same_shape=False)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kill=st.integers(0, 55))
def test_concat_resumes_through_two_workers(urls, other_urls, kill) -> None:
    def make():
        concat = wds.concat_datasets([_base(urls, shardshuffle=4), _base(other_urls, shardshuffle=4)])
        return _loader(concat, 2)

    _check_kill_point("loader-concat", make, kill)


# -- cache ----------------------------------------------------------------------------------------------


@pytest.fixture
def shard_opens(monkeypatch) -> list[str]:
    """The shards opened (files ending in .tar), by any reader."""
    opened: list[str] = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if str(file).endswith(".tar"):
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    return opened


@pytest.mark.parametrize("on_disk", [False, True])
def test_cache_second_epoch_reads_no_shard(urls, tmp_path, shard_opens, on_disk) -> None:
    dataset = _base(urls).cache(tmp_path if on_disk else None)
    first = _keys(dataset)
    assert len(shard_opens) >= len(urls)  # (the count sees the first pass's reads)
    del shard_opens[:]
    assert _keys(dataset) == first == KEYS
    assert shard_opens == []
    if on_disk:  # a new pipeline (a new process) reads the file, not the shards
        assert _keys(_base(urls).cache(tmp_path)) == KEYS
        assert shard_opens == []


def test_cached_samples_changed_downstream_stay_as_cached(urls) -> None:
    """A stage after the cache that sets a field in place changes neither the cache nor the next pass."""

    def shout(sample):
        sample["txt"] = sample["txt"] + b"!"
        return sample

    dataset = _base(urls[:1]).cache().map(shout).to_tuple("txt")
    first = list(dataset)
    assert first == [(f"{n}!".encode(),) for n in range(7)]
    assert list(dataset) == first == list(dataset)


@pytest.mark.parametrize("on_disk", [False, True])
def test_cache_resumes_at_every_step_in_both_phases(urls, tmp_path, on_disk) -> None:
    """A restore builds a fresh pipeline, whose in-memory cache is empty: it is rebuilt and checked."""
    directory = tmp_path / "cache" if on_disk else None

    def make():
        return _base(urls[:3]).cache(directory).shuffle(5, seed=1).repeat(3)

    stream = assert_resumes_everywhere(make, same_shape=False)  # (an unread source's state has no url)
    assert len(stream) == 3 * 21


def test_cache_repeats_the_first_pass_of_a_reshuffled_stream(urls, tmp_path) -> None:
    """Upstream reshuffles every epoch; the cache hands out the first pass's order again. On disk, resuming
    anywhere is exact; in memory, a restore that would have to rebuild from a different pass refuses."""

    def make(directory):
        return _base(urls[:3], shardshuffle=3).shuffle(4, seed=2).cache(directory).repeat(2)

    stream = assert_resumes_everywhere(lambda: make(tmp_path), same_shape=False)
    assert stream[:21] == stream[21:] and sorted(key for key, _content in stream[:21]) == KEYS[:21]
    _stream, states = states_along(lambda: make(None))
    with pytest.raises(StateMismatchError, match=r"stage \d+ \(cache\): the 21 items before it differ"):
        resume(lambda: make(None), states[30])


@pytest.mark.parametrize("upstream", ["concat", "loader"])
def test_cache_after_numbered_items_checks_a_rebuild_by_their_contents(urls, tmp_path, upstream) -> None:
    """After a concat or a WebLoader, items are addressed by their number in the pass, which says nothing
    of which sample it was: a rebuilt cache is checked against the items' contents. Upstream reshuffles
    every epoch: an in-memory cache lost mid-read refuses (it used to accept any 21 items and serve the
    next epoch's order); on disk, or with a stream that stays the same, every resume is exact."""

    def make(directory, shardshuffle):
        base = _base(urls[:3], shardshuffle=shardshuffle)
        base = base.shuffle(4, seed=2) if shardshuffle else base
        head = wds.concat_datasets([base]) if upstream == "concat" else _loader(base, 0)
        return wds.DataPipeline(head, wds.cache_samples(directory)).repeat(2)

    _stream, states = states_along(lambda: make(None, 3))
    with pytest.raises(StateMismatchError, match=r"stage \d+ \(cache\): the 21 items before it differ"):
        resume(lambda: make(None, 3), states[26])
    stream = assert_resumes_everywhere(lambda: make(tmp_path, 3), kill_points=[0, 5, 21, 26, 41], same_shape=False)
    assert stream[:21] == stream[21:]
    assert_resumes_everywhere(lambda: make(None, False), kill_points=[3, 21, 26], same_shape=False)


def test_cache_of_unpicklable_numbered_items_runs_but_refuses_an_unchecked_rebuild(urls) -> None:
    """Items without a shard position and without a pickle (a lock in a field) cannot be checked on a
    rebuild: the passes run, and only a restore that must rebuild refuses, saying why."""
    import threading

    def make():
        concat = wds.concat_datasets([_base(urls[:1]).map(lambda s: {**s, "lock": threading.Lock()})])
        return wds.DataPipeline(concat, wds.cache_samples()).repeat(2)

    stream, states = states_along(make)
    assert [key for key, _ in stream] == KEYS[:7] * 2
    with pytest.raises(StateMismatchError, match="could not be pickled, so a rebuild"):
        resume(make, states[9])


def test_in_memory_cache_lost_twice_in_one_pass_is_refused(urls) -> None:
    """A pass that rebuilt a lost in-memory cache has read upstream to its end: a state taken in it, loaded
    in yet another process, cannot rebuild again, and says so (rather than hand out nothing)."""

    def make():
        return _base(urls[:2]).cache().repeat(2)

    _stream, states = states_along(make)
    rebuilding = make()
    rebuilding.load_state_dict(states[17])  # (epoch 1, read phase: this new pipeline has no cache)
    iterator = iter(rebuilding)
    next(iterator)
    state = rebuilding.state_dict()
    again = make()
    again.load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"already read in this pass; give cache\(directory=\.\.\.\)"):
        next(iter(again))


def test_torn_cache_file_is_refused_and_rebuilt(urls, tmp_path) -> None:
    assert _keys(_base(urls).cache(tmp_path)) == KEYS
    (path,) = tmp_path.glob("cache-*.wdsc")
    path.write_bytes(path.read_bytes()[:-100])  # a write cut short
    with pytest.warns(UserWarning, match=f"ignoring {path}: its content does not match its checksum"):
        assert _keys(_base(urls).cache(tmp_path)) == KEYS
    assert _keys(_base(urls).cache(tmp_path)) == KEYS  # rebuilt whole: read without a warning
    path.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match=f"ignoring {path}: not a wdsraft cache file"):
        assert _keys(_base(urls).cache(tmp_path)) == KEYS


def test_cache_file_of_another_dataset_is_refused(urls, other_urls, tmp_path) -> None:
    assert len(_keys(_base(other_urls).cache(tmp_path))) == 12
    (theirs,) = tmp_path.glob("cache-*.wdsc")
    _keys(_base(urls).take(0).cache(tmp_path))  # (an empty pass of ours, to learn our file's name)
    ours = next(p for p in tmp_path.glob("cache-*.wdsc") if p != theirs)
    os.replace(theirs, ours)
    with pytest.warns(UserWarning, match="written by another dataset or configuration"):
        assert _keys(_base(urls).take(0).cache(tmp_path)) == []
    assert Path(ours).exists()


@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("upstream", ["shards", "concat"])
def test_cache_file_of_rewritten_shards_is_refused_and_rebuilt(tmp_path, indexed, upstream) -> None:
    """A file is named by the configuration, which names shards by URL: the shards re-converted under the
    same names (other contents, same sizes) must not be served from it. The file records the identities
    of the shards its items came from (the index's sha256, else the local file's size and mtime)."""

    def write(offset: int) -> list[str]:
        with wds.ShardWriter(str(tmp_path / "rw-%02d.tar"), maxcount=4, verbose=0) as sink:  # (indexes them)
            for n in range(8):
                sink.write({"__key__": f"{n:05d}", "txt": str(offset + n)})
        urls = sorted(str(p) for p in tmp_path.glob("rw-*.tar"))
        for url in [] if indexed else urls:
            os.remove(url + ".idx")
        return urls

    def texts(urls) -> list[bytes]:
        directory = tmp_path / "cache"
        if upstream == "concat":  # (the shards named by the items' __url__: their positions are numbers)
            pipeline = wds.DataPipeline(wds.concat_datasets([_base(urls)]), wds.cache_samples(directory))
            return [sample["txt"] for sample in pipeline]
        # (tuples, without __url__: the shards named by the items' positions)
        return [text for (text,) in _base(urls).to_tuple("txt").cache(directory)]

    urls = write(10)
    assert texts(urls) == [str(10 + n).encode() for n in range(8)]
    write(20)  # (the same sizes: only the index's sha256, or the mtime, tells them apart)
    with pytest.warns(UserWarning, match=rf"ignoring .*cache-.*: shard {urls[0]} changed since it was written"):
        assert texts(urls) == [str(20 + n).encode() for n in range(8)]
    assert texts(urls) == [str(20 + n).encode() for n in range(8)]  # (rebuilt: read without a warning)


def test_cache_file_of_items_naming_no_readable_shard_is_written_and_trusted_by_name(
    urls, tmp_path, caplog, shard_opens
) -> None:
    """Items whose ``__url__`` names no file (made up by a map) cannot have their shards checked: the
    file is written all the same, with a warning saying a later run trusts it by name, and read back."""

    def make():
        made_up = _base(urls[:1]).map(lambda sample: {**sample, "__url__": "made-up/shard.tar"})
        return wds.DataPipeline(wds.concat_datasets([made_up]), wds.cache_samples(tmp_path))

    with caplog.at_level("WARNING", logger="wdsraft.pipeline.caching"):
        assert _keys(make()) == KEYS[:7]
    assert "1 shards have no index and are no local file (first: made-up/shard.tar)" in caplog.text
    del shard_opens[:]
    assert _keys(make()) == KEYS[:7]
    assert shard_opens == []  # (a new pipeline read the file)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kill=st.integers(0, 60))
def test_cache_resumes_through_two_workers(urls, tmp_path_factory, kill) -> None:
    directory = tmp_path_factory.getbasetemp() / "loader-cache"

    def make():
        return _loader(_base(urls, shardshuffle=4).cache(directory).repeat(2), 2)

    _check_kill_point("loader-cache", make, kill)


# -- snapshots for held items only ---------------------------------------------------------------------


def _count_calls(obj, name: str) -> list[str]:
    """Count the calls of ``obj.name`` (an instance attribute shadowing the method)."""
    calls: list[str] = []
    real = getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


AFTER = {
    "take": lambda d: d.take(10**9),
    "stride": lambda d: d.stride(1),
    "enumerate": lambda d: d.enumerate(),
    "cache": lambda d: d.cache(),
    "check_empty": lambda d: d.compose(check_empty()),
    "shuffle": lambda d: d.shuffle(3, seed=1),  # (holds items: the control)
}


@pytest.mark.parametrize("after", list(AFTER))
def test_sources_keep_snapshots_only_for_stages_that_hold_items(urls, after) -> None:
    """A WebLoader, a concatenation (any nested dataset) and enumerate keep what re-reading held items
    needs (a state of the loader or dataset per batch, numbers) only where a stage after them can hold
    items: take, stride, enumerate, cache and check_empty hold none."""
    loader = wds.WebLoader(_base(urls), batch_size=None, num_workers=0)
    loader_states = _count_calls(loader.pipeline[0].loader, "state_dict")
    inner = _base(urls)
    dataset_states = _count_calls(inner, "state_dict")
    concat = wds.FluidWrapper(wds.concat_datasets([inner]))
    for pipeline in (AFTER[after](loader), AFTER[after](concat)):
        assert len(list(pipeline)) == N
    holds = after == "shuffle"
    assert (len(loader_states) >= N, len(dataset_states) >= N // 16) == (holds, holds)

    stage = wds.enumerate()
    numbered = AFTER[after](_base(urls).compose(stage))
    assert len(list(numbered)) == N
    assert bool(stage._numbers) == holds  # (numbers remembered only for a stage that holds samples)


# -- them all, as docs/stages.md chains them ------------------------------------------------------------


def tokenize_sample(sample):  # (stand-ins for a tokenizer and a length filter)
    return {**sample, "input_ids": [int(sample["txt"])] * 3}


def drop_too_short(sample):
    return None if int(sample["txt"]) % 5 == 0 else sample


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kill=st.integers(0, 40))
def test_the_documented_llm_chain_resumes_through_two_workers(urls, other_urls, tmp_path_factory, kill) -> None:
    directory = tmp_path_factory.getbasetemp() / "docs-chain-cache"

    def make():
        instructions = wds.WebDataset(other_urls, shardshuffle=False, seed=0).cache(directory)
        web = wds.WebDataset(urls, shardshuffle=4, seed=0)
        train = (
            wds.FluidWrapper(wds.concat_datasets([instructions, web]))
            .shuffle(6, seed=1)
            .decode()
            .parallel_map(tokenize_sample, max_workers=2)
            .parallel_filter_map(drop_too_short, max_workers=2)
            .enumerate()
            .take(20)
            .to_tuple("__key__", "step", "input_ids")
        )
        return _loader(train, 2)

    _check_kill_point("docs-chain", make, kill)
    stream, _ = _runs["docs-chain"]
    assert sorted(step for _, step, _ in stream) == sorted([*range(20), *range(20)])  # numbered per worker
