"""webdataset's ``tariterators`` module name: the tar readers (``wdsraft.tar``) and the checkpointable
source stage ``TarfileToSamples`` (``tarfile_to_samples``, from ``wdsraft.pipeline.source``)."""

from webdataset.handlers import reraise_exception
from webdataset.tariterators import (
    base_plus_ext,
    group_by_keys,
    meta_prefix,
    meta_suffix,
    shardlist,
    trace,
    valid_sample,
)

from wdsraft.pipeline.source import TarfileToSamples, tarfile_to_samples
from wdsraft.tar.naming import is_meta_member, split_key
from wdsraft.tar.reader import ShardSampleReader, tarfile_samples
from wdsraft.tar.webdataset_io import tar_file_expander, tar_file_iterator, url_opener

__all__ = [
    "ShardSampleReader",
    "TarfileToSamples",
    "base_plus_ext",
    "group_by_keys",
    "is_meta_member",
    "meta_prefix",
    "meta_suffix",
    "reraise_exception",
    "shardlist",
    "split_key",
    "tar_file_expander",
    "tar_file_iterator",
    "tarfile_samples",
    "tarfile_to_samples",
    "trace",
    "url_opener",
    "valid_sample",
]
