"""JSONL to globally shuffled WebDataset shards: the library behind ``wdsraft convert``.

A two-pass external shuffle whose memory follows a budget, whatever the corpus size:

1. **scatter** -- each input file (a *unit* of work) is read line by line. Every record gets
   a 64-bit random key computed from (seed, input name, line number) alone, and belongs to
   the bucket that holds that key's range (bucket ``b`` of ``N`` holds keys in
   ``[b, b + 1) * 2**64 / N``). Records are buffered per bucket and spilled to the unit's
   data file whenever the buffer reaches the memory budget; the file ends with a table of
   where each bucket's pieces lie.
2. **write** -- each bucket is read back from every unit's data file and sorted by key (in
   memory, or in key slices when it is larger than the budget). Concatenating the buckets'
   sorted records gives every record of the corpus sorted by a random key: a uniform global
   shuffle. Record ``r`` of that order goes to shard ``r // samples_per_shard``; the scatter
   counts tell each bucket where its records fall, so buckets are written independently (a
   shard straddling two buckets is written by the job of the later one, which reads the
   earlier part from the scatter data). The output depends only on the inputs, the seed and
   the layout options -- not on the number of buckets, workers, tasks or processing order.
3. **finalize** -- checks the books (records read = samples written + records rejected, per
   input) and writes ``manifest.json`` and ``rejects.jsonl``.

Progress lives in a work directory (``--workdir``) as atomically written done-files, so a
rerun after a crash or a preemption redoes only the units and buckets that had not finished.

The package follows the phases, one module each: ``options`` (what a conversion takes),
``keys`` and ``inputs`` (what it reads), ``lines`` and ``records`` (input lines -> samples),
``scatter`` (pass 1), ``workdir`` (the plan and the files between the passes), ``buckets`` and
``shards`` (pass 2), ``finalizer`` (pass 3), ``jobs`` and ``events`` (running the jobs),
``report`` and ``converter`` (one task's run). It imports ``wdsraft.core``, ``wdsraft.io``,
``wdsraft.index`` and ``wdsraft.tar`` only: never the pipeline (`wdsraft convert` needs no torch).
"""

from wdsraft.convert.buckets import ShardLayout
from wdsraft.convert.converter import convert
from wdsraft.convert.inputs import InputFile, expand_inputs
from wdsraft.convert.inputs import _name_inputs as _name_inputs
from wdsraft.convert.keys import tar_safe_key
from wdsraft.convert.lines import LineReader
from wdsraft.convert.options import (
    DEFAULT_SAMPLES_PER_SHARD,
    FORMATS,
    PHASES,
    ConvertError,
    ConvertOptions,
    default_workers,
    parse_size,
    slurm_array_task,
)
from wdsraft.convert.records import BadRecord
from wdsraft.convert.report import ConvertReport, InputReport
from wdsraft.tar.assembler import ShardAssembler as ShardAssembler
from wdsraft.tar.format import HeaderBuilder as HeaderBuilder

__all__ = [
    "DEFAULT_SAMPLES_PER_SHARD",
    "FORMATS",
    "PHASES",
    "BadRecord",
    "ConvertError",
    "ConvertOptions",
    "ConvertReport",
    "InputFile",
    "InputReport",
    "LineReader",
    "ShardLayout",
    "convert",
    "default_workers",
    "expand_inputs",
    "parse_size",
    "slurm_array_task",
    "tar_safe_key",
]
