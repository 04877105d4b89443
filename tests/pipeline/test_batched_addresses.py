"""``batched`` after a plain function that yields several items per raw item: the item it holds at a
state (the first of the next batch) is saved as its raw item's address plus its place among that raw
item's items, and a resume delivers exactly the batches the uninterrupted run had."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wdsraft as wds
from wdsraft.core.distributed import WorkerInfo
from wdsraft.pipeline.stage import AddressTracker, Context
from wdsraft.testing import assert_resumes_everywhere

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings


@pytest.fixture(scope="module")
def urls(write_shards) -> list[str]:
    return write_shards("ba", [{"txt": str(n)} for n in range(7)], 2)


def split3(src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for sample in src:
        for i in range(3):
            yield {"__key__": f"{sample['__key__']}/{i}", "i": i}


@pytest.mark.parametrize("size", [2, 4, 5])
def test_batched_after_a_plain_splitter_resumes_at_every_batch(urls, size: int) -> None:
    def make() -> wds.DataPipeline:
        return wds.DataPipeline(
            wds.SimpleShardList(urls), wds.tarfile_to_samples(), wds.decode(), split3, wds.batched(size)
        )

    stream = assert_resumes_everywhere(make)
    keys = [key for batch_keys, _digest in stream for key in batch_keys]  # (a batch's identity: keys, digest)
    assert keys == [f"{n:05d}/{i}" for n in range(7) for i in range(3)]


# ``batched`` works out each item's address inline (a call less per item); ``AddressTracker.address`` is the
# shared rule. The two must agree on every sequence of stamps: new raw items, several items from one stamp
# (after a splitter), stamps with a sub-index already (after another splitting stage), and no stamp at all.
_stamps = st.lists(
    st.one_of(
        st.none(),  # no position (after a merge)
        st.just("same"),  # one more item from the stamp before
        st.tuples(st.sampled_from(["a.tar", "b.tar"]), st.integers(0, 9), st.integers(0, 9), st.integers(0, 3)),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(stamps=_stamps)
def test_batched_inline_addresses_agree_with_address_tracker(stamps: list[Any]) -> None:
    ctx = Context(0, WorkerInfo(0, 1, 0, 1))
    tracker = AddressTracker(ctx)
    expected: list[Any] = []
    stage = wds.batched(10**6)
    stage.index = 0
    ctx.stages = [stage]
    seen: list[Any] = []

    def items() -> Iterator[dict[str, int]]:
        for n, stamp in enumerate(stamps):
            if stamp is None:
                ctx.provenance = None
                ctx.serial = next(ctx.serials)
            elif stamp != "same":
                ctx.stamp(stamp)
            expected.append(tracker.address())
            yield {"n": n}
        seen.extend(stage._addresses)  # (the held items' addresses, before the last batch goes out)

    list(stage.run(ctx, items(), None))
    assert seen == expected
