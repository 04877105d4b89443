"""A plain function that yields several items per raw item (a flat-map written as a generator), right after
the source: a state taken part-way through a raw item resumes with the rest of it (the pass records the raw
item's address and how many of its items went past; a restore re-reads it and drops those)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import pytest

import wdsraft as wds
from wdsraft.testing import assert_resumes_everywhere, resume, roundtrip, states_along
from wdsraft.testing import identity as identity_of

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings

N = 8


@pytest.fixture(scope="module")
def urls(write_shards) -> list[str]:
    return write_shards("ps", [{"txt": str(n)} for n in range(N)], 3)


def split3(src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for sample in src:
        for i in range(3):
            yield {"__key__": f"{sample['__key__']}/{i}", "i": i}


def uneven(src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """0, 1, 2 or 3 items per raw item (the number in the sample, modulo 4)."""
    for sample in src:
        for i in range(int(sample["txt"]) % 4):
            yield {"__key__": f"{sample['__key__']}/{i}", "i": i}


def identity(item: Any) -> Any:
    return item


def _pipeline(urls: list[str], *after: Any, splitter: Any = split3) -> wds.DataPipeline:
    return wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(), wds.decode(), splitter, *after)


def test_a_plain_splitter_alone_resumes_mid_item(urls) -> None:
    stream = assert_resumes_everywhere(lambda: _pipeline(urls))
    assert [key for key, _ in stream] == [f"{n:05d}/{i}" for n in range(N) for i in range(3)]


def test_a_plain_splitter_giving_0_to_3_items_resumes_everywhere(urls) -> None:
    stream = assert_resumes_everywhere(lambda: _pipeline(urls, splitter=uneven))
    assert len(stream) == sum(n % 4 for n in range(N))


def test_a_plain_splitter_then_shuffle(urls) -> None:
    assert_resumes_everywhere(lambda: _pipeline(urls, wds.shuffle(4, initial=4, seed=1)))


def test_a_plain_splitter_then_parallel_map_then_shuffle(urls) -> None:
    def make() -> wds.DataPipeline:
        return _pipeline(
            urls, wds.parallel_map(identity, max_workers=2, prefetch_factor=2), wds.shuffle(4, initial=4, seed=1)
        )

    assert_resumes_everywhere(make)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_plain_splitter_inside_a_webloader(urls, workers: int) -> None:
    def make() -> Any:
        dataset = wds.DataPipeline(
            wds.SimpleShardList(urls),
            wds.split_by_worker,
            wds.tarfile_to_samples(),
            split3,
            wds.shuffle(3, initial=3, seed=2),
        )
        # (a worker snapshot at every step: most of them part-way through a raw item)
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers, snapshot_every_n_steps=1)

    kill_points = None if workers == 0 else [0, 1, 2, 5, 7, 11, 16, 23]
    stream = assert_resumes_everywhere(make, kill_points=kill_points, same_shape=workers == 0)
    assert sorted(key for key, _ in stream) == sorted(f"{n:05d}/{i}" for n in range(N) for i in range(3))


def _after_loader(urls: list[str], *after: Any, function: Any = split3) -> wds.DataPipeline:
    dataset = wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(), wds.decode())
    return wds.DataPipeline(wds.WebLoader(dataset, batch_size=None, num_workers=0), function, *after)


def test_a_plain_splitter_after_a_webloader_then_shuffle(urls) -> None:
    # (the loader keeps snapshots for the shuffle's buffer: the batch part-way through is one more to re-read)
    assert_resumes_everywhere(lambda: _after_loader(urls, wds.shuffle(4, initial=4, seed=1)))


@pytest.mark.parametrize("taken_after", [2, 4])  # (part-way through the first batch; after a split was seen)
def test_a_plain_splitter_right_before_the_output_of_a_webloader_is_refused(urls, taken_after: int) -> None:
    pipeline = _after_loader(urls)
    items = iter(pipeline)
    for _ in range(taken_after):
        next(items)
    with pytest.raises(wds.StateMismatchError, match=r"stage 1 \(split3\).*wds.map\(to_list\) then wds.unlisted"):
        pipeline.state_dict()


def test_pipelines_without_plain_stages_after_the_source_keep_their_state(urls) -> None:
    def make() -> wds.DataPipeline:
        return wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(), wds.shuffle(3, seed=1))

    _, states = states_along(make, limit=4)
    assert "partial" not in states[-1]["stages"]


def test_the_state_names_the_raw_item_and_how_much_of_it_went_out(urls) -> None:
    _, states = states_along(lambda: _pipeline(urls), limit=2)
    url, ordinal, _offset, went_out = states[-1]["stages"]["partial"]
    assert (url, ordinal, went_out) == (urls[0], 0, 2)
    assert [key for key, _ in resume(lambda: _pipeline(urls), states[-1])[:2]] == ["00000/2", "00001/0"]


def lists(src: Iterator[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Two lists per raw item, of 3 and of 2 items (then ``unlisted``: the stage that takes them holds a list)."""
    for sample in src:
        yield [{"__key__": f"{sample['__key__']}/{i}", "i": i} for i in range(3)]
        yield [{"__key__": f"{sample['__key__']}/{i}", "i": i} for i in range(3, 5)]


