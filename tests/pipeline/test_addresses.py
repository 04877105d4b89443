"""Addresses after a stage that splits items (review finding 5): a stage that stamps the items it hands
out (shuffle, parallel_map) must not change the address the stages before it are still numbering."""

from __future__ import annotations

import pytest

import wdsraft as wds
from wdsraft.core.fields import OFFSET_FIELD, ORDINAL_FIELD

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings


@pytest.fixture(scope="module")
def urls(write_shards) -> list[str]:
    return write_shards("ad", [{"txt": str(n)} for n in range(12)], 4)


def split2(src):
    """A plain function yielding two items per sample, each carrying the address it should have."""
    for sample in src:
        for i in range(2):
            raw = (sample["__url__"], sample[ORDINAL_FIELD], sample[OFFSET_FIELD])
            yield {"__key__": f"{sample['__key__']}/{i}", "address": (*raw, i)}


@pytest.mark.parametrize("stage", ["parallel_map", "shuffle"])
def test_held_items_have_their_own_addresses(urls, stage):
    # At every step, the addresses a stamping stage holds are those of distinct items not yet handed out
    # (before, parallel_map held the address of the item it had just handed out, again and again).
    def make():
        if stage == "parallel_map":
            held = wds.parallel_map(lambda item: item, max_workers=1, prefetch_factor=3)
        else:
            held = wds.shuffle(5, 5, seed=3)
        return held, wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(), split2, held)

    everything = {item["address"] for item in make()[1]}
    assert len(everything) == 24
    held, pipeline = make()
    delivered: set[tuple] = set()
    for step, item in enumerate(pipeline):
        delivered.add(item["address"])
        addresses = [tuple(address) for address in held.addresses()]
        assert len(set(addresses)) == len(addresses), f"step {step}: {addresses}"
        assert set(addresses) <= everything - delivered, f"step {step}: {addresses}"
    assert delivered == everything
