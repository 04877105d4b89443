"""The shard list of an evaluation pass: every sample exactly once across ranks x workers, split by
samples (not by shards), from the sample counts of the shards' indexes.

The samples of all shards, in the order given, are numbered 0..N-1. Rank r of R takes the range
``[r*N//R, (r+1)*N//R)`` (ranks differ by at most one sample), and worker w of its W workers the
same cut of the rank's range. A range becomes bounded shard entries ``{"url", "offset", "ordinal",
"end"}`` for ``TarfileToSamples``: it starts inside at most one shard, reached by one seek to the
byte offset the index gives.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from webdataset.shardlists import expand_urls

from wdsraft.core.distributed import rank_and_world_size, worker_info
from wdsraft.core.errors import IndexFormatError
from wdsraft.core.fields import OFFSET_FIELD
from wdsraft.core.state import fingerprint
from wdsraft.index.shard_index import INDEX_SUFFIX, ShardIndex
from wdsraft.io.threads import map_in_threads
from wdsraft.pipeline.shardlists import UrlList
from wdsraft.pipeline.stage import Context, Stage
from wdsraft.tar.reader import ShardSampleReader

__all__ = ["EvalSplit", "sample_counts", "split_range"]

logger = logging.getLogger(__name__)


def sample_counts(urls: list[str], count_unindexed: bool = False) -> tuple[list[int], dict[str, list[int]]]:
    """Each shard's sample count, from its index; a shard without one is refused, or (``count_unindexed``)
    read whole to count it, keeping its samples' byte offsets (returned by URL) for the seeks."""
    counts, offsets = [], {}
    # (one GET each on S3, in parallel threads: one after another, 10^4 shards took minutes per rank)
    progress = "shard indexes" if rank_and_world_size()[0] == 0 else None  # (one bar per job, not per rank)
    for url, index in zip(urls, map_in_threads(ShardIndex.beside, urls, progress=progress), strict=True):
        if index is not None:
            counts.append(index.num_samples)
        elif count_unindexed:
            logger.info("%s has no index: reading it whole to count its samples", url)
            offsets[url] = [sample[OFFSET_FIELD] for sample in ShardSampleReader(url, index=None)]
            counts.append(len(offsets[url]))
        else:
            raise IndexFormatError(
                url + INDEX_SUFFIX,
                "an eval split needs every shard's sample count: `wdsraft index SHARD` writes the index "
                "(or pass count_unindexed=True to read unindexed shards whole to count them)",
            )
    return counts, offsets


def split_range(total: int, part: int, parts: int) -> tuple[int, int]:
    """Part ``part`` of ``parts`` of ``range(total)``: contiguous, sizes differing by at most one."""
    return part * total // parts, (part + 1) * total // parts


class EvalSplit(UrlList, Stage):
    """The first stage of an eval pass: this rank's and worker's samples, as bounded shard entries."""

    def __init__(self, urls: Any, count_unindexed: bool = False):
        self.urls = expand_urls(urls) if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError(f"no shards match {urls!r}")
        # Once, here (workers get a copy); the sample offsets of unindexed shards, where they were counted.
        self.counts, self.unindexed = sample_counts(self.urls, count_unindexed)
        self._seeks: dict[tuple[str, int], int] = {}  # (url, ordinal) -> byte offset, read once per process

    def config(self) -> dict[str, Any]:
        return {"urls": self._urls_fingerprint, "num_urls": len(self.urls), "counts": fingerprint(self.counts)}

    def epoch_start_state(self) -> dict[str, Any]:
        return {}

    def samples_of(self, rank: int, world_size: int, worker: int = 0, num_workers: int = 1) -> tuple[int, int]:
        """The range of global sample numbers that ``worker`` of ``rank`` reads."""
        first, last = split_range(sum(self.counts), rank, world_size)
        low, high = split_range(last - first, worker, num_workers)
        return first + low, first + high

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        info = ctx.info
        return self._entries(*self.samples_of(info.rank, info.world_size, info.worker, info.num_workers))

    def _entries(self, first: int, last: int) -> Iterator[dict[str, Any]]:
        start = 0  # the global number of the current shard's first sample
        for url, count in zip(self.urls, self.counts, strict=True):
            low, high = max(first - start, 0), min(last - start, count)
            start += count
            if low >= high:
                continue
            offset = 0
            if low > 0 and url in self.unindexed:
                offset = self.unindexed[url][low]
            elif low > 0:  # (only the range's first shard: one seek)
                offset = self._seek(url, low, count)
            yield {"url": url, "offset": offset, "ordinal": low, "end": high}

    def _seek(self, url: str, ordinal: int, count: int) -> int:
        """The byte offset of sample ``ordinal`` of ``url``, from its index: read in the first pass only
        (the reader reads the index again, to check the shard against it, in every pass)."""
        offset = self._seeks.get((url, ordinal))
        if offset is None:
            index = ShardIndex.beside(url)
            if index is None or index.num_samples != count:
                raise IndexFormatError(url + INDEX_SUFFIX, "the index changed or went away since it was counted")
            offset = self._seeks[(url, ordinal)] = index.offset_of(ordinal)
        return offset

    def __iter__(self) -> Iterator[Any]:
        return self.run(Context(0, worker_info()), None, None)
