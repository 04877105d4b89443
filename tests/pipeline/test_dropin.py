"""Drop-in details real training code relies on (issue 14): webdataset's uncurried filter functions
(``wds.filters._shuffle``...), ``DataPipeline.iterator()``, and ``detshuffle``'s moving ``.epoch``/``.seed``."""

from __future__ import annotations

import inspect
import random
import types

import pytest
import webdataset
import webdataset.filters

import wdsraft as wds
import wdsraft.filters
from wdsraft.testing import assert_resumes_everywhere, identity, resume, states_along

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings

SHARDS = 4
PER_SHARD = 11

#: webdataset's uncurried functions whose curried forms are wdsraft's stateful stages: run by those stages.
STATEFUL = ("_shuffle", "_batched", "_unbatched", "_unlisted", "_rsample")
PRIVATE = sorted(
    name
    for name, value in vars(webdataset.filters).items()
    if name.startswith("_") and not name.startswith("__") and isinstance(value, types.FunctionType)
)


@pytest.fixture(scope="module")
def urls(write_shards, corpus_records) -> list[str]:
    records = corpus_records[: SHARDS * PER_SHARD]
    return write_shards("d", [{"txt": r["text"][:100], "json": {"id": r["id"]}} for r in records], PER_SHARD)


# -- webdataset's uncurried filter functions ---------------------------------------------------------------


def test_every_uncurried_filter_of_webdataset_is_there() -> None:
    assert set(STATEFUL) < set(PRIVATE) and {"_map", "_to_tuple", "_xdecode", "_rename_keys"} < set(PRIVATE)
    for name in PRIVATE:
        ours, theirs = getattr(wdsraft.filters, name), getattr(webdataset.filters, name)
        assert name in wdsraft.filters.__all__
        assert wds.filters is wdsraft.filters and getattr(wds.filters, name) is ours
        if name in STATEFUL:
            assert ours is not theirs and ours.__module__.startswith("wdsraft.pipeline."), name
            assert inspect.isgeneratorfunction(ours), name
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name
            defaults = [p.default for p in inspect.signature(ours).parameters.values()]
            assert defaults == [p.default for p in inspect.signature(theirs).parameters.values()], name
        else:
            assert ours is theirs, name  # stateless: webdataset's own


def _both(name: str, data: list, *args, **kwargs) -> tuple[list, list]:
    ours = list(getattr(wdsraft.filters, name)(iter(data), *args, **kwargs))
    theirs = list(getattr(webdataset.filters, name)(iter(data), *args, **kwargs))
    return ours, theirs


@pytest.mark.parametrize("bufsize, initial", [(1000, 100), (10, 3), (7, 50), (1, 1), (200, 0)])
def test_uncurried_shuffle_gives_webdataset_stream(bufsize, initial) -> None:
    data = list(range(157))
    for seed in (0, 1, 12345):
        ours, theirs = _both("_shuffle", data, bufsize, initial, seed=seed)
        assert ours == theirs and sorted(ours) == data
        # with an rng: the same stream, and the same draws taken from it
        rng_ours, rng_theirs = random.Random(seed), random.Random(seed)
        ours = list(wdsraft.filters._shuffle(iter(data), bufsize=bufsize, initial=initial, rng=rng_ours))
        theirs = list(webdataset.filters._shuffle(iter(data), bufsize=bufsize, initial=initial, rng=rng_theirs))
        assert ours == theirs and rng_ours.getstate() == rng_theirs.getstate()
    assert list(wdsraft.filters._shuffle(iter(data))) != data  # unseeded: shuffled all the same


