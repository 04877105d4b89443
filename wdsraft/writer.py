"""webdataset's ``writer`` module name: ``TarWriter`` and ``ShardWriter`` (re-exports ``wdsraft.tar.writer``)."""

from webdataset.writer import (
    add_handlers,
    bytestr,
    cbor_dumps,
    default_handlers,
    encode_based_on_extension,
    encode_based_on_extension1,
    imageencoder,
    make_encoder,
    make_handlers,
    mp_dumps,
    numpy_dumps,
    numpy_npz_dumps,
    tenbin_dumps,
    torch_dumps,
)

from wdsraft.tar.writer import ShardWriter, TarWriter

__all__ = [
    "ShardWriter",
    "TarWriter",
    "add_handlers",
    "bytestr",
    "cbor_dumps",
    "default_handlers",
    "encode_based_on_extension",
    "encode_based_on_extension1",
    "imageencoder",
    "make_encoder",
    "make_handlers",
    "mp_dumps",
    "numpy_dumps",
    "numpy_npz_dumps",
    "tenbin_dumps",
    "torch_dumps",
]
