"""webdataset's exception handlers, reused as they are (``wdsraft.handlers`` mirrors ``webdataset.handlers``)."""

from webdataset.handlers import (
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)

__all__ = ["ignore_and_continue", "ignore_and_stop", "reraise_exception", "warn_and_continue", "warn_and_stop"]
