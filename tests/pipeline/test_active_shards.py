"""Several shards read at once (``n_active_shards``): the round-robin order, exact resume at every step
(0 and 2 DataLoader workers, a shuffle buffer downstream), the ledger's elastic skip, and k=1 as before."""

from __future__ import annotations

from collections import Counter

import pytest
import webdataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wdsraft as wds
from wdsraft.testing import assert_resumes_everywhere, identity, resume, states_along

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings

PER_SHARD = 5


@pytest.fixture(scope="module")
def urls(write_shards) -> list[str]:
    return write_shards("k", [{"txt": f"s{n}"} for n in range(23)], PER_SHARD)  # 5 shards: 5, 5, 5, 5, 3


def _keys(dataset) -> list[str]:
    return [sample["__key__"] for sample in dataset]


def _round_robin_model(shards: list[list[str]], k: int) -> list[str]:
    """The order k shards at a time, in turn, give: a shard that ends leaves the turn, the next joins last."""
    pending, active, out = [list(s) for s in shards], [], []
    while pending or active:
        while len(active) < k and pending:
            active.append(pending.pop(0))
        shard = active.pop(0)
        if shard:
            out.append(shard.pop(0))
            active.append(shard)
    return out


def _shards(urls) -> list[list[str]]:
    return [_keys(wds.WebDataset([url], shardshuffle=False)) for url in urls]


@pytest.mark.parametrize("k", [2, 3, 7])
def test_k_shards_are_read_in_turn(urls, k) -> None:
    samples = list(wds.WebDataset(urls, shardshuffle=False, n_active_shards=k))
    got = [sample["__key__"] for sample in samples]
    assert got == _round_robin_model(_shards(urls), k)
    assert all(sample["__local_path__"] == sample["__url__"] for sample in samples)  # (as webdataset sets it)
    assert sorted(got) == [f"{n:05d}" for n in range(23)]


def test_one_active_shard_is_todays_stream_and_state(urls) -> None:
    """k=1: webdataset's stream, and the state and configuration of pipelines built without the option."""

    def make(**kw):
        return wds.WebDataset(urls, shardshuffle=3, seed=5, **kw).shuffle(4, seed=1)

    theirs = [s["__key__"] for s in webdataset.WebDataset(urls, shardshuffle=3, seed=5).shuffle(4, seed=1)]
    assert _keys(make(n_active_shards=1)) == theirs
    old, states = states_along(make, limit=7)
    assert states_along(lambda: make(n_active_shards=1), limit=7) == (old, states)
    assert resume(lambda: make(n_active_shards=1), states[7]) == [identity(s) for s in make()][7:]
    # States saved before the option existed: the same configuration (fingerprint) and source state keys.
    assert "n_active_shards" not in states[7]["config"]
    assert set(states[7]["stages"]["4"]) == {"shards_started", "url", "offset", "ordinal", "done", "shard"}


def test_a_state_of_another_k_is_refused(urls) -> None:
    _, states = states_along(lambda: wds.WebDataset(urls, shardshuffle=False), limit=3)
    again = wds.WebDataset(urls, shardshuffle=False, n_active_shards=2)
    again.load_state_dict(states[3])
    with pytest.raises(wds.StateMismatchError, match="n_active_shards"):
        list(again)
    with pytest.raises(ValueError, match="n_active_shards"):
        wds.WebDataset(urls, shardshuffle=False, n_active_shards=0)


def test_resume_at_every_step_with_a_shuffle_downstream(urls) -> None:
    def make():
        dataset = wds.WebDataset(urls, shardshuffle=4, seed=2, n_active_shards=3)
        return dataset.shuffle(6, seed=3).decode().to_tuple("__key__", "txt").batched(2)

    stream = assert_resumes_everywhere(make)
    assert sorted(key for batch in stream for key in batch[0]) == [f"{n:05d}" for n in range(23)]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workers=st.sampled_from([0, 2]), kill=st.integers(0, 13), k=st.sampled_from([2, 3]))
def test_resume_through_dataloader_workers(urls, workers, kill, k) -> None:
    def make():
        dataset = wds.WebDataset(urls, shardshuffle=4, seed=2, n_active_shards=k).shuffle(3, seed=1).batched(2)
        loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers)
        return loader.unbatched().shuffle(4, seed=6).batched(2)

    full = [identity(b) for b in make()]
    _, states = states_along(make, limit=kill)
    assert resume(make, states[-1], seed=kill) == full[len(states) - 1 :]


