"""``EvalDataset``: a finite, unshuffled evaluation pass that reads every sample exactly once across
ranks x DataLoader workers, split by samples (see ``wdsraft.pipeline.evalsplit``)."""

from __future__ import annotations

from typing import Any

from webdataset.handlers import reraise_exception

from wdsraft.compat import FluidInterface
from wdsraft.core.distributed import rank_and_world_size
from wdsraft.pipeline.datapipeline import DataPipeline
from wdsraft.pipeline.evalsplit import EvalSplit
from wdsraft.pipeline.source import TarfileToSamples

__all__ = ["EvalDataset"]


class EvalDataset(DataPipeline, FluidInterface):
    """Every sample of ``urls`` once per pass, across all ranks and workers, in shard order, each
    (rank, worker) reading one contiguous range: ranks hold counts that differ by at most one sample,
    whether or not the shards divide by the ranks.

    ``urls`` is a shard list (brace patterns, a list) or a manifest (a path or URL ending in ``.json``,
    as ``wdsraft convert`` and ``wdsraft index`` write it; wids takes its shard index the same way).
    The split uses each shard's sample count: from the manifest (one read, here), else from each
    shard's index (one read per shard, here). The reader, which reads a shard's index anyway when it
    opens the shard, seeks into the first shard of a range by it and refuses a shard whose index no
    longer has the count the split used (a stale manifest: ``IndexFormatError`` naming the shard).
    Shards without an index are refused, unless ``count_unindexed=True`` (shard lists only): they are
    then read whole once to count them (logged).
    Fluent stages (``.decode().to_tuple(...).batched(n)``) work as on ``WebDataset``; the pass is
    checkpointable like any pipeline. Pair it with ``WebLoader(..., even_ends="pad")`` when the
    model's forward runs collectives (FSDP), so that a rank with one batch fewer joins them.
    """

    def __init__(
        self,
        urls: Any,
        handler: Any = reraise_exception,
        select_files: Any = None,
        rename_files: Any = None,
        verify: bool = False,
        count_unindexed: bool = False,
    ):
        super().__init__()
        self.split = EvalSplit(urls, count_unindexed)
        self.append(self.split)
        self.append(
            TarfileToSamples(
                handler=handler, select_files=select_files, rename_files=rename_files, local_path=True, verify=verify
            )
        )

    def num_samples(self, rank: int | None = None, world_size: int | None = None) -> int:
        """The samples ``rank`` reads in a pass (all its workers together); this process's rank by default."""
        first, last = self.split.samples_of(*_rank_of(rank, world_size))
        return last - first

    def batch_count(
        self, batch_size: int, num_workers: int = 0, rank: int | None = None, world_size: int | None = None
    ) -> int:
        """The batches ``rank`` gets when each of ``num_workers`` workers batches its own samples by
        ``batch_size``, the last one partial (``.batched(batch_size)`` in the dataset): the ``length`` for
        ``EvenEnds``, so that ranks agree on the step count once, not at every step."""
        workers = max(num_workers, 1)
        ranges = (self.split.samples_of(*_rank_of(rank, world_size), worker, workers) for worker in range(workers))
        return sum(-(-(high - low) // batch_size) for low, high in ranges)

    def __enter__(self) -> EvalDataset:
        return self

    def __exit__(self, *args: Any) -> None:
        self.close()


def _rank_of(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The rank and world size given, else this process's."""
    own_rank, own_world_size = rank_and_world_size()
    return (own_rank if rank is None else rank), (own_world_size if world_size is None else world_size)