@pytest.mark.parametrize("tail", ["none", "shuffle", "parallel_map", "unlisted"])
def test_a_state_taken_after_a_restore_part_way_through_an_item_resumes_too(urls, tail: str) -> None:
    """Also where the first stage after the plain functions hands out what it held before pulling again
    (``unlisted`` mid-list): a second state then still names the raw item's rest (it named nothing, and a
    resume lost the raw item's second list)."""

    def make() -> wds.DataPipeline:
        if tail == "unlisted":
            return _pipeline(urls, wds.unlisted(), splitter=lists)
        after = {
            "none": [],
            "shuffle": [wds.shuffle(4, initial=4, seed=1)],
            "parallel_map": [wds.parallel_map(identity, max_workers=2, prefetch_factor=1)],
        }[tail]
        return _pipeline(urls, *after)

    stream, states = states_along(make)
    for k in range(0, len(stream), 2):
        for further in (1, 2):
            first = make()
            first.load_state_dict(roundtrip(states[k], "json"))
            items = iter(first)
            got = [identity_of(next(items)) for _ in range(further)]
            again = resume(make, first.state_dict())
            assert got + again == stream[k:], (k, further)


def test_a_plain_splitter_after_a_reader_built_from_webdataset_pieces(urls) -> None:
    from webdataset.tariterators import group_by_keys

    def make() -> wds.DataPipeline:
        return wds.DataPipeline(
            wds.SimpleShardList(urls),
            wds.tariterators.url_opener,
            wds.tariterators.tar_file_expander,
            group_by_keys,
            split3,
            wds.shuffle(4, initial=4, seed=1),
        )

    assert_resumes_everywhere(make)


def every_other(src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """A plain filter written as a generator: never more than one item per item."""
    for sample in src:
        if int(sample["txt"]) % 2 == 0:
            yield sample


@pytest.mark.parametrize("after", ["shuffle", "parallel_map", "batched"])
def test_a_plain_splitter_after_a_stage_is_refused_once_seen_splitting(urls, after: str) -> None:
    """After a stage (shuffle, parallel_map, or batched and a splitter of batches) no state sees the rest of an
    item the function is part-way through: states are refused from the first item seen to give several, instead
    of resuming without the rest of it (shuffle then split3 used to lose or repeat items, silently)."""
    if after == "shuffle":
        stages: tuple[Any, ...] = (wds.shuffle(4, initial=4, seed=1), split3)
    elif after == "parallel_map":
        stages = (wds.parallel_map(identity, max_workers=2, prefetch_factor=1), split3)
    else:
        stages = (wds.batched(2, collation_fn=None), lambda src: (s for batch in src for s in batch))
    pipeline = _pipeline(urls, *stages, splitter=identity)
    items = iter(pipeline)
    next(items)
    next(items)
    with pytest.raises(wds.StateMismatchError, match=r"a plain function after a stage \(stage 5 .*wds.unlisted"):
        pipeline.state_dict()


def test_plain_filters_after_a_stage_keep_their_state(urls, monkeypatch) -> None:
    """A generator that only drops items is watched and never refused; webdataset's one-for-one filters
    (decode, map, to_tuple, select...) are not even watched (nor pulled ahead when a state is taken)."""
    assert_resumes_everywhere(
        lambda: _pipeline(urls, wds.shuffle(4, initial=4, seed=1), every_other, splitter=identity)
    )
    from wdsraft.pipeline import splitwatch

    def never(self, items):
        raise AssertionError("a one-for-one filter was watched")

    monkeypatch.setattr(splitwatch.SplitWatch, "pulled", never)
    assert_resumes_everywhere(
        lambda: wds.DataPipeline(
            wds.SimpleShardList(urls),
            wds.tarfile_to_samples(),
            wds.shuffle(4, seed=1),
            wds.decode(),
            wds.map(identity),
            wds.select(bool),
            wds.to_tuple("__key__", "txt"),
        )
    )


def _pieces(sample: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"__key__": f"{sample['__key__']}/{i}", "n": int(sample["txt"]), "i": i} for i in range(4)]


