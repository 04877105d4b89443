"""Readers the client builds from webdataset's pieces (issue 14, item 3): their samples get positions
through wdsraft's ``tar_file_expander``, so buffering stages after them save and restore exactly; what
cannot be located is refused when the state is asked for or loaded, never by stopping training."""

from __future__ import annotations

import pytest
import webdataset
from dropin_idioms import clip_style, group_by_keys_nothrow, make_reader

import wdsraft as wds
from wdsraft.pipeline.stage import quiet_states
from wdsraft.testing import assert_resumes_everywhere, identity, resume, states_along

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("resampled", [False, True])
def test_clip_style_pipeline_is_webdataset_stream_and_resumes_everywhere(text_urls, resampled) -> None:
    epoch = 8 if resampled else 0
    ours = [identity(b) for b in clip_style(wds, text_urls, resampled, epoch_batches=epoch)]
    theirs = [identity(b) for b in clip_style(webdataset, text_urls, resampled, epoch_batches=epoch)]
    assert ours == theirs and len(ours) == (8 if resampled else 9)  # (25 samples with text, batches of 3)

    def make():  # two epochs (or a window of two epochs' batches): the live RNG goes on across them
        if resampled:
            return clip_style(wds, text_urls, resampled, epoch_batches=2 * epoch)
        return clip_style(wds, text_urls, resampled).repeat(2)

    stream = assert_resumes_everywhere(make)
    assert len(stream) == 2 * len(ours)


def _pieces(reader_stages):
    def make():
        return wds.DataPipeline(
            wds.SimpleShardList(URLS[0]), *reader_stages(), wds.shuffle(6, seed=2), wds.to_tuple("__key__")
        )

    return make


URLS: list = []


@pytest.fixture(autouse=True)
def _urls(text_urls):
    URLS[:] = [text_urls]


@pytest.mark.parametrize(
    "reader",
    [
        # webdataset's pieces as separate stages, webdataset's own grouper
        lambda: [
            wds.tariterators.url_opener,
            wds.tariterators.tar_file_expander,
            webdataset.tariterators.group_by_keys,
        ],
        # one function (pipelinefilter'd), a grouper that keeps only __key__ and __url__
        lambda: [make_reader(wds)()],
        # a plain function, not curried
        lambda: [
            lambda src: group_by_keys_nothrow(wds.tariterators.tar_file_expander(wds.tariterators.url_opener(src)))
        ],
        # webdataset's own opener (it ignores offsets) with wdsraft's expander: read from the shard's start
        lambda: [webdataset.tariterators.url_opener, wds.tariterators.tar_file_expander, group_by_keys_nothrow],
    ],
    ids=["pieces", "pipelinefilter", "plain", "webdataset-opener"],
)
def test_client_reader_samples_resume_exactly_through_a_shuffle(reader) -> None:
    stream = assert_resumes_everywhere(_pieces(reader))
    assert sorted(stream) == sorted((f"{n:05d}",) for n in range(30))


def test_a_resumed_client_reader_opens_its_shard_at_the_saved_offset(monkeypatch) -> None:
    """Not re-read from the shard's start: the opener is asked for the saved offset."""
    make = _pieces(lambda: [make_reader(wds)()])
    stream, states = states_along(make)
    opened = []
    real = wds.tariterators.url_opener

    def spying(data, **kw):
        for source in real(data, **kw):
            opened.append((source["url"], source.get("offset", 0)))
            yield source

    monkeypatch.setattr(wds.tariterators, "url_opener", spying)
    reader = states[20]["stages"]["1"]
    assert reader["offset"] > 0 and not reader["done"]
    assert resume(make, states[20]) == stream[20:]
    assert (reader["url"], reader["offset"]) in opened


def test_the_next_epoch_after_a_restore_between_epochs_is_the_uninterrupted_one(text_urls) -> None:
    """A state taken after a whole epoch (a finished iteration) carries the live RNG of the shuffle."""

    def make():
        return clip_style(wds, text_urls, resampled=False)

    pipeline = make()
    first = [identity(b) for b in pipeline]
    state = pipeline.state_dict()
    second = [identity(b) for b in pipeline]
    fresh = make()
    fresh.load_state_dict(state)
    assert [identity(b) for b in fresh] == second != first


def _foreign(handler=None):
    """A reader from webdataset's own opener and expander: no positions for wdsraft."""
    return [webdataset.tariterators.url_opener, webdataset.tariterators.tar_file_expander, group_by_keys_nothrow]


