"""The extent table at the end of a scatter data file (and of a keys file): for each bucket, where its
segments lie, and a footer pointing at the table."""

from __future__ import annotations

import os
import struct
from typing import IO

import numpy as np

from wdsraft.convert.options import ConvertError

_FOOTER = struct.Struct("<QQ8s")  # extent table offset, bucket count, magic
_FOOTER_MAGIC = b"WDSRSCT1"
_EXTENT = np.dtype([("offset", "<u8"), ("count", "<u8"), ("length", "<u8")])


def write_extent_table(stream: IO[bytes], extents: list[tuple[int, int, int, int]], buckets: int, offset: int) -> int:
    """Append the table of ``extents`` (bucket, offset, count, length; in spill order) and the footer to a
    file whose segments end at ``offset``; returns the file's size."""
    order = sorted(range(len(extents)), key=lambda i: extents[i][0])  # stable: spill order kept
    table = np.zeros(len(order), dtype=_EXTENT)
    starts = np.zeros(buckets + 1, dtype=np.uint64)
    for row, i in enumerate(order):
        bucket, at, count, length = extents[i]
        table[row] = (at, count, length)
        starts[bucket + 1] += 1
    starts = np.cumsum(starts, dtype=np.uint64)
    stream.write(starts.astype("<u8").tobytes())
    stream.write(table.tobytes())
    stream.write(_FOOTER.pack(offset, buckets, _FOOTER_MAGIC))
    return offset + starts.nbytes + table.nbytes + _FOOTER.size


def read_extents(path: str, bucket: int, size: int | None = None) -> np.ndarray:
    """The segments of ``bucket`` in a unit data file (an array of offset, count, length)."""
    if size is not None and os.path.getsize(path) != size:
        raise ConvertError(
            f"{path}: {os.path.getsize(path)} bytes, {size} expected (torn by a crash?): remove it and its "
            ".done file, and rerun the scatter phase"
        )
    with open(path, "rb") as handle:
        handle.seek(-_FOOTER.size, os.SEEK_END)
        table_offset, buckets, magic = _FOOTER.unpack(handle.read(_FOOTER.size))
        if magic != _FOOTER_MAGIC or not 0 <= bucket < buckets:
            raise ConvertError(f"{path}: not a scatter data file of this conversion (torn or foreign)")
        handle.seek(table_offset + 8 * bucket)
        first, last = struct.unpack("<QQ", handle.read(16))
        handle.seek(table_offset + 8 * (buckets + 1) + _EXTENT.itemsize * first)
        return np.frombuffer(handle.read(_EXTENT.itemsize * (last - first)), dtype=_EXTENT)
