"""``batched`` after a plain function that yields several items per raw item: the item it holds at a
state (the first of the next batch) is saved as its raw item's address plus its place among that raw
item's items, and a resume delivers exactly the batches the uninterrupted run had."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import wdsraft as wds
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
