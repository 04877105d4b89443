"""Bytes by URL: open local, ``s3://``, HTTP and ``pipe:`` URLs at an offset, decompress, write atomically.

Imports only ``wdsraft.core``.
"""