def test_a_reader_without_positions_refuses_when_asked_not_while_training(tmp_path) -> None:
    def make():
        return wds.DataPipeline(
            wds.SimpleShardList(URLS[0]), *_foreign(), wds.shuffle(6, seed=2), wds.to_tuple("__key__")
        )

    pipeline = make()
    iterator = iter(pipeline)
    head = [next(iterator) for _ in range(5)]
    with pytest.raises(
        wds.StateMismatchError, match=r"stage 1 \(url_opener\+tar_file_expander\+group_by_keys_nothrow\)"
    ):
        pipeline.state_dict()
    assert len(head) + len(list(iterator)) == 30  # training goes on


@pytest.mark.parametrize("workers", [0, 2])
def test_webloader_snapshots_of_an_unresumable_pipeline_never_stop_training(workers) -> None:
    def make():
        dataset = wds.DataPipeline(
            wds.SimpleShardList(URLS[0]),
            wds.split_by_worker,
            *_foreign(),
            wds.shuffle(6, seed=2),
            wds.to_tuple("__key__"),
            wds.batched(2),
        )
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers, snapshot_every_n_steps=1)

    loader = make()
    batches = list(loader)  # a snapshot at every step: none raises
    assert sum(len(b[0]) for b in batches) == 30
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(wds.StateMismatchError, match=r"\(url_opener\+tar_file_expander\+group_by_keys_nothrow\)"):
        loader.state_dict()
    # a state that a snapshot marked unresumable is refused at load, naming the stage
    with quiet_states():  # (as the loader takes it for a snapshot)
        marked = loader.loader.state_dict()
    assert "unresumable" in str(marked)
    fresh = make()
    with pytest.raises(wds.StateMismatchError, match=r"cannot be resumed: .*cannot save stage 2 \(url_opener"):
        fresh.load_state_dict({**fresh.state_dict(), "stages": {"0": {"loader": marked, "base": 1, "replay": 0}}})
    del iterator


@pytest.mark.parametrize("name", ["_shuffle", "_batched"])
def test_uncurried_buffering_functions_inside_a_pipeline_refuse_to_resume(name) -> None:
    """``wds.filters._shuffle`` run as a plain function holds a buffer the pipeline cannot see."""
    function = getattr(wds.filters, name)

    def make():
        return wds.DataPipeline(
            wds.SimpleShardList(URLS[0]),
            wds.tarfile_to_samples(),
            wds.to_tuple("__key__"),
            lambda src: function(src, 5),
        )

    pipeline = make()
    iterator = iter(pipeline)
    next(iterator)
    with pytest.raises(wds.StateMismatchError, match=rf"{name.strip('_')} runs as a plain function"):
        pipeline.state_dict()
    assert len(list(iterator)) > 0


def test_a_reader_that_reorders_its_samples_refuses_rather_than_loses_them() -> None:
    """A client's reader that shuffles internally hands a sample out after members of samples it still
    holds: "resume after this sample" would lose those (24 of 2,000 in a reviewer's run), so the state is
    refused, naming the stage."""
    import random

    def shuffling_reader(src):
        rng, held = random.Random(0), []
        for sample in group_by_keys_nothrow(wds.tariterators.tar_file_expander(wds.tariterators.url_opener(src))):
            held.append(sample)
            if len(held) >= 8:
                yield held.pop(rng.randrange(len(held)))
        while held:
            yield held.pop(rng.randrange(len(held)))

    pipeline = wds.DataPipeline(wds.SimpleShardList(URLS[0]), shuffling_reader, wds.to_tuple("__key__"))
    iterator = iter(pipeline)
    head = [next(iterator) for _ in range(3)]
    with pytest.raises(wds.StateMismatchError, match="drops or reorders samples"):
        pipeline.state_dict()
    assert len(head) + len(list(iterator)) == 30  # training goes on


def test_an_elastic_resume_refuses_a_client_reader_rather_than_repeat_consumed_samples() -> None:
    """A reader built from webdataset's pieces reads whole shards: handed a ledger's skip set (an elastic
    resume), it must refuse, naming itself, not deliver the consumed samples again."""

    class EverythingConsumed:
        def skipped_in(self, url: str) -> set[int]:
            return set(range(10_000))

        def marks_in(self, url: str) -> None:
            return None

    ours = wds.DataPipeline(wds.SimpleShardList(URLS[0]), wds.tarfile_to_samples())
    ours.skip_consumed(EverythingConsumed(), 0)
    assert list(ours) == []
    client = wds.DataPipeline(
        wds.SimpleShardList(URLS[0]),
        wds.tariterators.url_opener,
        wds.tariterators.tar_file_expander,
        wds.tariterators.group_by_keys,
    )
    client.skip_consumed(EverythingConsumed(), 0)
    with pytest.raises(wds.StateMismatchError, match=r"stage \d+ \(.*\) cannot skip the samples a ledger"):
        list(client)
