"""What the side files are: a shard's index (``SHARD.idx``) and the dataset manifest (``manifest.json``).

Formats only, as plain data; building an index from a shard is ``wdsraft.tar.indexer``.
Imports ``wdsraft.core`` and ``wdsraft.io``.
"""

from wdsraft.index.manifest import MANIFEST_NAME, Manifest, ManifestEntry, manifest_for
from wdsraft.index.shard_index import INDEX_SUFFIX, ShardIndex

__all__ = ["INDEX_SUFFIX", "MANIFEST_NAME", "Manifest", "ManifestEntry", "ShardIndex", "manifest_for"]
