"""webdataset's ``shardlists`` module name: shard lists and splitting (re-exports ``wdsraft.pipeline.shardlists``)."""

from webdataset.shardlists import (
    DirectoryShardList,
    MultiShardSample,
    envlookup,
    envsubst,
    expand_source,
    expand_urls,
    non_empty,
    resampled,
    shardspec,
)

from wdsraft.pipeline.shardlists import (
    ResampledShardList,
    ResampledShards,
    SimpleShardList,
    single_node_only,
    split_by_node,
    split_by_worker,
)

__all__ = [
    "DirectoryShardList",
    "MultiShardSample",
    "ResampledShardList",
    "ResampledShards",
    "SimpleShardList",
    "envlookup",
    "envsubst",
    "expand_source",
    "expand_urls",
    "non_empty",
    "resampled",
    "shardspec",
    "single_node_only",
    "split_by_node",
    "split_by_worker",
]
