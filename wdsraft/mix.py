"""webdataset's ``mix`` module name: checkpointable ``RandomMix`` and ``RoundRobin`` (``wdsraft.pipeline.mix``),
with webdataset's signatures and streams, and webdataset's stateless mixing functions as they are."""

from webdataset.mix import IterableDataset, random_samples, round_robin_longest, round_robin_shortest

from wdsraft.pipeline.mix import RandomMix, RoundRobin

__all__ = [
    "IterableDataset",
    "RandomMix",
    "RoundRobin",
    "random_samples",
    "round_robin_longest",
    "round_robin_shortest",
]
