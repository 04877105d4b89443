"""Checkpointable streams: the stage contract, ``DataPipeline``, the tar source, shard lists and the
buffering stages (shuffle, batch, slice). Also webdataset's ``pipeline`` module name (``DataPipeline``).

torch and torchdata are used from this layer up. Imports ``wdsraft.core``, ``io``, ``index`` and ``tar``;
never ``wdsraft.llm`` or ``wdsraft.ledger``, which plug into the hooks it opens.
"""

from webdataset.utils import PipelineStage

from wdsraft.pipeline.addresses import Address, pack_addresses, unpack_addresses
from wdsraft.pipeline.datapipeline import DataPipeline, add_length_method, state_epoch
from wdsraft.pipeline.stage import AddressTracker, Context, SourceStage, Stage, invoke_stage

__all__ = [
    "Address",
    "AddressTracker",
    "Context",
    "DataPipeline",
    "PipelineStage",
    "SourceStage",
    "Stage",
    "add_length_method",
    "invoke_stage",
    "pack_addresses",
    "state_epoch",
    "unpack_addresses",
]
