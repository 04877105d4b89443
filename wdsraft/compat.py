"""``WebDataset``, ``WebLoader`` and the fluent interface, checkpointable.

Same constructors, defaults, warnings and fluent methods as webdataset 1.0.2; with the same
seeds and no state loaded, the same samples in the same order. On top: ``state_dict()``,
``load_state_dict()`` and ``set_epoch()``; shard and sample shuffles that change every epoch
(epoch 0 is webdataset's order).
"""

from __future__ import annotations

import inspect
import os
import random
import warnings
from typing import Any
from urllib.parse import urlparse

from torchdata.stateful_dataloader import StatefulDataLoader
from webdataset import autodecode
from webdataset import shardlists as webdataset_shardlists
from webdataset.compat import FluidInterface as WebdatasetFluidInterface
from webdataset.compat import check_empty
from webdataset.handlers import reraise_exception

from wdsraft import filters, llm
from wdsraft.core.state import describe
from wdsraft.pipeline import caching, concat, interleave, parallel, toolbox
from wdsraft.pipeline.datapipeline import DataPipeline
from wdsraft.pipeline.decode import DecodeStage
from wdsraft.pipeline.ends import EvenEnds
from wdsraft.pipeline.loader import CheapSnapshotLoader, DieWithParent, LoaderSource, convert_batch
from wdsraft.pipeline.shardlists import ResampledShards, SimpleShardList, single_node_only, split_by_worker
from wdsraft.pipeline.source import TarfileToSamples

__all__ = [
    "ConcatenatedDatasets",
    "FluidInterface",
    "FluidWrapper",
    "InterleavedDatasets",
    "WebDataset",
    "WebLoader",
    "check_empty",
    "concat_datasets",
    "interleave_datasets",
]


class FluidInterface(WebdatasetFluidInterface):
    """webdataset's fluent methods; those that hold items between outputs are checkpointable here."""

    def batched(self, batchsize: int, collation_fn: Any = filters.default_collation_fn, partial: bool = True) -> Any:
        return self.compose(filters.batched(batchsize, collation_fn=collation_fn, partial=partial))

    def unbatched(self) -> Any:
        return self.compose(filters.unbatched())

    def listed(self, batchsize: int, partial: bool = True) -> Any:
        return self.compose(filters.batched(batchsize=batchsize, collation_fn=None))

    def unlisted(self) -> Any:
        return self.compose(filters.unlisted())

    def decode(
        self,
        *args: Any,
        pre: Any = None,
        post: Any = None,
        only: Any = None,
        partial: bool = False,
        handler: Any = reraise_exception,
    ) -> Any:
        """webdataset's ``decode``: the same ``Decoder`` and results, planned once per field name (``DecodeStage``)."""
        handlers = [autodecode.ImageHandler(x) if isinstance(x, str) else x for x in args]
        decoder = autodecode.Decoder(handlers, pre=pre, post=post, only=only, partial=partial)
        return self.compose(DecodeStage(decoder, handler=handler))

    def shuffle(self, size: int, **kw: Any) -> Any:
        if size < 1:
            return self
        return self.compose(filters.shuffle(size, **kw))

    def slice(self, *args: int | None) -> Any:
        return self.compose(filters.slice(*args))

    def rsample(self, p: float = 0.5) -> Any:
        return self.compose(filters.rsample(p))

    # -- the toolbox (epochraft's names) --

    def take(self, n: int) -> Any:
        return self.compose(toolbox.take(n))

    def stride(self, k: int, offset: int = 0) -> Any:
        return self.compose(toolbox.stride(k, offset))

    def enumerate(self, count_column: str = "step") -> Any:
        return self.compose(toolbox.enumerate(count_column))

    def cache(self, directory: Any = None) -> Any:
        return self.compose(caching.cache(directory))

    def parallel_map(
        self, fn: Any, max_workers: int | None = None, prefetch_factor: int = 10, executor: str = "thread"
    ) -> Any:
        return self.compose(parallel.parallel_map(fn, max_workers, prefetch_factor, executor))

    def parallel_filter_map(
        self, fn: Any, max_workers: int | None = None, prefetch_factor: int = 10, executor: str = "thread"
    ) -> Any:
        return self.compose(parallel.parallel_filter_map(fn, max_workers, prefetch_factor, executor))

    # -- LLM stages (epochraft's names) --

    def tokenize(
        self,
        tokenizer: Any,
        text: Any = "txt",
        batch_size: int = 64,
        num_threads: int | None = None,
        match_special_tokens: bool | None = None,
    ) -> Any:
        """Add ``input_ids``: the text (a field, ``"json:text"``, or a function) tokenized in batches."""
        return self.compose(llm.tokenize(tokenizer, text, batch_size, num_threads, match_special_tokens))

    def ensure_bos_eos(self, tokenizer: Any = None, bos_id: int | None = None, eos_id: int | None = None) -> Any:
        return self.compose(llm.ensure_bos_eos(tokenizer, bos_id=bos_id, eos_id=eos_id))

    def concat_chunk(self, length: int, pad_id: int = 0) -> Any:
        return self.compose(llm.ConcatChunk(length, pad_id))

    def chunk(self, length: int, drop_remainder: bool = True, pad_id: int = 0) -> Any:
        return self.compose(llm.Chunk(length, drop_remainder, pad_id))

    def pad(self, length: int, pad_id: int = 0) -> Any:
        return self.compose(llm.pad(length, pad_id))

    def pack_bestfit(self, length: int, buffer: int = 1024, pad_id: int = 0) -> Any:
        return self.compose(llm.PackBestFit(length, buffer, pad_id))


