"""The shard list of an evaluation pass: every sample exactly once across ranks x workers, split by
samples (not by shards), from the sample counts of a manifest (one read) or of the shards' indexes
(one read per shard).

The samples of all shards, in the order given, are numbered 0..N-1. Rank r of R takes the range
``[r*N//R, (r+1)*N//R)`` (ranks differ by at most one sample), and worker w of its W workers the
same cut of the rank's range. A range becomes bounded shard entries ``{"url", "offset", "ordinal",
"end", "nsamples"}`` for ``TarfileToSamples``: it starts inside at most one shard (``"offset": None``:
the reader seeks there by the index it reads anyway), and the reader refuses a shard whose index
no longer has the ``nsamples`` the split counted (a stale manifest, a shard rewritten since).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from webdataset.shardlists import expand_urls

from wdsraft.core.distributed import rank_and_world_size, worker_info
from wdsraft.core.errors import IndexFormatError
from wdsraft.core.fields import OFFSET_FIELD
from wdsraft.core.state import fingerprint
from wdsraft.index.manifest import Manifest
from wdsraft.index.shard_index import INDEX_SUFFIX, ShardIndex
from wdsraft.io.storage import is_s3, local_path
from wdsraft.io.threads import map_in_threads
from wdsraft.pipeline.shardlists import UrlList
from wdsraft.pipeline.stage import Context, Stage
from wdsraft.tar.reader import ShardSampleReader

__all__ = ["EvalSplit", "manifest_counts", "sample_counts", "split_range"]

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


def manifest_counts(manifest_url: str) -> tuple[list[str], list[int]]:
    """The shard URLs (resolved against the manifest's location) and their sample counts, from a manifest:
    one read, whatever the number of shards. The counts are checked later, against each shard's index
    as the reader opens it."""
    manifest = Manifest.load(manifest_url)
    return manifest.urls(manifest_url), [entry.num_samples for entry in manifest.shards]


def split_range(total: int, part: int, parts: int) -> tuple[int, int]:
    """Part ``part`` of ``parts`` of ``range(total)``: contiguous, sizes differing by at most one."""
    return part * total // parts, (part + 1) * total // parts


class EvalSplit(UrlList, Stage):
    """The first stage of an eval pass: this rank's and worker's samples, as bounded shard entries."""

    def __init__(self, urls: Any, count_unindexed: bool = False):
        urls = os.fspath(urls) if isinstance(urls, os.PathLike) else urls
        #: The sample offsets of shards counted by reading them whole (no index), for the seeks.
        self.unindexed: dict[str, list[int]] = {}
        if isinstance(urls, str) and urls.endswith(".json"):  # a manifest, as wids takes its shard index
            if count_unindexed:
                raise ValueError(
                    f"{urls}: a manifest gives the counts, and the reader checks each against the shard's index: "
                    "count_unindexed has nothing to count (pass the shard URLs to count shards without an index)"
                )
            self.urls, self.counts = manifest_counts(urls)
            if not self.urls:
                raise ValueError(f"{urls}: the manifest lists no shards")
            unchecked = [url for url in self.urls if local_path(url) is None and not is_s3(url)]
            if unchecked:  # (no index is looked up there: every one of them would be refused as it opens)
                more = f" (and {len(unchecked) - 1} more)" if len(unchecked) > 1 else ""
                raise ValueError(
                    f"{urls}: {unchecked[0]}{more} is neither local nor on S3, where the "
                    "reader finds the index to check the manifest's count against; pass the shard URLs with "
                    "count_unindexed=True to count such shards by reading them"
                )
            return
        self.urls = expand_urls(urls) if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError(f"no shards match {urls!r}")
        self.counts, self.unindexed = sample_counts(self.urls, count_unindexed)  # (once, here: workers get a copy)

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
        total = sum(self.counts)
        start = 0  # the global number of the current shard's first sample
        for url, count in zip(self.urls, self.counts, strict=True):
            low, high = max(first - start, 0), min(last - start, count)
            here, start = start, start + count
            if low < high:
                yield self._entry(url, low, high, count)
            elif count == 0 and url not in self.unindexed and (first <= here < last or here == last == total):
                # A shard counted empty is in no range: the range at its place still has its index's count
                # checked (a stale manifest's 0 would otherwise skip a shard unseen).
                yield self._entry(url, 0, 0, 0)

    def _entry(self, url: str, low: int, high: int, count: int) -> dict[str, Any]:
        """The shard entry for ``TarfileToSamples``: samples ``low..high-1`` of ``url``."""
        if url in self.unindexed:  # (counted by reading it: its offsets are here, and no index to check)
            return {"url": url, "offset": self.unindexed[url][low], "ordinal": low, "end": high}
        # The reader reads the index anyway: it seeks by it ("offset": None, the range's first shard only)
        # and refuses the shard if its count is no longer the one this split used.
        return {"url": url, "offset": None if low else 0, "ordinal": low, "end": high, "nsamples": count}

    def __iter__(self) -> Iterator[Any]:
        return self.run(Context(0, worker_info()), None, None)
