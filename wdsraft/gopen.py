"""webdataset's ``gopen`` module name: opening URLs (re-exports ``wdsraft.io``)."""

from webdataset.gopen import (
    PIPE,
    Pipe,
    gopen_ais,
    gopen_curl,
    gopen_error,
    gopen_file,
    gopen_gsutil,
    gopen_hf,
    gopen_htgs,
    gopen_pipe,
    gopen_schemes,
    info,
    reader,
    rewrite_url,
    set_options,
)

from wdsraft.io.compression import sniff_compression, uncompressed
from wdsraft.io.gopen import gopen, open_shard
from wdsraft.io.s3 import s3_client, s3_endpoint_url

__all__ = [
    "PIPE",
    "Pipe",
    "gopen",
    "gopen_ais",
    "gopen_curl",
    "gopen_error",
    "gopen_file",
    "gopen_gsutil",
    "gopen_hf",
    "gopen_htgs",
    "gopen_pipe",
    "gopen_schemes",
    "info",
    "open_shard",
    "reader",
    "rewrite_url",
    "s3_client",
    "s3_endpoint_url",
    "set_options",
    "sniff_compression",
    "uncompressed",
]