def _split_filter_shuffle(urls: list[str], keep: Any) -> wds.DataPipeline:
    return _pipeline(
        urls, wds.map(_pieces), wds.unlisted(), wds.select(keep), wds.shuffle(5, seed=1), splitter=identity
    )


def test_a_filter_that_drops_between_a_split_and_a_buffer_is_refused(urls) -> None:
    """The buffer numbers the items of a split group it received; a restore re-reads the whole group, so after
    a filter dropped one it would restore another item (or fail with 'gave nothing'). States are refused from
    the first drop seen, naming the stages and what to do."""
    pipeline = _split_filter_shuffle(urls, lambda item: (item["n"] + item["i"]) % 3 != 0)
    items = iter(pipeline)
    for _ in range(8):
        next(items)
    with pytest.raises(wds.StateMismatchError, match=r"stage 5 \(unlisted\) and stage 7 \(shuffle\).*_select"):
        pipeline.state_dict()


def test_a_filter_between_a_split_and_a_buffer_that_keeps_everything_resumes(urls) -> None:
    """Watched, never refused while nothing is dropped; and with no buffer after it, not watched at all."""
    assert_resumes_everywhere(lambda: _split_filter_shuffle(urls, lambda item: True), same_shape=False)
    assert_resumes_everywhere(
        lambda: _pipeline(
            urls, wds.map(_pieces), wds.unlisted(), wds.select(lambda item: item["i"] != 2), splitter=identity
        ),
        same_shape=False,
    )


def _exact_or_refused(make: Any) -> tuple[int, int]:
    """Take a state after every item of an uninterrupted run: each either resumes to exactly the rest of the
    stream or is refused (``StateMismatchError``). Returns (exact, refused) counts."""
    pipeline = make()
    stream = [identity_of(item) for item in make()]
    items = iter(pipeline)
    exact = refused = 0
    for k in range(len(stream) + 1):
        try:
            state = pipeline.state_dict()
        except wds.StateMismatchError:
            refused += 1
        else:
            assert resume(make, state) == stream[k:], f"state after {k} items resumes wrong"
            exact += 1
        if k < len(stream):
            assert identity_of(next(items)) == stream[k]
    return exact, refused


def _to_list3(sample: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"__key__": f"{sample['__key__']}/{i}", "i": i} for i in range(3)]


@pytest.mark.parametrize("where", ["after_loader", "after_shuffle", "after_parallel_map"])
@pytest.mark.parametrize("splitter", ["split3", "uneven", "every_other"])
def test_a_state_after_the_first_item_of_a_split_item_is_exact_or_refused(urls, where: str, splitter: str) -> None:
    """A state taken after the first item a plain function gave for an item, before any split was seen, was
    accepted and resumed without the rest of that item. The pass now pulls the function's next item when such
    a state is asked for (and hands it out next): from the same item, the state is refused; else it is exact.
    A function that never splits (``every_other``) keeps all its states."""
    function = {"split3": split3, "uneven": uneven, "every_other": every_other}[splitter]

    def make() -> wds.DataPipeline:
        if where == "after_loader":
            return _after_loader(urls, function=function)
        stage = (
            wds.shuffle(4, initial=4, seed=1)
            if where == "after_shuffle"
            else wds.parallel_map(identity, max_workers=2, prefetch_factor=1)
        )
        return _pipeline(urls, stage, function, splitter=identity)

    exact, refused = _exact_or_refused(make)
    assert exact > 0  # (at least the state before the first item)
    if splitter == "every_other":
        assert refused == 0
    else:
        assert refused > 0