class WebDataset(DataPipeline, FluidInterface):
    """webdataset's ``WebDataset``: shard URLs -> split by node and worker -> shard shuffle -> samples.

    Checkpointable with ``state_dict()``/``load_state_dict()``. Without ``seed``, a random
    seed is drawn (as webdataset does) and carried in the state, so a restore into a
    fresh ``WebDataset`` built the same way continues with it. The shard order changes
    every epoch (epoch 0 is webdataset's); ``reshuffle_each_epoch=False`` keeps
    webdataset's same-order-every-epoch behaviour. Shards with an index are checked against
    it as they are read; ``verify=True`` also checks each sample's CRC-32 (see ``ShardSampleReader``).
    ``n_active_shards=k`` reads k of each worker's shards at once, a sample from each in turn (k open
    streams per worker; see docs/reading-and-writing.md, "Several shards at once").
    """

    def __init__(
        self,
        urls: Any,
        handler: Any = reraise_exception,
        mode: str | None = None,
        resampled: bool = False,
        repeat: bool = False,
        shardshuffle: Any = None,
        cache_size: int = -1,
        cache_dir: str | None = None,
        url_to_name: Any = None,
        detshuffle: bool = False,
        nodesplitter: Any = single_node_only,
        workersplitter: Any = split_by_worker,
        select_files: Any = None,
        rename_files: Any = None,
        empty_check: bool = True,
        verbose: bool = False,
        seed: Any = None,
        reshuffle_each_epoch: bool = True,
        verify: bool = False,
        n_active_shards: int = 1,
    ):
        super().__init__()
        if resampled:
            mode = "resampled"
        if mode == "resampled" and shardshuffle not in (False, None):
            warnings.warn("WebDataset(shardshuffle=...) is ignored for resampled datasets", stacklevel=2)
        elif shardshuffle is None:
            warnings.warn("WebDataset(shardshuffle=...) is None; set explicitly to False or a number", stacklevel=2)
        if shardshuffle is True:
            warnings.warn("set WebDataset(shardshuffle=...) to a positive integer or 0 or False", stacklevel=2)
            shardshuffle = 100
        cache_dir = os.environ.get("WDS_CACHE", cache_dir)
        if cache_dir is not None and int(os.environ.get("WDS_CACHE_SIZE", cache_size)) != 0:
            raise ValueError(
                "wdsraft.WebDataset does not cache shards (cache_dir/WDS_CACHE); it seeks inside remote shards "
                "instead. Drop cache_dir, or use webdataset.WebDataset for a local cache."
            )
        self.auto_seed = seed is None
        self.seed = os.environ.get("WDS_SEED", random.randint(0, 1000000)) if seed is None else seed
        self.shard_shuffle: filters.shuffle | None = None
        self._add_url_source(urls, mode)
        if nodesplitter is not None:
            self.append(nodesplitter)
        if workersplitter:
            self.append(workersplitter)
        if shardshuffle is not None:
            if detshuffle:
                self.shard_shuffle = filters.detshuffle(shardshuffle, seed=self.seed)
            else:
                self.shard_shuffle = filters.shuffle(
                    shardshuffle, seed=self.seed, reshuffle_each_epoch=reshuffle_each_epoch
                )
            self.append(self.shard_shuffle)
        self.append(
            TarfileToSamples(
                handler=handler,
                select_files=select_files,
                rename_files=rename_files,
                local_path=True,
                verify=verify,
                n_active_shards=n_active_shards,
            )
        )
        if empty_check:
            self.append(filters.check_empty())

    def _add_url_source(self, urls: Any, mode: str | None) -> None:
        if isinstance(urls, str) and urls.endswith((".yaml", ".yml")):
            self.append(webdataset_shardlists.MultiShardSample(urls))
        elif isinstance(urls, dict):
            assert "datasets" in urls
            self.append(webdataset_shardlists.MultiShardSample(urls))
        elif isinstance(urls, str) and urls.endswith(".json"):
            raise ValueError("unimplemented")
        elif isinstance(urls, str) and urlparse(urls).path.endswith("/"):
            self.append(webdataset_shardlists.DirectoryShardList(urls, mode=mode))
        elif mode == "resampled":
            self.append(ResampledShards(urls))
        else:
            self.append(SimpleShardList(urls))

    def config(self) -> dict[str, Any]:
        config = super().config()
        config["seed"] = "auto" if self.auto_seed else describe(self.seed)
        if self.auto_seed:  # the drawn seed travels in the state, not in the fingerprint
            for stage in config["stages"]:
                if isinstance(stage, dict) and stage.get("seed") == describe(self.seed):
                    stage["seed"] = "auto"
        return config

    def seed_record(self) -> dict[str, Any]:
        return {**super().seed_record(), "seed": self.seed}

    def adopt_seeds(self, record: dict[str, Any]) -> None:
        if self.auto_seed and "seed" in record:
            self._use_seed(record["seed"])
        super().adopt_seeds(record)

    def _use_seed(self, seed: Any) -> None:
        self.seed = seed
        if self.shard_shuffle is not None:  # (shuffle and detshuffle alike)
            self.shard_shuffle.seed = seed

    def __enter__(self) -> WebDataset:
        return self

    def __exit__(self, *args: Any) -> None:
        self.close()