def test_elastic_skip_leaves_consumed_samples_out_of_the_turn(urls) -> None:
    """The ledger's consumed samples are not read; a shard whose samples are all consumed never joins."""
    consumed = wds.ConsumedSet()
    consumed.add_samples(urls[0], [0, 2, 3])
    consumed.add_samples(urls[1], range(PER_SHARD))
    consumed.add_samples(urls[4], [2])
    dataset = wds.WebDataset(urls, shardshuffle=False, n_active_shards=3)
    dataset.skip_consumed(consumed, 0)
    shards = [
        [key for o, key in enumerate(keys) if not consumed.is_consumed(url, o)]
        for url, keys in zip(urls, _shards(urls), strict=True)
    ]
    assert _keys(dataset) == _round_robin_model(shards, 3)


def test_a_shards_error_goes_to_the_handler_and_the_others_go_on(urls, tmp_path) -> None:
    broken = tmp_path / "broken.tar"
    with open(urls[1], "rb") as whole:
        broken.write_bytes(whole.read()[:1500])  # cut inside its second sample
    mixed = [urls[0], str(broken), urls[2]]
    got = _keys(wds.WebDataset(mixed, shardshuffle=False, n_active_shards=3, handler=wds.warn_and_continue))
    assert set(_shards([urls[0]])[0] + _shards([urls[2]])[0]) <= set(got)
    with pytest.raises(Exception, match=r"broken\.tar"):
        _keys(wds.WebDataset(mixed, shardshuffle=False, n_active_shards=3))


def test_s3_shards_read_k_at_once_and_resume(urls, s3_bucket, monkeypatch) -> None:
    """k streams open at once on S3 (ranged reads): the same stream as local shards, and a resume that
    reopens each active shard at its offset."""
    import boto3

    monkeypatch.setenv("WDSRAFT_S3_READER", "smart_open")
    client = boto3.client("s3")
    remote = []
    for url in urls:
        name = url.rsplit("/", 1)[1]
        client.upload_file(url, s3_bucket, name)
        client.upload_file(url + ".idx", s3_bucket, name + ".idx")
        remote.append(f"s3://{s3_bucket}/{name}")

    def make():
        return wds.WebDataset(remote, shardshuffle=False, n_active_shards=3)

    local = _keys(wds.WebDataset(urls, shardshuffle=False, n_active_shards=3))
    assert _keys(make()) == local
    _, states = states_along(make, limit=9)
    assert [key for key, _content in resume(make, states[9])] == local[9:]


@pytest.mark.parametrize("workers", [0, 2])
def test_elastic_resume_through_the_ledger_changing_k(urls, tmp_path, workers) -> None:
    """Consumed samples recorded with k=3 are skipped by a run with k=2 (a changed configuration, so an
    elastic resume): every sample once over the two runs."""

    def loader(k: int, seed: int):
        dataset = wds.WebDataset(urls, shardshuffle=10, seed=seed, n_active_shards=k).shuffle(5, seed=seed)
        return wds.WebLoader(dataset.batched(3), batch_size=None, num_workers=workers)

    def positions(batch) -> list[tuple[str, int]]:
        return list(zip(batch["__url__"], batch["__ordinal__"].tolist(), strict=True))

    ledger = wds.Ledger(str(tmp_path / "l"), run="one", rank=0, world_size=1)
    first = loader(3, 1)
    delivered = []
    for step, batch in enumerate(ledger.track(first), 1):
        delivered.append(positions(batch))
        if step == 3:
            saved = ledger.checkpoint(first, step)
        if step == 5:
            break  # crash: steps 4-5 were delivered but never committed
    again = wds.Ledger(str(tmp_path / "l"), run="two", rank=0, world_size=1)
    second = loader(2, 7)
    assert again.resume(second, saved) == "elastic"
    rest = [pair for batch in again.track(second) for pair in positions(batch)]
    union = Counter([pair for batch in delivered[:3] for pair in batch] + rest)
    assert set(union) == {(url, o) for url in urls for o in range(PER_SHARD if url != urls[-1] else 3)}
    assert max(union.values()) == 1
