"""webdataset's ``gopen`` module name: opening URLs (re-exports ``wdsraft.io``)."""

from webdataset.gopen import Pipe, gopen_schemes, rewrite_url

from wdsraft.io.compression import sniff_compression, uncompressed
from wdsraft.io.gopen import gopen, open_shard
from wdsraft.io.s3 import s3_client, s3_endpoint_url

__all__ = [
    "Pipe",
    "gopen",
    "gopen_schemes",
    "open_shard",
    "rewrite_url",
    "s3_client",
    "s3_endpoint_url",
    "sniff_compression",
    "uncompressed",
]