class FluidWrapper(DataPipeline, FluidInterface):
    """A fluent pipeline around any source (webdataset's ``FluidWrapper``)."""

    def __init__(self, initial: Any):
        super().__init__()
        self.append(initial)


class InterleavedDatasets(interleave.Interleave, FluidInterface):
    """What :func:`interleave_datasets` returns: the mixture, with the fluent stages
    (``.shuffle()``, ``.tokenize()``, ``.batched()``...) that run on the mixed stream."""


class ConcatenatedDatasets(concat.ConcatDatasets, FluidInterface):
    """What :func:`concat_datasets` returns: the datasets one after another, with the fluent stages."""


def interleave_datasets(datasets: Any, weights: Any = None, **options: Any) -> InterleavedDatasets:
    mixture = interleave.interleave_datasets(datasets, weights, **options)
    return InterleavedDatasets(mixture.pipeline[0])


def concat_datasets(datasets: Any) -> ConcatenatedDatasets:
    return ConcatenatedDatasets(datasets)


interleave_datasets.__doc__ = interleave.interleave_datasets.__doc__
concat_datasets.__doc__ = concat.concat_datasets.__doc__


_WORKER_INIT_FN_POSITION = list(inspect.signature(StatefulDataLoader).parameters).index("worker_init_fn")