def lists_of_3(src: Iterator[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """One list per item, written as a generator (so watched: it may split)."""
    for sample in src:
        yield _to_list3(sample)


def test_an_item_pulled_ahead_that_waits_while_items_go_out_keeps_the_states_exact(urls) -> None:
    """``unlisted`` hands out the rest of a list without pulling: the list a state pulled ahead out of the run
    before it waits there across several items out, and the states taken meanwhile must still describe the
    stages before the run as they were before that pull. Two watched runs, one after the other, too."""

    def make() -> wds.DataPipeline:
        return _pipeline(
            urls,
            wds.shuffle(4, initial=4, seed=1),
            lists_of_3,
            wds.unlisted(),
            one_for_one,
            wds.shuffle(3, initial=3, seed=2),
            lambda src: (dict(item, seen=True) for item in src),
            splitter=identity,
        )

    exact, refused = _exact_or_refused(make)
    assert (exact, refused) == (N * 3 + 1, 0)


def one_for_one(src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """A generator (so watched) that hands each item on."""
    yield from src


def _keep_some(item: dict[str, Any]) -> dict[str, Any] | None:
    return item if (int(item["__key__"][:5]) + item["i"]) % 3 != 0 else None


def _drop_some(src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``_keep_some`` as a plain generator (not one of webdataset's filters: watched)."""
    for item in src:
        if _keep_some(item) is not None:
            yield item


@pytest.mark.parametrize(
    "layout",
    ["unlisted", "unlisted_shuffle", "plain", "generator_after_unlisted_shuffle", "no_split", "plain_one_for_one"],
)
def test_a_parallel_filter_map_that_drops_between_a_split_and_a_buffer_is_refused(urls, layout: str) -> None:
    """As a plain filter there: the buffer after it numbers the items of a split group it received, a restore
    re-reads the whole group (``parallel_filter_map`` drops again), so it would restore other items. States
    are refused from the first drop (also with a shuffle between the split and the filter: it passes the
    numbering on; and for a plain generator there); before it, and with nothing dropped, they resume exactly.
    With no split before it (or a generator after the source never seen splitting), a drop changes nothing:
    never refused."""

    def make(fn: Any = _keep_some) -> wds.DataPipeline:
        dropping: Any = wds.parallel_filter_map(fn, max_workers=2, prefetch_factor=1)
        if layout == "generator_after_unlisted_shuffle":
            dropping = _drop_some if fn is _keep_some else identity
        before = {
            "unlisted": (wds.map(_pieces), wds.unlisted()),
            "unlisted_shuffle": (wds.map(_pieces), wds.unlisted(), wds.shuffle(3, initial=3, seed=4)),
            "generator_after_unlisted_shuffle": (wds.map(_pieces), wds.unlisted(), wds.shuffle(3, initial=3, seed=4)),
            "plain": (),
            "no_split": (wds.map(lambda sample: {**sample, "i": 1}),),
            "plain_one_for_one": (wds.map(lambda sample: {**sample, "i": 1}),),
        }[layout]
        return _pipeline(
            urls,
            *before,
            dropping,
            wds.shuffle(5, initial=5, seed=1),
            splitter={"plain": split3, "plain_one_for_one": one_for_one}.get(layout, identity),
        )

    exact, refused = _exact_or_refused(make)
    if layout in ("no_split", "plain_one_for_one"):  # (a generator after the source that never split)
        assert refused == 0
        return
    assert exact > 0 and refused > 0
    pipeline = make()
    items = iter(pipeline)
    for _ in range(8):
        next(items)
    expected = (
        r"stage 8 \(shuffle\) \(stage 7 \(_drop_some\)\) dropped an item"
        if "generator" in layout
        else r"stage \d \(parallel_filter_map\) dropped an item.*before stage \d \(shuffle\)"
    )
    with pytest.raises(wds.StateMismatchError, match=expected):
        pipeline.state_dict()
    assert _exact_or_refused(lambda: make(identity))[1] == 0


def test_an_item_pulled_ahead_and_never_handed_out_leaves_a_live_rng_as_it_was(urls) -> None:
    """A ``with_epoch`` window that closes while a run holds what a state pulled ahead: the item never goes
    out, and the shuffle's live RNG (drawn on from one iteration to the next) goes back to where it was before
    the pull, so taking states does not change the next iteration's order; and each state resumes exactly."""

    def make() -> wds.DataPipeline:
        return _pipeline(
            urls, wds.shuffle(4, initial=4, rng=random.Random(5)), lists_of_3, wds.unlisted(), splitter=identity
        ).with_epoch(8)  # (the window closes on a list's second item: the next list was pulled ahead)

    def two_windows(take_states: bool) -> list[Any]:
        pipeline = make()
        stream = []
        for _ in range(2):
            for item in pipeline:
                stream.append(identity_of(item))
                if take_states:
                    pipeline.state_dict()
        return stream

    assert two_windows(True) == two_windows(False)
    exact, refused = _exact_or_refused(make)
    assert (exact, refused) == (9, 0)


def test_a_state_at_a_full_with_epoch_window_pulls_nothing_ahead(urls) -> None:
    """The pass ends with the window: an item pulled there would never go out, only read for nothing (and run
    what the functions before the run do once more)."""
    calls: list[str] = []

    def counted(sample: dict[str, Any]) -> dict[str, Any]:
        calls.append(sample["__key__"])
        return sample

    def window(take_states: bool) -> list[str]:
        calls.clear()
        pipeline = _pipeline(
            urls, wds.map(counted), wds.shuffle(3, initial=3, seed=1), one_for_one, splitter=identity
        ).with_epoch(5)
        for _ in pipeline:
            if take_states:
                pipeline.state_dict()
        return list(calls)

    assert window(True) == window(False)


def test_a_state_pulling_through_a_random_mix_leaves_its_draws_as_they_were(tmp_path) -> None:
    """A ``RandomMix`` draws on from one pass to the next: an item a state pulled through it that never goes
    out (the pass ends at a ``slice``) puts its generator back, so taking states changes no later pass."""
    urls = []
    for s in range(2):
        path = tmp_path / f"m{s}.tar"
        with wds.TarWriter(str(path)) as sink:
            for n in range(20):
                sink.write({"__key__": f"{s}k{n:03d}", "txt": b"%d" % n})
        urls.append(str(path))

    def make() -> wds.DataPipeline:
        sources = [wds.DataPipeline(wds.SimpleShardList([url]), wds.tarfile_to_samples()) for url in urls]
        return wds.DataPipeline(wds.RandomMix(sources, seed=3), one_for_one, wds.slice(3)).repeat(3)

    def keys(take_states: bool) -> list[str]:
        pipeline = make()
        out = []
        for sample in pipeline:
            out.append(sample["__key__"])
            if take_states:
                with contextlib.suppress(wds.StateMismatchError):
                    pipeline.state_dict()
        return out

    assert keys(True) == keys(False)


def _fails_on_a_second_item(src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """One item per item, then an error part-way through the third (before its second item)."""
    for sample in src:
        yield sample
        if int(sample["__key__"][:5]) == 2:
            raise ValueError("part-way through item 2")


def test_a_pull_that_meets_an_error_in_the_same_item_refuses_the_state(urls) -> None:
    """A state right after the first item out of item 2 pulls on and meets an error before the next item
    came in: the function was not done with item 2, so the state is refused (a restore would resume after
    it, without the rest); the error is raised where it would have been."""
    pipeline = _pipeline(urls, wds.shuffle(1, initial=1, seed=1), _fails_on_a_second_item, splitter=identity)
    items = iter(pipeline)
    seen = [next(items)["__key__"] for _ in range(3)]
    assert seen[-1].startswith("00002")
    with pytest.raises(wds.StateMismatchError, match="several items"):
        pipeline.load_state_dict(pipeline.state_dict())
    with pytest.raises(ValueError, match="part-way through item 2"):
        next(items)


def test_a_refused_state_pulls_nothing_ahead(urls) -> None:
    """A state refused anyway (a stage run as a plain function) does not pull: the functions upstream run
    only as often as without states."""
    calls: list[str] = []

    def counted(sample: dict[str, Any]) -> dict[str, Any]:
        calls.append(sample["__key__"])
        return sample

    def run(take_states: bool) -> int:
        calls.clear()
        pipeline = _pipeline(
            urls,
            wds.map(counted),
            wds.shuffle(2, initial=2, seed=1),
            lambda src: wds.filters._shuffle(src, 2),  # (a stage called as a plain function: refused)
            one_for_one,
            splitter=identity,
        )
        items = iter(pipeline)
        for _ in range(4):
            next(items)
            if take_states:
                with contextlib.suppress(wds.StateMismatchError):
                    pipeline.state_dict()
        return len(calls)

    assert run(True) == run(False)


def _keep_some_or_none(item: dict[str, Any]) -> dict[str, Any] | None:
    return _keep_some(item)


@pytest.mark.parametrize("dropping", ["select", "map_to_none", "select_keeping_all"])
def test_webdatasets_own_filters_dropping_after_a_split_and_a_stage_are_refused(urls, dropping: str) -> None:
    """``unlisted``, a ``shuffle`` (it passes the split's numbering on), then webdataset's own ``select`` or a
    ``map`` returning None, then a buffer: a drop there resumed other items, silently (the buffer numbers
    the split group's items it received, a restore re-reads and filters the whole group again). States are
    refused from the first drop; a filter that keeps everything resumes everywhere."""
    function = {
        "select": wds.select(lambda item: _keep_some(item) is not None),
        "map_to_none": wds.map(_keep_some_or_none),
        "select_keeping_all": wds.select(lambda item: True),
    }[dropping]

    def make() -> wds.DataPipeline:
        return _pipeline(
            urls,
            wds.map(_pieces),
            wds.unlisted(),
            wds.shuffle(3, initial=3, seed=4),
            function,
            wds.shuffle(5, initial=5, seed=1),
            splitter=identity,
        )

    exact, refused = _exact_or_refused(make)  # (asserts every state it does not refuse resumes exactly)
    if dropping == "select_keeping_all":
        assert refused == 0
    else:
        assert exact > 0 and refused > 0
