"""Shard lists and splitting, as webdataset's, as deterministic functions of (seed, epoch, rank, worker).

Everything upstream of the tar reader is replayed from the start of the epoch on restore
(the reader then skips the shards it had already begun), so these stages only need to
produce the same URLs again: their state is the seed they actually used.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from torch.utils.data import IterableDataset
from webdataset.shardlists import expand_source, expand_urls
from webdataset.utils import make_seed as webdataset_make_seed

from wdsraft.core.distributed import pytorch_worker_seed, worker_info
from wdsraft.core.state import describe, fingerprint
from wdsraft.pipeline.stage import Context, Stage


def split_by_node(src: Iterator[Any], group: object = None) -> Iterator[Any]:
    """Every ``world_size``-th shard, starting at this rank (torch.distributed, RANK/WORLD_SIZE or SLURM)."""
    info = worker_info(group)
    if info.world_size > 1:
        yield from islice(src, info.rank, None, info.world_size)
    else:
        yield from src


def single_node_only(src: Iterator[Any], group: object = None) -> Iterator[Any]:
    if worker_info(group).world_size > 1:
        raise ValueError("you need to add an explicit nodesplitter to your input pipeline for multi-node training")
    yield from src


def split_by_worker(src: Iterator[Any]) -> Iterator[Any]:
    """Every ``num_workers``-th shard, starting at this DataLoader worker."""
    info = worker_info()
    if info.num_workers > 1:
        yield from islice(src, info.worker, None, info.num_workers)
    else:
        yield from src


class UrlList:
    """A source stage with a fixed list of shard URLs."""

    urls: list[str]

    @functools.cached_property
    def _urls_fingerprint(self) -> str:  # (once: configurations are described every epoch, in every worker)
        return fingerprint(self.urls)


class SimpleShardList(UrlList, IterableDataset, Stage):
    """A fixed list of shard URLs (brace patterns expanded), optionally shuffled with ``seed`` as webdataset does."""

    def __init__(self, urls: Any, seed: Any = None):
        super().__init__()
        self.urls = expand_urls(urls) if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError(f"no shards match {urls!r}")
        assert isinstance(self.urls[0], str)
        self.seed = time.time() if seed is True else seed

    def __len__(self) -> int:
        return len(self.urls)

    def config(self) -> dict[str, Any]:
        return {"urls": self._urls_fingerprint, "num_urls": len(self.urls), "seed": describe(self.seed)}

    def epoch_start_state(self) -> dict[str, Any]:
        return {}

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        urls = self.urls.copy()
        if self.seed is not None:
            random.Random(self.seed).shuffle(urls)
        return ({"url": url} for url in urls)

    def __iter__(self) -> Iterator[Any]:
        return self.run(Context(0, worker_info()), None, None)


class ResampledShards(UrlList, IterableDataset, Stage):
    """An endless stream of shards drawn with replacement, as webdataset's.

    With ``deterministic=True`` the draws are a function of (worker seed, epoch, seed),
    the same numbers webdataset uses; otherwise fresh entropy seeds each epoch and the
    seed drawn is kept in the state, so a restore replays the same draws.
    """

    draws_with_replacement = True  # (a sample may come twice in an epoch: the ledger does not refuse that)

    def __init__(
        self,
        urls: Any,
        nshards: int = sys.maxsize,
        seed: int = 0,
        worker_seed: Callable[[], int] | None = None,
        deterministic: bool = False,
        max_urls: int = int(1e6),
        empty_check: bool = True,
    ):
        super().__init__()
        self.urls = expand_source(urls, max_urls)
        if empty_check and len(self.urls) == 0:
            raise ValueError("empty_check=True, but no shards found in ResampledShards")
        assert isinstance(self.urls[0], str)
        self.nshards = nshards
        self.worker_seed = pytorch_worker_seed if worker_seed is None else worker_seed
        self.deterministic = deterministic
        self.seed = seed
        self.epoch = -1
        # Not deterministic: entropy drawn once here (webdataset draws pid, clock and urandom at every
        # run); it travels in the state, so a restored pipeline draws the same shards.
        self._drawn = None if deterministic else int.from_bytes(os.urandom(8), "little") ^ time.time_ns()

    def config(self) -> dict[str, Any]:
        return {
            "urls": self._urls_fingerprint,
            "num_urls": len(self.urls),
            "nshards": self.nshards,
            "seed": self.seed,
            "deterministic": self.deterministic,
        }

    def epoch_start_state(self) -> dict[str, Any]:
        return {}

    def drawn_seed(self) -> Any:
        return self._drawn

    def adopt_seed(self, seed: Any) -> None:
        if not self.deterministic:
            self._drawn = seed

    def run(self, ctx: Context, src: Iterator[Any] | None, state: dict[str, Any] | None) -> Iterator[Any]:
        self.epoch = ctx.epoch
        if self.deterministic:
            seed = webdataset_make_seed(self.worker_seed(), self.epoch, self.seed)
        else:
            seed = webdataset_make_seed(self.worker_seed(), self.epoch, self.seed, self._drawn)
        return self._draw(random.Random(seed))

    def _draw(self, rng: random.Random) -> Iterator[Any]:
        for _ in range(self.nshards):
            yield {"url": self.urls[rng.randint(0, len(self.urls) - 1)]}

    def __iter__(self) -> Iterator[Any]:
        return self.run(Context(self.epoch + 1, worker_info()), None, None)


ResampledShardList = ResampledShards