class WebLoader(DataPipeline, FluidInterface):
    """webdataset's ``WebLoader``, on torchdata's ``StatefulDataLoader``.

    Takes ``DataLoader``'s arguments. Fluent stages added to it (``.unbatched().shuffle(n)
    .batched(b).with_epoch(n)``) run in the training process and are checkpointed with the
    loader: ``state_dict()`` holds the loader's state (with each worker's dataset state)
    and theirs.

    ``even_ends="pad"|"shortest"`` (or an ``EvenEnds``) makes every rank take the same number of steps
    per epoch: the short ranks get ``None`` batches, or all ranks stop with the shortest (see
    ``wdsraft.pipeline.ends``). It stays the last stage, after fluent stages added later.
    """

    #: Least default of ``StatefulDataLoader``'s ``snapshot_every_n_steps`` (torchdata's is 1). A state
    #: taken between two snapshots restores by re-running the batches since the last one, so the interval
    #: bounds a restore's re-run; workers ship their state only with the batches around a snapshot step
    #: (``CheapSnapshotLoader``), so a short interval costs little.
    snapshot_every_n_steps = 32
    #: Steps of the default interval per worker: each worker re-runs at most this many batches.
    snapshot_steps_per_worker = 16

    def __init__(self, *args: Any, even_ends: str | EvenEnds | None = None, **kw: Any):
        given = inspect.signature(StatefulDataLoader).bind(*args, **kw).arguments
        if "batch_size" in given and given["batch_size"] is None and given.get("collate_fn") is None:
            kw["collate_fn"] = convert_batch
        if given.get("num_workers", 0) > 0:  # workers die with the rank, even one killed by SIGKILL
            wrapped = DieWithParent(given.get("worker_init_fn"))
            if len(args) > _WORKER_INIT_FN_POSITION:
                args = (*args[:_WORKER_INIT_FN_POSITION], wrapped, *args[_WORKER_INIT_FN_POSITION + 1 :])
            else:
                kw["worker_init_fn"] = wrapped
        if "snapshot_every_n_steps" not in given:
            kw["snapshot_every_n_steps"] = self.snapshot_interval(given.get("num_workers", 0))
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API on every construction
            warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")
            loader = CheapSnapshotLoader(*args, **kw)
        super().__init__(LoaderSource(loader))
        #: The last stage, kept last by ``append`` (fluent stages added later go before it), or None.
        self.even_ends = EvenEnds(even_ends) if isinstance(even_ends, str) else even_ends
        if self.even_ends is not None:
            self.pipeline.append(self.even_ends)

    def append(self, f: Any) -> None:
        ends = getattr(self, "even_ends", None)
        if ends is not None and self.pipeline and self.pipeline[-1] is ends:
            self.pipeline.insert(len(self.pipeline) - 1, f)
        else:
            super().append(f)

    @classmethod
    def snapshot_interval(cls, num_workers: int) -> int:
        """The default ``snapshot_every_n_steps``: ``snapshot_steps_per_worker`` steps per worker, at least
        ``snapshot_every_n_steps``. Whatever the ``prefetch_factor``, a restore from a state taken
        between two snapshots re-runs at most this many batches (about as many per worker; more only
        after a snapshot skipped when a worker ran out of data), and each worker ships its state with
        one batch per interval.
        """
        return max(cls.snapshot_every_n_steps, cls.snapshot_steps_per_worker * num_workers)

    @property
    def loader(self) -> StatefulDataLoader:
        return self.pipeline[0].loader

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # Persistent workers still running an older epoch are dropped: the next iter() starts new ones
        # from the loaded state (StatefulDataLoader does the same when it loads a state itself).
        self.loader.load_state_dict({})

    def seed_record(self) -> dict[str, Any]:
        # The dataset's own drawn seeds travel in every state, including one taken before the first
        # batch, so workers forked from a restored loader draw what the saved run drew.
        record = getattr(self.loader.dataset, "seed_record", None)
        return {**super().seed_record(), "dataset": record() if record is not None else None}

    def adopt_seeds(self, record: dict[str, Any]) -> None:
        super().adopt_seeds(record)
        adopt = getattr(self.loader.dataset, "adopt_seeds", None)
        if adopt is not None and record.get("dataset") is not None:
            adopt(record["dataset"])
