"""webdataset's ``shardlists`` module name: shard lists and splitting (re-exports ``wdsraft.pipeline.shardlists``)."""

from webdataset.shardlists import (
    DirectoryShardList,
    MSSource,
    MultiShardSample,
    check_pid_is_running,
    default_rng,
    envlookup,
    envsubst,
    expand,
    expand_source,
    expand_urls,
    get_pid_from_filename,
    non_empty,
    resampled,
    resampled_,
    shardspec,
    without_last_extension,
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
    "MSSource",
    "MultiShardSample",
    "ResampledShardList",
    "ResampledShards",
    "SimpleShardList",
    "check_pid_is_running",
    "default_rng",
    "envlookup",
    "envsubst",
    "expand",
    "expand_source",
    "expand_urls",
    "get_pid_from_filename",
    "non_empty",
    "resampled",
    "resampled_",
    "shardspec",
    "single_node_only",
    "split_by_node",
    "split_by_worker",
    "without_last_extension",
]
