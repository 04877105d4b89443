"""Tar shards: the byte format, members with offsets, samples grouped by webdataset's rules,
random access through an index, building an index, and writing shards.

Imports ``wdsraft.core``, ``wdsraft.io`` and ``wdsraft.index``; never the pipeline.
"""
