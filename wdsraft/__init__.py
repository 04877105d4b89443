"""wdsraft: a drop-in for webdataset with positions, indexes and exact, checkpointable resume.

``import wdsraft as wds`` gives webdataset 1.0.2's names. Stages that hold items between
outputs (shard lists, the tar reader, shuffles, batching, ``WebLoader``) are wdsraft's own
and checkpointable; stateless ones (decoders, ``map``, ``to_tuple``...) are webdataset's.
"""

from __future__ import annotations

import logging

from webdataset import tenbin, utils
from webdataset.autodecode import (
    Continue,
    Decoder,
    DecodingError,
    gzfilter,
    handle_extension,
    imagehandler,
    pytorch_weights_only,
    torch_audio,
    torch_loads,
    torch_video,
)
from webdataset.cache import LRUCleanup, pipe_cleaner
from webdataset.extradatasets import MockDataset, with_epoch, with_length
from webdataset.gopen import gopen_schemes
from webdataset.handlers import (
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)
from webdataset.utils import PipelineStage, repeatedly
from webdataset.writer import numpy_dumps, torch_dumps

from wdsraft import autodecode, cache, extradatasets, handlers, llm, mix, pytorch, typecheck  # noqa: F401 - submodules
from wdsraft.compat import (
    ConcatenatedDatasets,
    FluidInterface,
    FluidWrapper,
    InterleavedDatasets,
    WebDataset,
    WebLoader,
    concat_datasets,
    interleave_datasets,
)
from wdsraft.core import distributed  # noqa: F401 - submodule, as before the move
from wdsraft.core.errors import (
    IndexFormatError,
    LedgerError,
    RankFailedError,
    RemoteAccessDeniedError,
    RemoteNotFoundError,
    RemoteReadError,
    ShardIntegrityError,
    StateMismatchError,
    TarFormatError,
)
from wdsraft.core.fields import Position
from wdsraft.evaluation import EvalDataset
from wdsraft.filters import (
    Cached,
    LMDBCached,
    associate,
    batched,
    decode,
    detshuffle,
    extract_keys,
    getfirst,
    info,
    map,
    map_dict,
    map_tuple,
    pipelinefilter,
    rename,
    rename_keys,
    rsample,
    select,
    shuffle,
    slice,
    to_tuple,
    transform_with,
    unbatched,
    unlisted,
    xdecode,
)
from wdsraft.gopen import gopen, open_shard
from wdsraft.index import Manifest, ShardIndex
from wdsraft.ledger.consumed import ConsumedSet
from wdsraft.ledger.ledger import Ledger
from wdsraft.llm.bos_eos import ensure_bos_eos
from wdsraft.llm.chunking import chunk, concat_chunk, pad
from wdsraft.llm.collate import collate_sequences
from wdsraft.llm.pack import pack_bestfit
from wdsraft.llm.tokenize_stage import tokenize
from wdsraft.llm.tokenizers import as_tokenizer
from wdsraft.mix import RandomMix, RoundRobin
from wdsraft.pipeline import DataPipeline, Stage

# the LLM dataset toolbox (epochraft's names), checkpointable; ``wds.cache`` stays webdataset's module, and
# ``enumerate`` is left out of __all__ (a star import would hide the builtin)
from wdsraft.pipeline.caching import cache as cache_samples
from wdsraft.pipeline.concat import ConcatDatasets
from wdsraft.pipeline.ends import EvenEnds, even_ends, until_all_ranks_end
from wdsraft.pipeline.interleave import Interleave
from wdsraft.pipeline.parallel import parallel_filter_map, parallel_map
from wdsraft.pipeline.toolbox import enumerate, stride, take  # noqa: F401 - enumerate: see above
from wdsraft.shardlists import (
    MultiShardSample,
    ResampledShards,
    SimpleShardList,
    non_empty,
    resampled,
    shardspec,
    single_node_only,
    split_by_node,
    split_by_worker,
)
from wdsraft.tar.indexer import build_index
from wdsraft.tariterators import ShardSampleReader, TarfileToSamples, tarfile_samples, tarfile_to_samples
from wdsraft.writer import ShardWriter, TarWriter

__version__ = "0.1.0"

__all__ = [
    "Cached",
    "ConcatDatasets",
    "ConcatenatedDatasets",
    "ConsumedSet",
    "Continue",
    "DataPipeline",
    "Decoder",
    "DecodingError",
    "EvalDataset",
    "EvenEnds",
    "FluidInterface",
    "FluidWrapper",
    "IndexFormatError",
    "Interleave",
    "InterleavedDatasets",
    "LMDBCached",
    "LRUCleanup",
    "Ledger",
    "LedgerError",
    "Manifest",
    "MockDataset",
    "MultiShardSample",
    "PipelineStage",
    "Position",
    "RandomMix",
    "RankFailedError",
    "RemoteAccessDeniedError",
    "RemoteNotFoundError",
    "RemoteReadError",
    "ResampledShards",
    "RoundRobin",
    "ShardIndex",
    "ShardIntegrityError",
    "ShardSampleReader",
    "ShardWriter",
    "SimpleShardList",
    "Stage",
    "StateMismatchError",
    "TarFormatError",
    "TarWriter",
    "TarfileToSamples",
    "WebDataset",
    "WebLoader",
    "as_tokenizer",
    "associate",
    "batched",
    "build_index",
    "cache_samples",
    "chunk",
    "collate_sequences",
    "concat_chunk",
    "concat_datasets",
    "decode",
    "detshuffle",
    "ensure_bos_eos",
    "even_ends",
    "extract_keys",
    "getfirst",
    "gopen",
    "gopen_schemes",
    "gzfilter",
    "handle_extension",
    "ignore_and_continue",
    "ignore_and_stop",
    "imagehandler",
    "info",
    "interleave_datasets",
    "map",
    "map_dict",
    "map_tuple",
    "non_empty",
    "numpy_dumps",
    "open_shard",
    "pack_bestfit",
    "pad",
    "parallel_filter_map",
    "parallel_map",
    "pipe_cleaner",
    "pipelinefilter",
    "pytorch_weights_only",
    "rename",
    "rename_keys",
    "repeatedly",
    "reraise_exception",
    "resampled",
    "rsample",
    "select",
    "shardspec",
    "shuffle",
    "single_node_only",
    "slice",
    "split_by_node",
    "split_by_worker",
    "stride",
    "take",
    "tarfile_samples",
    "tarfile_to_samples",
    "tenbin",
    "to_tuple",
    "tokenize",
    "torch_audio",
    "torch_dumps",
    "torch_loads",
    "torch_video",
    "transform_with",
    "unbatched",
    "unlisted",
    "until_all_ranks_end",
    "utils",
    "warn_and_continue",
    "warn_and_stop",
    "with_epoch",
    "with_length",
    "xdecode",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
