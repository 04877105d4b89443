"""webdataset's ``writer`` module name: ``TarWriter`` and ``ShardWriter`` (re-exports ``wdsraft.tar.writer``)."""

from webdataset.writer import make_encoder, numpy_dumps, torch_dumps

from wdsraft.tar.writer import ShardWriter, TarWriter

__all__ = ["ShardWriter", "TarWriter", "make_encoder", "numpy_dumps", "torch_dumps"]
