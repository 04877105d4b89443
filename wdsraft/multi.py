"""webdataset's ``multi`` module name (``MultiLoader``, over ZMQ), used as it is: it needs ``pyzmq``, as
webdataset's does, and is imported only when asked for (``import wdsraft.multi``), as webdataset's."""

from webdataset.multi import EOF, MultiLoader, all_pids, reader, the_protocol

__all__ = ["EOF", "MultiLoader", "all_pids", "reader", "the_protocol"]