@pytest.mark.parametrize("batchsize", [1, 3, 10, 50])
@pytest.mark.parametrize("partial", [True, False])
def test_uncurried_batching_gives_webdataset_stream(batchsize, partial) -> None:
    samples = [(i, f"t{i}", float(i) / 2) for i in range(23)]
    ours, theirs = _both("_batched", samples, batchsize, partial=partial)
    assert [identity(b) for b in ours] == [identity(b) for b in theirs]
    assert len(ours) == (-(-23 // batchsize) if partial else 23 // batchsize)
    unbatched = _both("_unbatched", ours)
    assert unbatched[0] == unbatched[1] == samples[: len(unbatched[0])]
    lists, lists_theirs = _both("_batched", samples, batchsize, collation_fn=None, partial=partial)
    assert lists == lists_theirs
    assert _both("_unlisted", lists) == _both("_unlisted", lists_theirs)
    dicts = [{"a": i, "b": [i, i]} for i in range(9)]
    dict_batches = list(webdataset.filters._batched(iter(dicts), 4))
    ours, theirs = _both("_unbatched", dict_batches)
    assert [identity(s) for s in ours] == [identity(s) for s in theirs]


def test_uncurried_rsample_draws_as_webdataset() -> None:
    data = list(range(300))
    for p in (0.0, 0.3, 1.0):
        random.seed(11)
        ours = list(wdsraft.filters._rsample(iter(data), p))
        after = random.random()
        random.seed(11)
        theirs = list(webdataset.filters._rsample(iter(data), p))
        assert ours == theirs and after == random.random()
    with pytest.raises(AssertionError):
        list(wdsraft.filters._rsample(iter(data), 1.5))


# -- DataPipeline.iterator() --------------------------------------------------------------------------------


def _pipeline(lib, urls):
    return lib.DataPipeline(
        lib.SimpleShardList(urls),
        lib.tarfile_to_samples(),
        # (wdsraft reshuffles each epoch unless told not to; webdataset repeats a seeded shuffle's order)
        lib.shuffle(7, seed=2, **({"reshuffle_each_epoch": False} if lib is wds else {})),
        lib.to_tuple("__key__"),
    )


@pytest.mark.parametrize("how", ["once", "repeat", "with_epoch"])
def test_iterator_is_the_stream_of_iter(urls, how) -> None:
    def make(lib):
        pipeline = _pipeline(lib, urls)
        if how == "repeat":
            pipeline.repeat(3)
        elif how == "with_epoch":
            pipeline.with_epoch(30)
        return pipeline

    ours = [identity(x) for x in make(wds).iterator()]
    assert ours == [identity(x) for x in make(wds)] == [identity(x) for x in make(webdataset)]
    if how != "with_epoch":  # (webdataset's iterator() leaves the with_epoch window to __iter__)
        assert ours == [identity(x) for x in make(webdataset).iterator()]
    assert len(ours) == {"once": SHARDS * PER_SHARD, "repeat": 3 * SHARDS * PER_SHARD, "with_epoch": 30}[how]


def test_a_subclass_iterating_through_iterator_resumes(urls) -> None:
    class Keys(wds.DataPipeline):
        def __iter__(self):
            for key, *_ in self.iterator():
                yield key.upper()

    def make():
        return Keys(*_pipeline(wds, urls).pipeline).repeat(2)

    stream = list(make())
    assert stream == [key.upper() for (key,) in _pipeline(webdataset, urls).repeat(2)]
    pipeline = make()
    iterator = iter(pipeline)
    head = [next(iterator) for _ in range(50)]
    state = pipeline.state_dict()
    assert head + resume(make, state) == stream


def test_iter_goes_through_an_overridden_iterator(urls) -> None:
    class Twice(wds.DataPipeline):
        def iterator(self):
            for item in super().iterator():
                yield item
                yield item

    keys = [identity(x) for x in Twice(*_pipeline(wds, urls).pipeline)]
    assert keys == [item for item in _pipeline(webdataset, urls) for item in (item, item)]


# -- detshuffle's .epoch and .seed --------------------------------------------------------------------------


def _with_epochs(lib, stage, data, passes: int):
    """(item, stage.epoch, stage.seed) as the items come out of each pass, and (epoch, seed) after it."""
    pipeline = lib.DataPipeline([data], stage, lib.map(lambda x: (x, stage.epoch, stage.seed)))
    seen = [(stage.epoch, stage.seed)]
    for _ in range(passes):
        seen.append(list(pipeline))
        seen.append((stage.epoch, stage.seed))
    return seen


@pytest.mark.parametrize("seed, epoch", [(0, -1), (17, -1), (5, 3)])
def test_detshuffle_epoch_and_seed_move_as_webdataset(seed, epoch) -> None:
    data = list(range(40))
    ours = _with_epochs(wds, wds.detshuffle(8, 3, seed=seed, epoch=epoch), data, 3)
    theirs = _with_epochs(webdataset, webdataset.detshuffle(8, 3, seed=seed, epoch=epoch), data, 3)
    assert ours == theirs
    assert ours[0] == (seed, epoch)[::-1] and ours[-1] == (epoch + 3, seed)
    # repetitions in one iter(): the epoch moves with each pass
    ours_stage, theirs_stage = wds.detshuffle(8, 3, seed=seed, epoch=epoch), webdataset.detshuffle(8, 3, seed=seed)
    theirs_stage.epoch = epoch
    run = [
        list(lib.DataPipeline([data], stage, lib.map(lambda x, s=stage: (x, s.epoch))).repeat(3))
        for lib, stage in ((wds, ours_stage), (webdataset, theirs_stage))
    ]
    assert run[0] == run[1] and ours_stage.epoch == theirs_stage.epoch == epoch + 3
    # called on its own, as webdataset's run(src): each call is the next epoch
    ours_stage, theirs_stage = wds.detshuffle(8, 3, seed=seed, epoch=epoch), webdataset.detshuffle(8, 3, seed=seed)
    theirs_stage.epoch = epoch
    for _ in range(3):
        assert list(ours_stage(iter(data))) == list(theirs_stage.run(iter(data)))
        assert (ours_stage.epoch, ours_stage.seed) == (theirs_stage.epoch, theirs_stage.seed)


def test_detshuffle_epoch_follows_set_epoch_and_resumes(urls) -> None:
    def make():
        stage = wds.detshuffle(9, 4, seed=3)
        pipeline = wds.DataPipeline(
            wds.SimpleShardList(urls),
            wds.tarfile_to_samples(),
            stage,
            wds.map(lambda sample: (sample["__key__"], stage.epoch, stage.seed)),
        )
        pipeline.set_epoch(2)
        return pipeline.repeat(2)

    stream, states = states_along(make)
    assert {(epoch, seed) for _, epoch, seed in stream} == {(2, 3), (3, 3)}
    theirs = webdataset.detshuffle(9, 4, seed=3)
    theirs.epoch = 1
    expected = list(
        webdataset.DataPipeline(
            webdataset.SimpleShardList(urls),
            webdataset.tarfile_to_samples(),
            theirs,
            webdataset.map(lambda sample: (sample["__key__"], theirs.epoch, theirs.seed)),
        ).repeat(2)
    )
    assert stream == [identity(x) for x in expected]
    for k in (0, 5, 44, 50, len(stream)):
        assert resume(make, states[k]) == stream[k:]
    assert_resumes_everywhere(make)


def test_detshuffle_state_taken_in_a_later_iter_resumes_in_a_fresh_pipeline(urls) -> None:
    def make():
        return wds.DataPipeline(
            wds.SimpleShardList(urls), wds.tarfile_to_samples(), wds.detshuffle(9, 4, seed=3), wds.to_tuple("__key__")
        )

    pipeline = make()
    first = [identity(x) for x in pipeline]
    iterator = iter(pipeline)  # the second epoch: .epoch has moved
    head = [identity(next(iterator)) for _ in range(20)]
    assert pipeline.pipeline[2].epoch == 1
    state = pipeline.state_dict()
    second = head + resume(make, state)
    assert sorted(second) == sorted(first) and second != first
    assert second == [identity(x) for x in _second_epoch(make)]


def _second_epoch(make):
    pipeline = make()
    pipeline.set_epoch(1)
    return list(pipeline)


def test_a_reader_from_webdatasets_pieces_resumes_mid_epoch(tmp_path) -> None:
    """A reader built from webdataset's pieces (url_opener + tar_file_expander + group_by_keys) used to carry
    no position (a mid-epoch state restarted the epoch, later it was refused); wdsraft's expander now tells
    the pipeline where each sample starts, so it resumes exactly, at every point and across epochs."""
    import webdataset

    with wds.ShardWriter(str(tmp_path / "s-%02d.tar"), maxcount=10, verbose=0) as sink:
        for number in range(30):
            sink.write({"__key__": f"{number:05d}", "txt": str(number)})
    urls = sorted(str(p) for p in tmp_path.glob("s-*.tar"))

    def make() -> wds.DataPipeline:
        return wds.DataPipeline(
            wds.SimpleShardList(urls),
            wds.tariterators.url_opener,
            wds.tariterators.tar_file_expander,
            webdataset.tariterators.group_by_keys,
        ).repeat(2)

    stream = assert_resumes_everywhere(make)
    assert [key for key, _content in stream] == [f"{n:05d}" for n in range(30)] * 2


def test_a_pipeline_without_positions_still_refuses_mid_epoch() -> None:
    """Items from a plain iterable have no position: a mid-epoch state is refused when loaded."""

    def make() -> wds.DataPipeline:
        return wds.DataPipeline([[{"n": n} for n in range(12)]], wds.map(lambda item: item["n"]))

    pipeline = make()
    iterator = iter(pipeline)
    head = [next(iterator) for _ in range(4)]
    state = pipeline.state_dict()
    fresh = make()
    fresh.load_state_dict(state)
    with pytest.raises(wds.StateMismatchError, match="cannot resume this pipeline 4 items into epoch 0"):
        next(iter(fresh))
    assert head + list(iterator) == list(range(12))


class _Counting(wds.Stage):
    """A custom source that restores its own position (docs/stages.md: any stateful stage)."""

    def __init__(self, count: int):
        self.count = count
        self._next = 0

    def state_dict(self) -> dict:
        return {"next": self._next}

    def run(self, ctx, src, state):
        self._next = state["next"] if state else 0
        return self._numbers()

    def _numbers(self):
        while self._next < self.count:
            self._next += 1
            yield self._next - 1


def test_a_custom_stateful_source_still_resumes_mid_epoch() -> None:
    stream = assert_resumes_everywhere(lambda: wds.DataPipeline(_Counting(12), wds.map(lambda n: n * n)))
    assert stream == [n * n for n in range(12)]
