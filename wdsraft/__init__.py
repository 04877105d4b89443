"""wdsraft: WebDataset-compatible tar shards with positions, indexes and exact resume."""

from __future__ import annotations

import logging

from webdataset.handlers import (
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)

from .errors import IndexFormatError, TarFormatError
from .gopen import gopen, open_shard
from .index import Manifest, ShardIndex, build_index
from .positions import Position
from .tariterators import ShardSampleReader, tarfile_samples, tarfile_to_samples
from .writer import ShardWriter, TarWriter

__version__ = "0.1.0"

__all__ = [
    "IndexFormatError",
    "Manifest",
    "Position",
    "ShardIndex",
    "ShardSampleReader",
    "ShardWriter",
    "TarFormatError",
    "TarWriter",
    "build_index",
    "gopen",
    "ignore_and_continue",
    "ignore_and_stop",
    "open_shard",
    "reraise_exception",
    "tarfile_samples",
    "tarfile_to_samples",
    "warn_and_continue",
    "warn_and_stop",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
