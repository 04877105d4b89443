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
"""

from __future__ import annotations

import base64
import bz2
import collections
import contextlib
import glob
import hashlib
import json
import logging
import lzma
import math
import mmap
import multiprocessing
import os
import posixpath
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import IO, Any, TypeVar
from urllib.parse import urlparse

import braceexpand
import msgpack
import numpy as np
import zstandard

from wdsraft.core.errors import IndexFormatError
from wdsraft.index.manifest import MANIFEST_NAME, Manifest, ManifestEntry
from wdsraft.index.shard_index import INDEX_SUFFIX, ShardIndex
from wdsraft.io.compression import sniff_compression
from wdsraft.io.gopen import gopen
from wdsraft.io.s3 import s3_client, s3_endpoint_url, s5cmd_binary
from wdsraft.io.storage import abort_write, is_s3, local_path, open_atomic, remove, write_bytes_atomic
from wdsraft.tar.format import HeaderBuilder, end_of_archive

__all__ = [
    "BadRecord",
    "ConvertError",
    "ConvertOptions",
    "ConvertReport",
    "InputReport",
    "convert",
    "expand_inputs",
    "parse_size",
    "tar_safe_key",
]

logger = logging.getLogger(__name__)

FORMAT_TXT_JSON = "txt+json"
FORMAT_MSGPACK = "msgpack"
FORMATS = (FORMAT_TXT_JSON, FORMAT_MSGPACK)
PHASES = ("all", "scatter", "write", "finalize")
BAD_RECORD_POLICIES = ("error", "skip")
DEFAULT_SAMPLES_PER_SHARD = 10_000
DEFAULT_MEMORY = 1 << 30
SHARD_MTIME = 0  # a fixed mtime: the same inputs give byte-identical shards
REJECTS_NAME = "rejects.jsonl"
PLAN_FORMAT = "wdsraft-convert-plan"
PLAN_VERSION = 1
# A bucket is planned at half a worker's share of --memory.
BUCKET_FRACTION = 2
MAX_BUCKETS = 1 << 20
# Assumed expansion of compressed inputs whose uncompressed size their header does not tell.
_ASSUMED_RATIO = {"gzip": 4, "zstd": 5, "bz2": 5, "xz": 6}
_COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
_DATA_SUFFIXES = (".jsonl", ".ndjson", ".json")
_UTF8_BOM = b"\xef\xbb\xbf"


class ConvertError(Exception):
    """A conversion cannot go on: bad input (in ``error`` mode), bad options, a workdir from another run..."""


class BadRecord(Exception):
    """One input record cannot become a sample; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# Options


def parse_size(text: str | int) -> int:
    """``'256M'``, ``'2G'``, ``'1.5GiB'``, ``'4096'`` -> bytes (binary units: 1K = 1024)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 512M, 2G, 1048576)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def slurm_array_task() -> tuple[int, int] | None:
    """(task index, task count) of a SLURM job array task, from its environment; None outside one."""
    task_id = os.environ.get("SLURM_ARRAY_TASK_ID")
    count = os.environ.get("SLURM_ARRAY_TASK_COUNT")
    if task_id is None or count is None:
        return None
    first = int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))
    step = int(os.environ.get("SLURM_ARRAY_TASK_STEP", "1") or 1)  # --array=0-14:2
    return (int(task_id) - first) // step, int(count)


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))  # honours SLURM's CPU binding
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass
class ConvertOptions:
    """Everything ``wdsraft convert`` takes; see ``wdsraft convert --help``."""

    inputs: Sequence[str]
    output: str
    workdir: str | None = None
    seed: int = 0
    memory: int = DEFAULT_MEMORY
    samples_per_shard: int | None = None
    shard_size: int | None = None
    text_field: str = "text"
    id_field: str | None = None
    format: str = FORMAT_TXT_JSON
    on_bad_record: str = "error"
    workers: int = 1
    task_index: int = 0
    task_count: int = 1
    phase: str = "all"
    name: str | None = None
    buckets: int | None = None
    keep_workdir: bool = False
    overwrite: bool = False
    wait_timeout: float | None = None
    poll_interval: float = 2.0
    progress: bool = False

    def __post_init__(self) -> None:
        self.output = self.output.rstrip("/") or self.output
        if self.samples_per_shard is None and self.shard_size is None:
            self.samples_per_shard = DEFAULT_SAMPLES_PER_SHARD

    def check(self) -> None:
        problems = []
        if not self.inputs and self.phase in ("all", "scatter"):
            problems.append("no inputs")
        if self.format not in FORMATS:
            problems.append(f"--format must be one of {', '.join(FORMATS)}")
        if self.on_bad_record not in BAD_RECORD_POLICIES:
            problems.append("--on-bad-record must be 'error' or 'skip'")
        if self.phase not in PHASES:
            problems.append(f"--phase must be one of {', '.join(PHASES)}")
        if self.samples_per_shard is not None and self.samples_per_shard < 1:
            problems.append("--samples-per-shard must be at least 1")
        if self.shard_size is not None and self.shard_size < 1:
            problems.append("--shard-size must be at least 1 byte")
        if self.memory < 4 << 20:
            problems.append("--memory must be at least 4M")
        if self.workers < 1:
            problems.append("--workers must be at least 1")
        if self.task_count < 1 or not 0 <= self.task_index < self.task_count:
            problems.append(f"task index {self.task_index} is not in 0..{self.task_count - 1}")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            problems.append("--name may hold only letters, digits, '_', '-' and '.'")
        if self.buckets is not None and not 1 <= self.buckets <= MAX_BUCKETS:
            problems.append(f"--buckets must be in 1..{MAX_BUCKETS}")
        if problems:
            raise ConvertError("; ".join(problems))

    @property
    def dataset_name(self) -> str:
        if self.name:
            return self.name
        base = posixpath.basename(self.output.rstrip("/"))
        return tar_safe_key(base) if base and base not in (".", "..") else "data"

    @property
    def work_directory(self) -> str:
        if self.workdir:
            return self.workdir
        path = local_path(self.output)
        if path is not None:
            return os.path.join(path, ".wdsraft-work")
        # Remote output: a local (shared, under SLURM) directory named after the output.
        return os.path.abspath(f".wdsraft-work-{hashlib.sha1(self.output.encode()).hexdigest()[:12]}")


# ---------------------------------------------------------------------------------------------
# Keys


_SAFE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_SAFE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def tar_safe_key(text: str) -> str:
    """A sample key for ``text`` that webdataset reads back whole: every character but letters, digits,
    ``_`` and ``-`` is %-escaped (UTF-8 bytes), so there is no dot (webdataset cuts keys at the first
    dot of the basename) and no slash, and different texts give different keys."""
    if _SAFE_KEY.fullmatch(text):
        return text
    return "".join(
        char if char in _SAFE_CHARS else "".join(f"%{b:02X}" for b in char.encode("utf-8", "surrogatepass"))
        for char in text
    )


class ShuffleKeys:
    """The random sort key of each record of one input, and the bucket it falls in.

    A key is a function of (seed, input name, line number) only, never of which process
    read the line or when: that makes the output identical whatever the parallelism.
    (SplitMix64 over the line number, from a per-input offset.)
    """

    _GAMMA = np.uint64(0x9E3779B97F4A7C15)
    _MUL1 = np.uint64(0xBF58476D1CE4E5B9)
    _MUL2 = np.uint64(0x94D049BB133111EB)

    def __init__(self, seed: int, input_name: str, buckets: int):
        digest = hashlib.blake2b(f"{seed}\0{input_name}".encode(), digest_size=8, person=b"wdsraft-shuffle").digest()
        self.base = np.uint64(int.from_bytes(digest, "little"))
        self.buckets = np.uint64(buckets)

    def keys(self, first_line: int, count: int) -> np.ndarray:
        z = self.base + np.arange(first_line, first_line + count, dtype=np.uint64) * self._GAMMA
        z = (z ^ (z >> np.uint64(30))) * self._MUL1
        z = (z ^ (z >> np.uint64(27))) * self._MUL2
        return z ^ (z >> np.uint64(31))

    def bucket_of(self, keys: np.ndarray) -> np.ndarray:
        # Range partition on the top 32 bits: exact integer arithmetic, monotone in the key.
        return ((keys >> np.uint64(32)) * self.buckets) >> np.uint64(32)


# ---------------------------------------------------------------------------------------------
# Inputs


def _split_suffixes(name: str) -> tuple[str, str | None]:
    """``'a/b.jsonl.gz'`` -> (``'a/b'``, ``'gzip'``); the stem keeps unknown suffixes."""
    compression = None
    for suffix, kind in _COMPRESSION_SUFFIXES.items():
        if name.endswith(suffix):
            name, compression = name[: -len(suffix)], kind
            break
    for suffix in _DATA_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], compression
    return name, compression


def _looks_like_input(name: str) -> bool:
    base = name
    for suffix in _COMPRESSION_SUFFIXES:
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base.endswith(_DATA_SUFFIXES)


@dataclass
class InputFile:
    """One input file: its URL, stored size and compression (from its name; the reader checks the magic bytes)."""

    url: str
    size: int
    compression: str | None = None
    name: str = ""  # tar-safe name used in sample keys and shuffle keys; unique among the inputs

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "size": self.size, "compression": self.compression, "name": self.name}

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> InputFile:
        return cls(record["url"], record["size"], record.get("compression"), record["name"])

    def estimated_bytes(self) -> int:
        """Uncompressed size: exact for plain files; from the gzip trailer or zstd frame header of local
        files when they tell; else an assumed ratio (an underestimate only makes buckets bigger, and
        the write phase then works through them in slices)."""
        if self.compression is None:
            return self.size
        path = local_path(self.url)
        guess = self.size * _ASSUMED_RATIO.get(self.compression, 5)
        if path is None or self.size < 18:
            return guess
        try:
            with open(path, "rb") as handle:
                if self.compression == "gzip":
                    handle.seek(-4, os.SEEK_END)
                    isize = int.from_bytes(handle.read(4), "little")  # the last member's size mod 2**32
                    # Smaller than the file: a multi-member file (bgzip, pigz -i) or one past 4 GiB.
                    return isize if isize >= self.size else guess
                if self.compression == "zstd":
                    content = zstandard.frame_content_size(handle.read(18))
                    return content if content >= self.size else guess
        except (OSError, zstandard.ZstdError):
            pass
        return guess


def _list_s3(url: str) -> list[tuple[str, int]]:
    """Objects under an ``s3://bucket/prefix`` (a glob in the key is matched against the listing)."""
    parsed = urlparse(url)
    key = parsed.path.lstrip("/")
    magic = re.search(r"[*?\[]", key)
    prefix = key[: magic.start()] if magic else key
    paginator = s3_client().get_paginator("list_objects_v2")
    found = []
    for page in paginator.paginate(Bucket=parsed.netloc, Prefix=prefix):
        for item in page.get("Contents", []):
            name = item["Key"]
            if magic is not None and not fnmatchcase(name, key):
                continue
            if magic is None and not _looks_like_input(name):
                continue
            found.append((f"s3://{parsed.netloc}/{name}", int(item["Size"])))
    return sorted(found)


def _s3_size(url: str) -> int:
    parsed = urlparse(url)
    try:
        head = s3_client().head_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
    except Exception as exn:
        raise ConvertError(f"input not found or not readable: {url} ({exn})") from None
    return int(head["ContentLength"])


def expand_inputs(specs: Sequence[str]) -> list[InputFile]:
    """Input files from paths, globs, brace patterns, directories, ``s3://`` keys, globs and prefixes
    (ending in ``/``). Directories and prefixes contribute their ``.jsonl``/``.ndjson``/``.json``
    files, plain or compressed. Each pattern's matches are sorted; the order of patterns is kept."""
    found: list[tuple[str, int]] = []
    for spec in specs:
        for item in braceexpand.braceexpand(spec):
            if is_s3(item):
                if item.endswith("/") or re.search(r"[*?\[]", item):
                    matches = _list_s3(item)
                    if not matches:
                        raise ConvertError(f"no input matches {item}")
                    found.extend(matches)
                else:
                    found.append((item, _s3_size(item)))
            elif urlparse(item).scheme not in ("", "file"):
                raise ConvertError(f"unsupported input URL {item} (local paths and s3:// only)")
            else:
                path = local_path(item) or item
                if os.path.isdir(path):
                    names = sorted(p for p in glob.glob(os.path.join(path, "*")) if _looks_like_input(p))
                    if not names:
                        raise ConvertError(f"no .jsonl files in directory {item}")
                    found.extend((name, os.path.getsize(name)) for name in names)
                elif glob.has_magic(path):
                    names = sorted(p for p in glob.glob(path) if os.path.isfile(p))
                    if not names:
                        raise ConvertError(f"no input matches {item}")
                    found.extend((name, os.path.getsize(name)) for name in names)
                else:
                    if not os.path.isfile(path):
                        raise ConvertError(f"input not found: {item}")
                    found.append((item, os.path.getsize(path)))
    seen: dict[str, str] = {}
    for url, _ in found:
        # The same file spelled two ways (./a, a, /abs/a, file://...) would be converted twice.
        identity = url if is_s3(url) else os.path.realpath(local_path(url) or url)
        if identity in seen:
            twice = url if seen[identity] == url else f"{url} (the same file as {seen[identity]})"
            raise ConvertError(f"input given twice: {twice}")
        seen[identity] = url
    inputs = [InputFile(url, size, _split_suffixes(url)[1]) for url, size in found]
    _name_inputs(inputs)
    return inputs


def _name_inputs(inputs: list[InputFile]) -> None:
    """Give each input a unique tar-safe name: its path relative to the inputs' common directory,
    without the ``.jsonl``/compression suffixes (or with them, where two inputs differ only there)."""
    urls = [item.url for item in inputs]
    # The longest run of leading path components all the inputs share.
    split = [url.split("/")[:-1] for url in urls]
    shared = 0
    while split and all(len(parts) > shared and parts[shared] == split[0][shared] for parts in split):
        shared += 1
    relative = ["/".join(url.split("/")[shared:]) for url in urls]
    stems = [_split_suffixes(rel)[0] for rel in relative]
    counts: dict[str, int] = {}
    for stem in stems:
        counts[stem] = counts.get(stem, 0) + 1
    names = [tar_safe_key(stem if counts[stem] == 1 else rel) for rel, stem in zip(relative, stems, strict=True)]
    # A stem can still meet another input's full name (x.jsonl.jsonl's stem is x.jsonl): those take theirs.
    taken = collections.Counter(names)
    names = [name if taken[name] == 1 else tar_safe_key(rel) for name, rel in zip(names, relative, strict=True)]
    clashes = sorted(name for name, count in collections.Counter(names).items() if count > 1)
    if clashes:
        raise ConvertError(f"cannot name the inputs uniquely: {clashes}")
    for item, name in zip(inputs, names, strict=True):
        item.name = name


# ---------------------------------------------------------------------------------------------
# Reading lines


class _StreamDamaged(Exception):
    """The compressed stream is cut short or corrupt; nothing after this point can be read.
    ``decoded``: what the last feed decoded before the damage (whole lines in it are good)."""

    def __init__(self, message: str, decoded: bytes = b""):
        super().__init__(message)
        self.decoded = decoded


class _Decoder:
    """Decompresses a stream chunk by chunk, across concatenated members/frames, and notices a stream
    that ends inside one (a truncated file), which the stdlib readers of zstd do not."""

    def __init__(self, kind: str):
        self.kind = kind
        self._decoder = self._new()
        self._open = False  # fed bytes of a member/frame not yet ended

    def _new(self) -> Any:
        if self.kind == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        if self.kind == "zstd":
            return zstandard.ZstdDecompressor().decompressobj()
        if self.kind == "bz2":
            return bz2.BZ2Decompressor()
        if self.kind == "xz":
            return lzma.LZMADecompressor()
        raise ValueError(f"unknown compression {self.kind}")

    # A failing decompress() call loses what it decoded. Members/frames that ended before the damage
    # are kept for every format; where the decoder can be copied (gzip), the failing piece is re-fed
    # byte by byte from a copy taken before it, up to the damaged byte. (One copy per 64 KiB piece:
    # smaller pieces cost a few percent of conversion speed.)
    PIECE = 1 << 16

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for start in range(0, len(data), self.PIECE):
            piece = data[start : start + self.PIECE]
            copy = getattr(self._decoder, "copy", None)
            before = (copy(), self._open, len(out)) if copy is not None else None
            try:
                self._feed(piece, out)
            except _StreamDamaged as exn:
                if before is not None:
                    self._decoder, self._open, kept = before
                    del out[kept:]
                    with contextlib.suppress(_StreamDamaged):
                        for offset in range(len(piece)):
                            self._feed(piece[offset : offset + 1], out)
                raise _StreamDamaged(str(exn), b"".join(out)) from None
        return b"".join(out)

    def _feed(self, data: bytes, out: list[bytes]) -> None:
        try:
            while data:
                self._open = True
                out.append(self._decoder.decompress(data))
                if not self._decoder.eof:
                    break
                data = self._decoder.unused_data
                self._decoder = self._new()
                self._open = False
                if not data.strip(b"\0"):  # zero padding after the last member (tape-style gzip)
                    break
        except (zlib.error, zstandard.ZstdError, OSError, EOFError, lzma.LZMAError, ValueError) as exn:
            raise _StreamDamaged(f"corrupt {self.kind} data ({exn})") from None

    def finish(self) -> None:
        if self._open:
            raise _StreamDamaged(f"the {self.kind} stream ends early (truncated file?)")


class InputDamaged(Exception):
    """Raised by :class:`LineReader` after the last whole line before damage."""

    def __init__(self, line: int, partial: bytes, reason: str):
        super().__init__(reason)
        self.line = line
        self.partial = partial
        self.reason = reason


class LineReader:
    """The lines of one input file, decompressed, in batches with the 1-based number of their first line.

    Compression is recognised by the magic bytes (else the name). A stream that is truncated or
    corrupt raises :class:`InputDamaged` after the last whole line, with the bytes of the partial
    line. ``advance(n)`` is called with the stored bytes consumed (for progress).
    """

    # Small enough that a chunk and the copies made while splitting it into lines stay a few MB.
    PLAIN_CHUNK = 1 << 19
    COMPRESSED_CHUNK = 1 << 16  # compressed input expands several times

    def __init__(self, source: InputFile, advance: Callable[[int], None] | None = None):
        self.source = source
        self.advance = advance or (lambda n: None)
        self.bytes_out = 0  # decompressed bytes read
        self.window = 0  # bytes the decompressor keeps (zstd's window: up to 8 MB usually, 128 MB with --long)

    def batches(self) -> Iterator[tuple[int, list[bytes]]]:
        line = 1
        parts: list[bytes] = []  # the line being assembled (a long line can span many chunks)
        damage: str | None = None
        try:
            stream = gopen(self.source.url, "rb")
        except FileNotFoundError:
            raise ConvertError(f"input not found: {self.source.url}") from None
        with contextlib.closing(stream):
            head = stream.read(18)  # enough for the compression's magic and a zstd frame header
            kind = sniff_compression(head) or self.source.compression
            if kind == "zstd":
                with contextlib.suppress(zstandard.ZstdError):
                    self.window = zstandard.get_frame_parameters(head).window_size
            decoder = _Decoder(kind) if kind else None
            chunk_size = self.COMPRESSED_CHUNK if decoder else self.PLAIN_CHUNK
            pending, first, pending_head = head, True, b""
            while damage is None:
                raw = pending or stream.read(chunk_size)
                pending = b""
                if not raw:
                    break
                self.advance(len(raw))
                try:
                    data = decoder.feed(raw) if decoder else raw
                except _StreamDamaged as exn:  # (the whole lines decoded before the damage still count)
                    damage, data = str(exn), exn.decoded
                if not data:
                    continue
                if first:
                    data, pending_head = pending_head + data, b""
                    if len(data) < len(_UTF8_BOM) and _UTF8_BOM.startswith(data) and damage is None:
                        pending_head = data  # (a decoder may hand out the first bytes a few at a time)
                        continue
                    data = data[len(_UTF8_BOM) :] if data.startswith(_UTF8_BOM) else data
                    first = False
                self.bytes_out += len(data)
                end = data.rfind(b"\n")
                if end < 0:
                    parts.append(data)
                    continue
                block = data[:end] if not parts else b"".join(parts) + data[:end]
                parts = [data[end + 1 :]] if end + 1 < len(data) else []
                lines = block.split(b"\n")
                yield line, lines
                line += len(lines)
            if decoder is not None and damage is None:
                try:
                    decoder.finish()
                except _StreamDamaged as exn:
                    damage = str(exn)
        tail = pending_head + b"".join(parts)  # (pending_head: a file of one or two BOM bytes, held back)
        if damage is not None:
            raise InputDamaged(line, tail, damage)
        if tail:
            yield line, [tail]


# ---------------------------------------------------------------------------------------------
# Records -> samples


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def _json_type(value: Any) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


class SampleEncoder:
    """Checks one JSONL record and lays it out as a sample: a key and the bytes of its fields.

    ``txt+json``: the text field as ``.txt`` (UTF-8) and the other fields as ``.json`` (encoded
    as webdataset encodes ``.json``); ``msgpack``: the whole record as ``.msgpack``. The key is
    the ``id_field`` value (escaped with :func:`tar_safe_key`) or ``INPUTNAME-LINE``.
    """

    def __init__(self, fmt: str, text_field: str, id_field: str | None):
        self.format = fmt
        self.text_field = text_field
        self.id_field = id_field
        # The order TarWriter writes members in (sorted), which is the order payloads store them.
        self.extensions = extensions_of(fmt)

    def encode(self, raw: bytes, input_name: str, line: int) -> tuple[bytes, tuple[bytes, ...]]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exn:
            raise BadRecord(
                f"not valid UTF-8 ({exn.reason}: byte 0x{raw[exn.start]:02x} at column {exn.start + 1})"
            ) from None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exn:
            raise BadRecord(f"invalid JSON ({exn.msg} at column {exn.colno})") from None
        except RecursionError:
            raise BadRecord("invalid JSON (nested too deeply)") from None
        if not isinstance(record, dict):
            raise BadRecord(f"not a JSON object (a JSON {_json_type(record)})")
        body = record.get(self.text_field)
        if not isinstance(body, str):
            if self.text_field not in record:
                raise BadRecord(f"no text field {self.text_field!r}")
            raise BadRecord(f"text field {self.text_field!r} is a JSON {_json_type(body)}, not a string")
        key = self._key(record, input_name, line)
        if self.format == FORMAT_TXT_JSON:
            try:
                txt = body.encode("utf-8")
            except UnicodeEncodeError as exn:
                raise BadRecord(
                    f"text field {self.text_field!r} holds a lone surrogate \\u{ord(body[exn.start]):04x} "
                    "that UTF-8 cannot encode"
                ) from None
            del record[self.text_field]
            members: tuple[bytes, ...] = (json.dumps(record).encode("ascii"), txt)
        else:
            try:
                members = (msgpack.packb(record, use_bin_type=True),)
            except (OverflowError, UnicodeEncodeError, ValueError, TypeError) as exn:
                raise BadRecord(f"cannot encode as msgpack ({exn})") from None
        if any(len(member) > 0xFFFFFFFF for member in members):
            raise BadRecord("a field is larger than 4 GiB")
        return key, members

    def _key(self, record: dict[str, Any], input_name: str, line: int) -> bytes:
        if self.id_field is None:
            return f"{input_name}-{line:09d}".encode("ascii")
        value = record.get(self.id_field)
        if isinstance(value, str) and value:
            key = tar_safe_key(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            key = str(value)
        elif self.id_field not in record:
            raise BadRecord(f"no id field {self.id_field!r}")
        else:
            raise BadRecord(f"id field {self.id_field!r} is {_json_type(value)!s}, not a non-empty string or integer")
        if len(key) > 0xFFFF:
            raise BadRecord(f"id field {self.id_field!r} is too long for a key")
        return key.encode("ascii")


class PayloadCodec:
    """The bytes of one sample in a bucket: ``u16 key length, u32 length per field, key, fields``."""

    def __init__(self, extensions: Sequence[str]):
        self.extensions = tuple(extensions)
        self.header = struct.Struct("<H" + "I" * len(self.extensions))

    def tar_size(self, key: bytes, members: Sequence[bytes]) -> int:
        """Bytes the sample takes in a tar: a 512-byte header per member (two more blocks of PAX
        header for a name of 100 bytes or more) plus the data padded to 512."""
        total = 0
        for ext, member in zip(self.extensions, members, strict=True):
            total += 512 + ((len(member) + 511) & ~511)
            if len(key) + len(ext) >= 99:
                total += 1024
        return total

    def decode(self, buffer: memoryview, start: int) -> tuple[str, list[tuple[str, memoryview]]]:
        """The key and the (extension, bytes) members of the payload at ``start``."""
        lengths = self.header.unpack_from(buffer, start)
        at = start + self.header.size
        end = at + lengths[0]
        key = bytes(buffer[at:end]).decode("ascii")
        members = []
        for ext, length in zip(self.extensions, lengths[1:], strict=True):
            at, end = end, end + length
            members.append((ext, buffer[at:end]))
        return key, members


# ---------------------------------------------------------------------------------------------
# Scatter: records -> buckets in a unit data file


RECORD_HEADER = np.dtype([("key", "<u8"), ("size", "<u4")])  # 12 bytes per record
_FOOTER = struct.Struct("<QQ8s")  # extent table offset, bucket count, magic
_FOOTER_MAGIC = b"WDSRSCT1"
_EXTENT = np.dtype([("offset", "<u8"), ("count", "<u8"), ("length", "<u8")])


class BucketSpiller:
    """Buffers records per bucket and appends them to a unit's data file when the budget is used up.

    Each spill writes, for every bucket holding records, one *segment*: the records' headers
    (random key, payload size) and then their payloads, in input order. ``close``
    appends the extent table (for each bucket, the offset, record count and length of each of
    its segments) and a footer pointing at it.
    """

    # Python's cost of holding one record's two bytes objects in a list, counted against the budget.
    PER_RECORD = 2 * (sys.getsizeof(b"") + 8) + RECORD_HEADER.itemsize

    def __init__(self, stream: IO[bytes], buckets: int, budget: int, codec: PayloadCodec):
        self.stream = stream
        self.buckets = buckets
        self.budget = budget
        self.codec = codec
        self.offset = 0
        self.buffered = 0
        # Per bucket: payload pieces (kept as the bytes objects they are: appending to one growing
        # bytearray would copy the data several times over) and the header columns.
        self._parts: dict[int, list[bytes]] = {}
        self._headers: dict[int, tuple[array, array]] = {}
        self._tar: dict[int, int] = {}
        self.extents: list[tuple[int, int, int, int]] = []  # (bucket, offset, count, length)
        self.counts = np.zeros(buckets, dtype=np.int64)
        self.payload_bytes = np.zeros(buckets, dtype=np.int64)
        self.tar_bytes = np.zeros(buckets, dtype=np.int64)
        self.spills = 0
        self.on_spill: Callable[[], None] | None = None

    def add(self, bucket: int, key: int, sample_key: bytes, members: Sequence[bytes]) -> None:
        parts = self._parts.get(bucket)
        if parts is None:
            parts = self._parts[bucket] = []
            self._headers[bucket] = (array("Q"), array("I"))
            self._tar[bucket] = 0
        keys, sizes = self._headers[bucket]
        head = self.codec.header.pack(len(sample_key), *map(len, members)) + sample_key
        size = len(head)
        if len(members) == 2 and len(members[0]) < 4096:  # txt+json: the small .json rides with the head
            head += members[0]
            parts.append(head)
            parts.append(members[1])
        else:
            parts.append(head)
            parts.extend(members)
        for member in members:
            size += len(member)
        keys.append(key)
        sizes.append(size)
        self._tar[bucket] += self.codec.tar_size(sample_key, members)
        self.buffered += size + self.PER_RECORD
        if self.buffered >= self.budget:
            self.spill()

    def spill(self) -> None:
        if not self.buffered:
            return
        for bucket in sorted(self._headers):
            keys, sizes = self._headers[bucket]
            header = np.empty(len(keys), dtype=RECORD_HEADER)
            header["key"] = np.frombuffer(keys, dtype=np.uint64)
            header["size"] = np.frombuffer(sizes, dtype=np.uint32)
            self.counts[bucket] += len(keys)
            self.payload_bytes[bucket] += int(header["size"].sum(dtype=np.int64))
            self.tar_bytes[bucket] += self._tar[bucket]
            self.stream.write(header.tobytes())
            for part in self._parts[bucket]:
                self.stream.write(part)
            length = header.nbytes + int(header["size"].sum(dtype=np.int64))
            self.extents.append((bucket, self.offset, len(keys), length))
            self.offset += length
        self._headers.clear()
        self._parts.clear()
        self._tar.clear()
        self.buffered = 0
        self.spills += 1
        if self.on_spill is not None:
            self.on_spill()

    def close(self) -> int:
        """Spill what is left and write the extent table and footer; returns the file's size."""
        self.spill()
        order = sorted(range(len(self.extents)), key=lambda i: self.extents[i][0])  # stable: spill order kept
        table = np.zeros(len(order), dtype=_EXTENT)
        starts = np.zeros(self.buckets + 1, dtype=np.uint64)
        for row, i in enumerate(order):
            bucket, offset, count, length = self.extents[i]
            table[row] = (offset, count, length)
            starts[bucket + 1] += 1
        starts = np.cumsum(starts, dtype=np.uint64)
        self.stream.write(starts.astype("<u8").tobytes())
        self.stream.write(table.tobytes())
        self.stream.write(_FOOTER.pack(self.offset, self.buckets, _FOOTER_MAGIC))
        return self.offset + starts.nbytes + table.nbytes + _FOOTER.size


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


class RejectsWriter:
    """Bad records, verbatim, one JSON line each: input, line, reason and the raw bytes (as ``raw``
    when they are UTF-8, else as ``raw_base64``). The file is created on the first reject."""

    def __init__(self, path: str, url: str):
        self.path = path
        self.url = url
        self.count = 0
        self._stream: IO[bytes] | None = None

    def add(self, line: int, raw: bytes, reason: str) -> None:
        record: dict[str, Any] = {"input": self.url, "line": line, "reason": reason}
        try:
            record["raw"] = raw.decode("utf-8")
        except UnicodeDecodeError:
            record["raw_base64"] = base64.b64encode(raw).decode("ascii")
        if self._stream is None:
            self._stream = open_atomic(self.path)
        self._stream.write(json.dumps(record, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
        self.count += 1

    def commit(self) -> None:
        if self._stream is not None:
            self._stream.close()

    def abort(self) -> None:
        if self._stream is not None:
            _abort(self._stream)


def _abort(stream: Any) -> None:
    if not abort_write(stream):
        stream.close()


# ---------------------------------------------------------------------------------------------
# The work directory and the plan


class WorkDir:
    """The shared work directory: the plan, the scatter phase's data files, the done-files of units
    and buckets, and the staging area for uploads. Every file in it is written atomically."""

    def __init__(self, root: str):
        self.root = root
        self.plan = os.path.join(root, "plan.json")
        self.finalize_lock = os.path.join(root, "finalize.lock")

    def _unit(self, unit: int, suffix: str) -> str:
        return os.path.join(self.root, "scatter", f"unit-{unit:06d}{suffix}")

    def unit_data(self, unit: int) -> str:
        return self._unit(unit, ".data")

    def unit_done(self, unit: int) -> str:
        return self._unit(unit, ".done")

    def unit_rejects(self, unit: int) -> str:
        return self._unit(unit, ".rejects.jsonl")

    def unit_failed(self, unit: int) -> str:
        return self._unit(unit, ".failed")

    def bucket_done(self, bucket: int) -> str:
        return os.path.join(self.root, "write", f"bucket-{bucket:06d}.done")

    def staging(self, bucket: int) -> str:
        return os.path.join(self.root, "staging", f"bucket-{bucket:06d}")

    def remove(self) -> None:
        """Remove what a conversion put here, and the directory if that leaves it empty: never anything
        else (a work directory may be a shared scratch directory, or the output's own)."""
        for part in ("scatter", "write", "staging"):
            shutil.rmtree(os.path.join(self.root, part), ignore_errors=True)
        for path in (self.plan, self.finalize_lock):
            self.clear_leftovers(path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        with contextlib.suppress(OSError):  # (not empty: other files were there before)
            os.rmdir(self.root)

    @staticmethod
    def read_json(path: str) -> dict[str, Any] | None:
        try:
            with open(path, "rb") as handle:
                return json.loads(handle.read())
        except FileNotFoundError:
            return None

    @staticmethod
    def write_json(path: str, record: dict[str, Any]) -> None:
        write_bytes_atomic(path, json.dumps(record, separators=(",", ":")).encode("utf-8"))

    @staticmethod
    def clear_leftovers(path: str) -> None:
        """Remove the temporary files a killed writer of ``path`` left (``.NAME.tmp-PID-XXXX``)."""
        directory, name = os.path.split(path)
        for leftover in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.tmp-*")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)


@dataclass
class Plan:
    """What a conversion is: its inputs, the settings that shape the output, and the number of
    buckets. Written once to ``WORKDIR/plan.json``; every task and every rerun works from it."""

    inputs: list[InputFile]
    output: str
    settings: dict[str, Any]
    buckets: int

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.inputs, self.settings)

    def to_json(self) -> bytes:
        record = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "fingerprint": self.fingerprint,
            "output": self.output,
            "settings": self.settings,
            "buckets": self.buckets,
            "inputs": [item.to_dict() for item in self.inputs],
        }
        return json.dumps(record, indent=1).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes, path: str) -> Plan:
        try:
            record = json.loads(raw)
        except ValueError:
            raise ConvertError(f"{path}: not a conversion plan") from None
        if record.get("format") != PLAN_FORMAT or record.get("version") != PLAN_VERSION:
            raise ConvertError(f"{path}: not a conversion plan of this version")
        inputs = [InputFile.from_dict(item) for item in record["inputs"]]
        return cls(inputs, record["output"], record["settings"], record["buckets"])

    @property
    def seed(self) -> int:
        return int(self.settings["seed"])

    @property
    def name(self) -> str:
        return str(self.settings["name"])

    def shard_name(self, number: int) -> str:
        return f"{self.name}-{number:06d}.tar"


def plan_settings(options: ConvertOptions) -> dict[str, Any]:
    """The options that shape the output (``--workers``, tasks, ``--memory`` do not)."""
    return {
        "seed": options.seed,
        "format": options.format,
        "text_field": options.text_field,
        "id_field": options.id_field,
        "samples_per_shard": options.samples_per_shard,
        "shard_size": options.shard_size,
        "name": options.dataset_name,
    }


def fingerprint(inputs: Sequence[InputFile], settings: dict[str, Any]) -> str:
    identity = {"inputs": [[item.url, item.size] for item in inputs], "settings": settings}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()


def choose_buckets(inputs: Sequence[InputFile], memory: int, workers: int = 1, tasks: int = 1) -> int:
    """Buckets of about half a worker's share of ``memory`` (of uncompressed input), and at least one
    per worker of every task. The output does not depend on this number; it trades the copies made
    for shards that straddle buckets (fewer, larger buckets) against parallelism and the headroom
    left for an underestimated input size (a bucket over the budget is written in slower slices)."""
    total = sum(item.estimated_bytes() for item in inputs)
    target = max(1, memory // (BUCKET_FRACTION * workers))
    return max(1, min(MAX_BUCKETS, max(math.ceil(total / target), workers * tasks)))


# ---------------------------------------------------------------------------------------------
# Write: buckets -> shards


class ShardLayout:
    """Where every shard lies in the global order, from the scatter counts alone.

    The buckets' sorted records, concatenated bucket after bucket, are the whole corpus in
    random-key order; record ``r`` of that order (its global *rank*) goes to shard
    ``r // per_shard``, so every shard but the last holds exactly ``per_shard`` samples, as
    with ``ShardWriter``'s rollover, whatever the number of buckets. ``per_shard`` is
    ``--samples-per-shard``, or fewer where ``--shard-size`` asks for it: the shard size over
    the mean tar bytes of a sample (shuffled samples even out, so shards come close to it).

    Every shard is written by the job of the last bucket it touches: a shard that straddles
    buckets starts with records of earlier buckets, which that job reads from their scatter data.
    """

    def __init__(
        self, counts: np.ndarray, tar_bytes: np.ndarray, samples_per_shard: int | None, shard_size: int | None
    ):
        self.counts = counts.astype(np.int64)
        self.starts = (np.cumsum(self.counts) - self.counts).astype(np.int64)
        self.ends = self.starts + self.counts
        self.total = int(self.counts.sum())
        per_shard = samples_per_shard or max(1, self.total)
        total_bytes = int(tar_bytes.sum())
        if shard_size and total_bytes:
            per_shard = min(per_shard, max(1, round(shard_size * self.total / total_bytes)))
        self.per_shard = per_shard
        self.total_shards = -(-self.total // per_shard)

    def ranks(self, shard: int) -> tuple[int, int]:
        """The global ranks ``[first, end)`` of a shard's samples."""
        return shard * self.per_shard, min((shard + 1) * self.per_shard, self.total)

    def buckets_of(self, shard: int) -> list[int]:
        """The non-empty buckets holding part of a shard, in order."""
        first, end = self.ranks(shard)
        low = int(np.searchsorted(self.ends, first, side="right"))
        high = int(np.searchsorted(self.starts, end, side="left"))
        return [b for b in range(low, high) if self.counts[b] > 0]

    def owner(self, shard: int) -> int:
        """The bucket whose job writes the shard: the last one holding part of it."""
        return self.buckets_of(shard)[-1]


@dataclass
class LoadedRecords:
    """Records of (part of) a bucket in one buffer: their keys, where each payload starts, their units."""

    buffer: mmap.mmap | bytearray
    keys: np.ndarray
    starts: np.ndarray
    units: np.ndarray

    def order(self) -> np.ndarray:
        # Stable: equal keys (practically never) keep input order, so the result is still deterministic.
        return np.argsort(self.keys, kind="stable")

    def release(self) -> None:
        if isinstance(self.buffer, mmap.mmap):
            self.buffer.close()


def _allocate(size: int) -> mmap.mmap | bytearray:
    """A zeroed buffer outside the malloc heap (an anonymous mapping). Freed, it goes straight back to
    the system; a heap block that large may linger, and glibc's adaptive threshold would then keep
    later large blocks on the heap too, so that the process's RSS outgrows its live data."""
    return mmap.mmap(-1, size) if size else bytearray()


class BucketReader:
    """Reads one bucket's records back from every unit's data file."""

    # Memory per record while a bucket is in memory: header arrays, sort order, temporaries.
    PER_RECORD = 64

    def __init__(self, workdir: WorkDir, data_sizes: Sequence[int], bucket: int):
        self.workdir = workdir
        self.bucket = bucket
        self.extents: list[tuple[int, int, int, int]] = []  # (unit, offset, count, length)
        for unit, size in enumerate(data_sizes):
            for offset, count, length in read_extents(workdir.unit_data(unit), bucket, size).tolist():
                self.extents.append((unit, offset, count, length))

    @property
    def count(self) -> int:
        return sum(extent[2] for extent in self.extents)

    @property
    def weight(self) -> int:
        """Bytes needed to hold the whole bucket in memory and sort it."""
        return sum(extent[3] for extent in self.extents) + self.PER_RECORD * self.count

    def load(self) -> LoadedRecords:
        """The whole bucket, in one read per segment."""
        total = sum(extent[3] for extent in self.extents)
        buffer = _allocate(total)
        view = memoryview(buffer)
        keys, starts, units = [], [], []
        at = 0
        handle: Any = None
        current = -1
        try:
            for unit, offset, count, length in self.extents:
                if unit != current:
                    if handle is not None:
                        handle.close()
                    handle = open(self.workdir.unit_data(unit), "rb")  # noqa: SIM115 - closed below
                    current = unit
                assert handle is not None
                handle.seek(offset)
                if handle.readinto(view[at : at + length]) != length:
                    raise ConvertError(f"{self.workdir.unit_data(unit)}: truncated scatter data file")
                header = np.frombuffer(buffer, dtype=RECORD_HEADER, count=count, offset=at)
                sizes = header["size"].astype(np.int64)
                keys.append(header["key"].copy())
                starts.append(at + header.nbytes + np.cumsum(sizes) - sizes)
                units.append(np.full(count, unit, dtype=np.int32))
                del header  # a view of the buffer: it must go before the buffer can be unmapped
                at += length
        finally:
            if handle is not None:
                handle.close()
        view.release()
        return LoadedRecords(buffer, _concat(keys, np.uint64), _concat(starts, np.int64), _concat(units, np.int32))

    def headers(self) -> tuple[np.ndarray, np.ndarray]:
        """Only the keys and payload sizes of all records, for a bucket too big to load."""
        keys, sizes = [], []
        for unit, offset, count, _ in self.extents:
            with open(self.workdir.unit_data(unit), "rb") as handle:
                handle.seek(offset)
                header = np.frombuffer(handle.read(count * RECORD_HEADER.itemsize), dtype=RECORD_HEADER)
            keys.append(header["key"].copy())
            sizes.append(header["size"].astype(np.int64))
        return _concat(keys, np.uint64), _concat(sizes, np.int64)

    def locations(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Unit, file offset and size of every record's payload, in sorted (random-key) order: what
        :meth:`load` would give, from the headers alone."""
        keys, units, positions, sizes = [], [], [], []
        for unit, offset, count, _ in self.extents:
            with open(self.workdir.unit_data(unit), "rb") as handle:
                handle.seek(offset)
                header = np.frombuffer(handle.read(count * RECORD_HEADER.itemsize), dtype=RECORD_HEADER)
            size = header["size"].astype(np.int64)
            keys.append(header["key"].copy())
            units.append(np.full(count, unit, dtype=np.int32))
            positions.append(offset + header.nbytes + np.cumsum(size) - size)
            sizes.append(size)
        order = np.argsort(_concat(keys, np.uint64), kind="stable")
        return _concat(units, np.int32)[order], _concat(positions, np.int64)[order], _concat(sizes, np.int64)[order]

    def read_ranks(self, first: int, end: int) -> Iterator[tuple[int, bytes]]:
        """The payloads of the records of sorted ranks ``[first, end)``, with their unit, one read each."""
        units, positions, sizes = (column[first:end].tolist() for column in self.locations())
        descriptors: dict[int, int] = {}
        try:
            for unit, position, size in zip(units, positions, sizes, strict=True):
                if unit not in descriptors:
                    descriptors[unit] = os.open(self.workdir.unit_data(unit), os.O_RDONLY)
                yield unit, os.pread(descriptors[unit], size, position)
        finally:
            for descriptor in descriptors.values():
                os.close(descriptor)

    def load_slice(self, low: int, high: int) -> LoadedRecords:
        """The records whose key lies in ``[low, high]``: headers are re-read, then the selected
        payloads one by one (slower; used only when a bucket does not fit the budget)."""
        selected: list[tuple[int, int, int, int]] = []  # unit, file offset, size, key
        total = 0
        for unit, offset, count, _ in self.extents:
            path = self.workdir.unit_data(unit)
            with open(path, "rb") as handle:
                handle.seek(offset)
                header = np.frombuffer(handle.read(count * RECORD_HEADER.itemsize), dtype=RECORD_HEADER)
            sizes = header["size"].astype(np.int64)
            positions = offset + header.nbytes + np.cumsum(sizes) - sizes
            keep = np.nonzero((header["key"] >= np.uint64(low)) & (header["key"] <= np.uint64(high)))[0]
            for i in keep.tolist():
                selected.append((unit, int(positions[i]), int(sizes[i]), int(header["key"][i])))
                total += int(sizes[i])
        buffer = _allocate(total)
        view = memoryview(buffer)
        starts = np.empty(len(selected), dtype=np.int64)
        at = 0
        descriptor, current = -1, -1
        try:
            for row, (unit, position, size, _) in enumerate(selected):
                if unit != current:
                    if descriptor >= 0:
                        os.close(descriptor)
                    descriptor, current = os.open(self.workdir.unit_data(unit), os.O_RDONLY), unit
                view[at : at + size] = os.pread(descriptor, size, position)
                starts[row] = at
                at += size
        finally:
            if descriptor >= 0:
                os.close(descriptor)
        view.release()
        keys = np.array([item[3] for item in selected], dtype=np.uint64)
        units = np.array([item[0] for item in selected], dtype=np.int32)
        return LoadedRecords(buffer, keys, starts, units)


def _concat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def key_slices(sorted_keys: np.ndarray, weights: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Split sorted keys into inclusive key ranges whose records weigh at most ``budget`` each
    (a single record heavier than that gets a range of its own); equal keys stay together."""
    slices: list[tuple[int, int]] = []
    count = len(sorted_keys)
    start = 0
    cumulative = np.cumsum(weights)
    while start < count:
        base = cumulative[start - 1] if start else 0
        end = int(np.searchsorted(cumulative, base + budget, side="right"))
        end = max(end, start + 1)
        while end < count and sorted_keys[end] == sorted_keys[end - 1]:
            end += 1
        slices.append((int(sorted_keys[start]), int(sorted_keys[end - 1])))
        start = end
    return slices


class ShardAssembler:
    """Writes one shard from laid-out samples: byte for byte what :class:`TarWriter` writes for the
    same samples with ``mtime=0`` (tested), index included, atomically. The difference is speed:
    the members of many samples are joined into one large write, where TarWriter makes three calls
    per member, which was most of the write phase's time.
    """

    BLOCK = 1 << 20  # the pending members and their joined copy count against the memory budget

    def __init__(self, url: str, headers: HeaderBuilder, fsync: bool = True):
        self.url = url
        self.headers = headers
        self.stream = open_atomic(url, fsync=fsync)
        self.digest = hashlib.sha256()
        self.offsets = array("Q")
        self.offset = 0
        self.size = 0
        self._pending: list[bytes | memoryview] = []

    def add(self, key: str, members: Sequence[tuple[str, memoryview]]) -> None:
        self.offsets.append(self.offset)
        pending = self._pending
        for ext, data in members:
            size = len(data)
            header = self.headers.build(f"{key}.{ext}", size, SHARD_MTIME)
            padding = _ZEROS[: (-size) % 512]
            pending += (header, data, padding)
            self.offset += len(header) + size + len(padding)
        if self.offset - self.size >= self.BLOCK:
            self.flush()

    def flush(self) -> None:
        block = b"".join(self._pending)
        self._pending.clear()
        self.digest.update(block)
        self.stream.write(block)
        self.size += len(block)

    def close(self) -> ShardIndex:
        end = self.offset
        self._pending.append(end_of_archive(end))
        self.flush()
        self.stream.close()
        offsets = array("Q", self.offsets)
        offsets.append(end)
        index = ShardIndex(posixpath.basename(self.url), offsets, self.size, self.digest.hexdigest(), None)
        index.save(self.url)
        return index

    def abort(self) -> None:
        _abort(self.stream)


_ZEROS = bytes(512)


class ShardSink:
    """Where a bucket's shards go: a local directory (written in place, atomically)."""

    def __init__(self, output: str):
        self.output = output
        self.headers = HeaderBuilder("bigdata", "bigdata", 0o444)  # TarWriter's defaults

    def url(self, name: str) -> str:
        return os.path.join(self.output, name)

    def open(self, name: str) -> ShardAssembler:
        WorkDir.clear_leftovers(self.url(name))
        WorkDir.clear_leftovers(self.url(name) + INDEX_SUFFIX)
        return ShardAssembler(self.url(name), self.headers)

    def commit(self) -> None:
        """Called once all the bucket's shards are written."""


class SmartOpenShardSink(ShardSink):
    """An ``s3://`` prefix, streamed through smart_open (an object appears when its upload completes)."""

    def url(self, name: str) -> str:
        return f"{self.output}/{name}"

    def open(self, name: str) -> ShardAssembler:
        return ShardAssembler(self.url(name), self.headers)


class S5cmdShardSink(ShardSink):
    """An ``s3://`` prefix: shards are written to a local staging directory, then uploaded together by
    ``s5cmd cp`` (parallel multipart uploads; an object appears only when complete)."""

    def __init__(self, output: str, staging: str, binary: str):
        super().__init__(output)
        self.staging = staging
        self.binary = binary
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)

    def open(self, name: str) -> ShardAssembler:
        return ShardAssembler(os.path.join(self.staging, name), self.headers, fsync=False)

    def commit(self) -> None:
        if not os.listdir(self.staging):
            return
        command = [self.binary]
        endpoint = s3_endpoint_url()
        if endpoint:
            command += ["--endpoint-url", endpoint]
        command += ["cp", os.path.join(self.staging, "*"), self.output + "/"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ConvertError(
                f"s5cmd upload to {self.output} failed: {result.stderr.strip() or result.stdout.strip()}"
            )
        shutil.rmtree(self.staging, ignore_errors=True)


def s3_uploader() -> str | None:
    """The s5cmd binary to upload with, or None for smart_open (``WDSRAFT_S3_WRITER=auto|s5cmd|smart_open``)."""
    try:
        return s5cmd_binary("WDSRAFT_S3_WRITER")
    except FileNotFoundError as missing:
        raise ConvertError(str(missing)) from None


def shard_sink(output: str, staging: str) -> ShardSink:
    if not is_s3(output):
        return ShardSink(local_path(output) or output)
    binary = s3_uploader()
    return S5cmdShardSink(output, staging, binary) if binary else SmartOpenShardSink(output)


class ShardCutter:
    """Feeds one bucket's records, in sorted order, into the shards its job writes.

    The record of global rank ``r`` belongs to shard ``r // per_shard``. The job writes the
    shards whose last bucket is its own: a shard that began in earlier buckets is opened with
    their records (read from their scatter data), and the records of a shard that goes on into
    later buckets are left to the job of the bucket where it ends.
    """

    def __init__(
        self,
        layout: ShardLayout,
        bucket: int,
        sink: ShardSink,
        names: Callable[[int], str],
        earlier: Callable[[int], BucketReader],
        codec: PayloadCodec,
        per_unit: np.ndarray,
    ):
        self.layout = layout
        self.bucket = bucket
        self.sink = sink
        self.names = names
        self.earlier = earlier
        self.codec = codec
        self.per_unit = per_unit
        self.per_shard = layout.per_shard
        self.rank = int(layout.starts[bucket])
        self.shard = -1
        self.writer: ShardAssembler | None = None
        self.written: list[dict[str, Any]] = []

    def take(self) -> ShardAssembler | None:
        """The shard writer for the next record, or None when a later bucket's job writes it."""
        shard = self.rank // self.per_shard
        self.rank += 1
        if shard != self.shard:
            self._finish()
            self.shard = shard
            if self.layout.owner(shard) == self.bucket:
                self._open(shard)
        return self.writer

    def _open(self, shard: int) -> None:
        self.writer = self.sink.open(self.names(shard))
        first, end = self.layout.ranks(shard)
        for bucket in self.layout.buckets_of(shard)[:-1]:  # the head of a shard straddling buckets
            start = int(self.layout.starts[bucket])
            reader = self.earlier(bucket)
            for unit, payload in reader.read_ranks(max(first, start) - start, min(end, start + reader.count) - start):
                self.writer.add(*self.codec.decode(memoryview(payload), 0))
                self.per_unit[unit] += 1

    def _finish(self) -> None:
        if self.writer is None:
            return
        writer, self.writer = self.writer, None
        index = writer.close()
        self.written.append(
            {"name": self.names(self.shard), "samples": index.num_samples, "size": index.size, "sha256": index.sha256}
        )
        _TestHook.reached("shard")

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> list[dict[str, Any]]:
        self._finish()
        return self.written

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


# ---------------------------------------------------------------------------------------------
# Jobs (run in worker processes)


class _TestHook:
    """Fault injection for the tests: ``WDSRAFT_CONVERT_PAUSE_AT=EVENT:N`` makes the process touch
    ``WDSRAFT_CONVERT_PAUSE_MARKER`` and sleep when EVENT (``spill-unitU``, ``unit``, ``shard``,
    ``bucket``) happens for the Nth time, so that a test can SIGKILL it at a known point. Inert
    without the variable."""

    counts: dict[str, int] = {}

    @classmethod
    def reached(cls, event: str) -> None:
        spec = os.environ.get("WDSRAFT_CONVERT_PAUSE_AT")
        if not spec:
            return
        name, _, number = spec.partition(":")
        if name != event:
            return
        cls.counts[event] = cls.counts.get(event, 0) + 1
        if cls.counts[event] == int(number or 1):
            marker = os.environ.get("WDSRAFT_CONVERT_PAUSE_MARKER")
            if marker:
                with open(marker, "w") as handle:
                    handle.write(str(os.getpid()))
            while True:
                time.sleep(60)


_progress: Callable[[int], None] = lambda n: None  # noqa: E731 - replaced per process


def _report_progress(n: int) -> None:
    _progress(n)


def _shared_counter(counter: Any) -> Callable[[int], None]:
    def advance(n: int) -> None:
        with counter.get_lock():
            counter.value += n

    return advance


def _init_worker(counter: Any) -> None:
    global _progress
    _progress = _shared_counter(counter)


class ScatterJob:
    """Scatters one input (a unit): reads its lines, turns records into samples, spreads them over the
    buckets into the unit's data file, writes its rejects, and then its done-file."""

    def __init__(self, plan: Plan, workdir: WorkDir, unit: int, budget: int, on_bad_record: str):
        self.plan = plan
        self.workdir = workdir
        self.unit = unit
        self.budget = budget
        self.on_bad_record = on_bad_record

    def run(self) -> dict[str, Any]:
        source = self.plan.inputs[self.unit]
        settings = self.plan.settings
        encoder = SampleEncoder(settings["format"], settings["text_field"], settings["id_field"])
        codec = PayloadCodec(encoder.extensions)
        keys = ShuffleKeys(self.plan.seed, source.name, self.plan.buckets)
        data_path = self.workdir.unit_data(self.unit)
        for path in (data_path, self.workdir.unit_rejects(self.unit)):
            WorkDir.clear_leftovers(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.workdir.unit_failed(self.unit))
        # No fsync: scratch data. A killed process loses nothing written; a machine crash that tears
        # the file is caught by the size check of the write phase.
        stream = open_atomic(data_path, fsync=False)
        rejects = RejectsWriter(self.workdir.unit_rejects(self.unit), source.url)
        # Leave room for what the reader holds besides the buffers (a chunk, its lines, a decoded
        # record) and for the allocator's slack (measured: about 1/8 and 6 MB).
        threshold = max(self.budget * 7 // 8 - (6 << 20), self.budget // 3)
        spiller = BucketSpiller(stream, self.plan.buckets, threshold, codec)
        spiller_budget_set = False
        spiller.on_spill = lambda: _TestHook.reached(f"spill-unit{self.unit}")
        reader = LineReader(source, _report_progress)
        lines = blank = 0
        skip = self.on_bad_record == "skip"
        try:
            try:
                for first, batch in reader.batches():
                    if not spiller_budget_set:  # the reader now knows its decompression window
                        spiller.budget = max(threshold - reader.window, threshold // 2)
                        spiller_budget_set = True
                    lines += len(batch)
                    random_keys = keys.keys(first, len(batch))
                    buckets = keys.bucket_of(random_keys).tolist()
                    random_keys_list = random_keys.tolist()
                    for i, raw in enumerate(batch):
                        if not raw or raw.isspace():
                            blank += 1
                            continue
                        try:
                            key, members = encoder.encode(raw, source.name, first + i)
                        except BadRecord as bad:
                            if not skip:
                                raise ConvertError(f"{source.url}: line {first + i}: {bad.reason}") from None
                            rejects.add(first + i, raw, bad.reason)
                            continue
                        spiller.add(buckets[i], random_keys_list[i], key, members)
            except InputDamaged as damage:
                if not skip:
                    raise ConvertError(f"{source.url}: line {damage.line}: {damage.reason}") from None
                # The partial line (possibly empty) stands for everything the damage made unreadable.
                lines += 1
                rejects.add(damage.line, damage.partial, damage.reason + "; the rest of the file is unreadable")
            data_size = spiller.close()
            stream.close()
            rejects.commit()
        except BaseException as exn:
            _abort(stream)
            rejects.abort()
            if isinstance(exn, Exception):  # (not an interrupt: a preempted task is requeued and retries)
                # Tells the other tasks of an array, which would otherwise wait for this input forever. A
                # bad record fails again on every attempt; anything else (a permission, a full disk) may not.
                marker = {
                    "error": f"{exn}" if isinstance(exn, ConvertError) else f"{type(exn).__name__}: {exn}",
                    "on_bad_record": self.on_bad_record,
                    "transient": not isinstance(exn, ConvertError),
                }
                with contextlib.suppress(OSError):  # (the failure being reported may be the disk itself)
                    WorkDir.write_json(self.workdir.unit_failed(self.unit), marker)
            raise
        done = {
            "unit": self.unit,
            "url": source.url,
            "lines": lines,
            "blank_lines": blank,
            "records": lines - blank,
            "accepted": int(spiller.counts.sum()),
            "rejected": rejects.count,
            "bytes_in": reader.bytes_out,
            "data_size": data_size,
            "spills": spiller.spills,
            "bucket_counts": spiller.counts.tolist(),
            "bucket_tar_bytes": spiller.tar_bytes.tolist(),
            "bucket_payload_bytes": spiller.payload_bytes.tolist(),
        }
        WorkDir.write_json(self.workdir.unit_done(self.unit), done)
        _TestHook.reached("unit")
        return done


class BucketJob:
    """Writes one bucket: loads it (or key slices of it, when it exceeds the budget), sorts it by
    random key, and writes its records into their shards, then the bucket's done-file."""

    def __init__(
        self,
        plan: Plan,
        workdir: WorkDir,
        bucket: int,
        layout: ShardLayout,
        data_sizes: Sequence[int],
        budget: int,
    ):
        self.plan = plan
        self.workdir = workdir
        self.bucket = bucket
        self.layout = layout
        self.data_sizes = data_sizes
        self.budget = budget

    def run(self) -> dict[str, Any]:
        codec = PayloadCodec(extensions_of(self.plan.settings["format"]))
        reader = BucketReader(self.workdir, self.data_sizes, self.bucket)
        count = reader.count
        expected = int(self.layout.counts[self.bucket])
        if count != expected:
            raise ConvertError(f"bucket {self.bucket}: {count} records in the data files, {expected} in the done-files")
        sink = shard_sink(self.plan.output, self.workdir.staging(self.bucket))
        per_unit = np.zeros(len(self.plan.inputs), dtype=np.int64)
        cutter = ShardCutter(
            self.layout,
            self.bucket,
            sink,
            self.plan.shard_name,
            lambda bucket: BucketReader(self.workdir, self.data_sizes, bucket),
            codec,
            per_unit,
        )
        # The shard being assembled holds up to two blocks besides the records.
        budget = max(self.budget - 2 * ShardAssembler.BLOCK, self.budget // 2)
        try:
            if reader.weight <= budget:
                loaded = reader.load()
                _write_sorted(cutter, codec, loaded, loaded.order(), per_unit)
                del loaded
            else:
                # Too big for the budget (compressed inputs expanded more than assumed, or many
                # workers share a small budget): sort the headers alone, then load and write the
                # records one key slice at a time.
                keys, sizes = reader.headers()
                order = np.argsort(keys, kind="stable")
                slices = key_slices(keys[order], sizes[order] + BucketReader.PER_RECORD, budget // 2)
                del keys, sizes, order
                logger.info("bucket %d exceeds the memory budget: writing it in %d slices", self.bucket, len(slices))
                for low, high in slices:
                    part = reader.load_slice(low, high)
                    _write_sorted(cutter, codec, part, part.order(), per_unit)
                    del part
            written = cutter.close()
        except BaseException:
            cutter.abort()
            raise
        sink.commit()
        done = {
            "bucket": self.bucket,
            "shards": written,
            "per_unit": [[unit, int(n)] for unit, n in enumerate(per_unit.tolist()) if n],
        }
        WorkDir.write_json(self.workdir.bucket_done(self.bucket), done)
        _TestHook.reached("bucket")
        return done


def extensions_of(fmt: str) -> tuple[str, ...]:
    """The members of a sample, in the (sorted) order TarWriter writes them."""
    return ("json", "txt") if fmt == FORMAT_TXT_JSON else ("msgpack",)


def _write_sorted(
    cutter: ShardCutter, codec: PayloadCodec, loaded: LoadedRecords, order: np.ndarray, per_unit: np.ndarray
) -> None:
    view = memoryview(loaded.buffer)
    try:
        starts = loaded.starts[order].tolist()
        units = loaded.units[order].tolist()
        for count, (start, unit) in enumerate(zip(starts, units, strict=True), start=1):
            writer = cutter.take()
            if writer is not None:
                writer.add(*codec.decode(view, start))
                per_unit[unit] += 1
            if count % 1024 == 0:
                _report_progress(1024)
        _report_progress(len(starts) % 1024)
    finally:
        cutter.flush()  # the shard being written holds views of the buffer
        view.release()
        loaded.release()


def _run_scatter(plan: Plan, workdir: WorkDir, unit: int, budget: int, on_bad_record: str) -> dict[str, Any]:
    return ScatterJob(plan, workdir, unit, budget, on_bad_record).run()


def _run_bucket(
    plan: Plan, workdir: WorkDir, bucket: int, layout: ShardLayout, sizes: list[int], budget: int
) -> dict[str, Any]:
    return BucketJob(plan, workdir, bucket, layout, sizes, budget).run()


# ---------------------------------------------------------------------------------------------
# Running jobs in processes, with progress


T = TypeVar("T")


class JobRunner:
    """Runs jobs in this process (one worker) or in a process pool, with a tqdm bar fed by the jobs.

    On the first failure the jobs not yet started are cancelled, running ones finish (their work
    is kept for the next run), and the error is raised.
    """

    def __init__(self, workers: int, progress: bool):
        self.workers = workers
        self.progress = progress

    def run(
        self,
        function: Callable[..., T],
        jobs: Sequence[tuple[Any, ...]],
        description: str,
        total: int,
        unit: str,
        on_done: Callable[[T], None] | None = None,
    ) -> list[T]:
        from tqdm import tqdm

        global _progress
        bar = tqdm(
            total=total, desc=description, unit=unit, unit_scale=True, disable=not self.progress, file=sys.stderr
        )
        results: list[T] = []
        try:
            if self.workers == 1 or len(jobs) <= 1:

                def advance(n: int) -> None:
                    bar.update(n)

                saved, _progress = _progress, advance
                try:
                    for job in jobs:
                        result = function(*job)
                        results.append(result)
                        if on_done:
                            on_done(result)
                finally:
                    _progress = saved
                return results
            context = multiprocessing.get_context()  # the platform's default start method
            counter = context.Value("q", 0)
            with ProcessPoolExecutor(
                max_workers=min(self.workers, len(jobs)),
                mp_context=context,
                initializer=_init_worker,
                initargs=(counter,),
            ) as pool:
                pending: set[Future[T]] = {pool.submit(function, *job) for job in jobs}
                shown = 0
                try:
                    while pending:
                        done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                        value = counter.value
                        bar.update(value - shown)
                        shown = value
                        for future in done:
                            result = future.result()
                            results.append(result)
                            if on_done:
                                on_done(result)
                except BaseException:
                    for future in pending:
                        future.cancel()
                    raise
            return results
        finally:
            bar.close()


# ---------------------------------------------------------------------------------------------
# Reports


@dataclass
class InputReport:
    url: str
    lines: int = 0
    blank_lines: int = 0
    records: int = 0
    samples: int = 0
    rejected: int = 0

    @property
    def balanced(self) -> bool:
        return self.records == self.samples + self.rejected

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "lines": self.lines,
            "blank_lines": self.blank_lines,
            "records": self.records,
            "samples": self.samples,
            "rejected": self.rejected,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> InputReport:
        return cls(
            record["url"],
            record.get("lines", 0),
            record.get("blank_lines", 0),
            record.get("records", 0),
            record.get("samples", 0),
            record.get("rejected", 0),
        )


@dataclass
class ConvertReport:
    """What a run of ``convert`` did (one task's share, or the whole conversion once finalized)."""

    output: str
    workdir: str
    task_index: int = 0
    task_count: int = 1
    units_done: int = 0  # units this run scattered
    buckets_done: int = 0  # buckets this run wrote
    bytes_in: int = 0  # uncompressed input bytes this run scattered
    finalized: bool = False
    already_done: bool = False
    inputs: list[InputReport] = field(default_factory=list)
    num_shards: int = 0
    num_samples: int = 0
    size: int = 0
    manifest_url: str | None = None
    rejects_url: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def rejected(self) -> int:
        return sum(item.rejected for item in self.inputs)

    def summary(self) -> str:
        """A plain-text table: per input, lines / blank / records / samples / rejected, then totals."""
        out = []
        if self.already_done:
            out.append(f"already converted: {self.manifest_url} matches these inputs and settings")
        if self.inputs:
            width = max(len("input"), *(len(_short(item.url)) for item in self.inputs))
            header = f"{'input':<{width}}  {'lines':>10}  {'blank':>7}  {'records':>10}  {'samples':>10}  "
            out.append(header + f"{'rejected':>8}  check")
            totals = InputReport("total")
            for item in self.inputs:
                for name in ("lines", "blank_lines", "records", "samples", "rejected"):
                    setattr(totals, name, getattr(totals, name) + getattr(item, name))
            for item in [*self.inputs, totals]:
                out.append(
                    f"{_short(item.url):<{width}}  {item.lines:>10,}  {item.blank_lines:>7,}  {item.records:>10,}  "
                    f"{item.samples:>10,}  {item.rejected:>8,}  {'ok' if item.balanced else 'MISMATCH'}"
                )
        if self.finalized or self.already_done:
            out.append(
                f"{self.num_shards} shards, {self.num_samples:,} samples, {self.size / 1e6:,.1f} MB; "
                f"manifest {self.manifest_url}"
            )
            if self.rejects_url:
                out.append(f"{self.rejected:,} rejected records: {self.rejects_url}")
        else:
            out.append(
                f"task {self.task_index}/{self.task_count}: scattered {self.units_done} inputs, "
                f"wrote {self.buckets_done} buckets; workdir {self.workdir}"
            )
        if self.seconds:
            phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())
            total = sum(self.seconds.values())
            rate = (
                f"; {self.bytes_in / 1e6:,.1f} MB of JSONL at {self.bytes_in / 1e6 / total:,.1f} MB/s"
                if (self.bytes_in and total > 0)
                else ""
            )
            out.append(f"time: {phases}{rate}")
        return "\n".join(out)


def _short(url: str, width: int = 60) -> str:
    return url if len(url) <= width else "..." + url[-(width - 3) :]


# ---------------------------------------------------------------------------------------------
# The conversion


class Converter:
    """Runs the phases of one task of a conversion (all tasks and phases when alone)."""

    def __init__(self, options: ConvertOptions):
        options.check()
        self.options = options
        self.workdir = WorkDir(options.work_directory)
        self.runner = JobRunner(options.workers, options.progress)
        self.report = ConvertReport(
            output=options.output,
            workdir=self.workdir.root,
            task_index=options.task_index,
            task_count=options.task_count,
        )

    @property
    def budget(self) -> int:
        """Memory for the data of one worker process."""
        return self.options.memory // self.options.workers

    # -- plan ------------------------------------------------------------------------------

    def _plan(self) -> Plan | None:
        """Load the plan, or make it (first run); None when the output already is this conversion."""
        options = self.options
        existing = WorkDir.read_json(self.workdir.plan)
        inputs = expand_inputs(options.inputs) if options.inputs else None
        settings = plan_settings(options)
        plan = Plan.from_json(json.dumps(existing).encode(), self.workdir.plan) if existing is not None else None
        if plan is not None and inputs is not None:
            self._check_same(plan, inputs, settings)
        if plan is not None and plan.output != options.output:
            raise ConvertError(
                f"the work directory {self.workdir.root} belongs to a conversion into {plan.output}, "
                f"not {options.output}"
            )
        if plan is None and inputs is None:
            finished = self._converted_manifest()
            if finished is not None and options.phase in ("write", "finalize"):
                # A resubmitted write/finalize task of a conversion that finished (and removed its plan).
                self._report_from_manifest(finished)
                return None
            raise ConvertError(f"no plan in {self.workdir.root}: run the scatter phase first (or pass the inputs)")
        wanted = plan.fingerprint if plan is not None else fingerprint(inputs or [], settings)
        finished = self._finished_manifest(wanted)
        if finished is not None:
            self._report_from_manifest(finished)
            if not options.keep_workdir and os.path.isdir(self.workdir.root):
                self.workdir.remove()  # (killed after the manifest, before the work directory was removed)
            return None
        if plan is not None:
            return plan
        assert inputs is not None
        if options.phase in ("write", "finalize"):
            raise ConvertError(f"no plan in {self.workdir.root}: run the scatter phase first")
        self._check_output_free()
        buckets = options.buckets or choose_buckets(inputs, options.memory, options.workers, options.task_count)
        plan = Plan(inputs, options.output, settings, buckets)
        os.makedirs(self.workdir.root, exist_ok=True)
        # Tasks of an array may race here: they all compute the same plan, and the write is atomic.
        write_bytes_atomic(self.workdir.plan, plan.to_json())
        logger.info("plan: %d inputs, %d buckets, workdir %s", len(inputs), buckets, self.workdir.root)
        return plan

    def _check_same(self, plan: Plan, inputs: list[InputFile], settings: dict[str, Any]) -> None:
        differences = [
            f"{key}: {plan.settings.get(key)!r} then, {value!r} now"
            for key, value in settings.items()
            if plan.settings.get(key) != value
        ]
        before = {item.url: item.size for item in plan.inputs}
        now = {item.url: item.size for item in inputs}
        if before != now:
            changed = sorted(set(before.items()) ^ set(now.items()))
            differences.append("inputs differ: " + ", ".join(f"{url} ({size} bytes)" for url, size in changed[:4]))
        if differences:
            raise ConvertError(
                f"the work directory {self.workdir.root} holds a conversion with other inputs or settings ("
                + "; ".join(differences)
                + "): pass another --workdir, or remove it to start over"
            )

    def _manifest_url(self) -> str:
        return f"{self.options.output}/{MANIFEST_NAME}"

    def _finished_manifest(self, wanted: str) -> Manifest | None:
        manifest = self._converted_manifest()
        conversion = (manifest.conversion or {}) if manifest is not None else {}
        return manifest if conversion.get("fingerprint") == wanted else None

    def _converted_manifest(self) -> Manifest | None:
        """The output's manifest, if a conversion wrote one."""
        try:
            manifest = Manifest.load(self._manifest_url())
        except (FileNotFoundError, IndexFormatError, OSError, ValueError):
            return None
        except Exception as exn:  # S3 clients raise their own kinds for a missing key
            logger.debug("no finished manifest at %s (%s)", self._manifest_url(), exn)
            return None
        return manifest if (manifest.conversion or {}).get("fingerprint") else None

    def _report_from_manifest(self, manifest: Manifest) -> None:
        report = self.report
        report.already_done = True
        report.manifest_url = self._manifest_url()
        report.inputs = [InputReport.from_dict(item) for item in manifest.inputs or []]
        report.num_shards, report.num_samples, report.size = len(manifest.shards), manifest.num_samples, manifest.size
        rejects = (manifest.conversion or {}).get("rejects")
        report.rejects_url = f"{self.options.output}/{rejects}" if rejects else None

    def _existing_outputs(self) -> list[str]:
        """Files in the output that a conversion named like this one would write (or a manifest)."""
        name = self.options.dataset_name
        pattern = re.compile(rf"({re.escape(name)}-\d+\.tar(\.idx)?|{MANIFEST_NAME}|{REJECTS_NAME})")
        output = self.options.output
        if is_s3(output):
            parsed = urlparse(output + "/")
            prefix = parsed.path.lstrip("/")
            found = []
            paginator = s3_client().get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=parsed.netloc, Prefix=prefix, Delimiter="/"):
                for item in page.get("Contents", []):
                    if pattern.fullmatch(item["Key"][len(prefix) :]):
                        found.append(f"s3://{parsed.netloc}/{item['Key']}")
            return found
        path = local_path(output) or output
        if not os.path.isdir(path):
            return []
        return sorted(os.path.join(path, n) for n in os.listdir(path) if pattern.fullmatch(n))

    def _check_output_free(self) -> None:
        existing = self._existing_outputs()
        if not existing:
            return
        if not self.options.overwrite:
            raise ConvertError(
                f"{self.options.output} already holds a dataset ({len(existing)} files such as "
                f"{posixpath.basename(existing[0])}): pass --overwrite to replace it"
            )
        logger.warning("removing %d files of the previous dataset in %s", len(existing), self.options.output)
        for url in existing:
            with contextlib.suppress(FileNotFoundError):  # (the other tasks of an array remove them too)
                remove(url)

    # -- phases ----------------------------------------------------------------------------

    def run(self) -> ConvertReport:
        started = time.perf_counter()
        plan = self._plan()
        self.report.seconds["plan"] = time.perf_counter() - started
        if plan is None:
            return self.report
        phase = self.options.phase
        if phase in ("all", "scatter"):
            self._timed("scatter", lambda: self._scatter(plan))
        if phase in ("all", "write"):
            if not self._all_units_done(plan, wait_for_others=phase == "all"):
                raise ConvertError(f"the scatter phase has not finished: {self._missing_units(plan)}")
            self._timed("write", lambda: self._write(plan))
        if phase == "finalize" or (phase == "all" and self._all_buckets_done(plan)):
            self._timed("finalize", lambda: self._finalize_once(plan, forced=phase == "finalize"))
        return self.report

    def _timed(self, name: str, step: Callable[[], None]) -> None:
        started = time.perf_counter()
        step()
        self.report.seconds[name] = time.perf_counter() - started

    def _my_units(self, plan: Plan) -> list[int]:
        """This task's inputs: largest first, each to the least loaded task (deterministic)."""
        count = self.options.task_count
        if count == 1:
            return list(range(len(plan.inputs)))
        loads = [0] * count
        mine = []
        for unit in sorted(range(len(plan.inputs)), key=lambda u: (-plan.inputs[u].size, u)):
            task = min(range(count), key=lambda t: (loads[t], t))
            loads[task] += plan.inputs[unit].size + 1
            if task == self.options.task_index:
                mine.append(unit)
        return sorted(mine)

    def _scatter(self, plan: Plan) -> None:
        todo = [unit for unit in self._my_units(plan) if not os.path.exists(self.workdir.unit_done(unit))]
        if not todo:
            return
        os.makedirs(os.path.dirname(self.workdir.unit_data(0)), exist_ok=True)
        budget = self.budget
        jobs = [(plan, self.workdir, unit, budget, self.options.on_bad_record) for unit in todo]
        total = sum(plan.inputs[unit].size for unit in todo)

        def done(result: dict[str, Any]) -> None:
            self.report.units_done += 1
            self.report.bytes_in += result["bytes_in"]

        self.runner.run(_run_scatter, jobs, "scatter", total, "B", on_done=done)

    def _missing_units(self, plan: Plan) -> str:
        missing = [u for u in range(len(plan.inputs)) if not os.path.exists(self.workdir.unit_done(u))]
        shown = ", ".join(plan.inputs[u].url for u in missing[:5])
        return f"{len(missing)} inputs not scattered yet ({shown}{', ...' if len(missing) > 5 else ''})"

    def _all_units_done(self, plan: Plan, wait_for_others: bool) -> bool:
        def missing() -> list[int]:
            return [u for u in range(len(plan.inputs)) if not os.path.exists(self.workdir.unit_done(u))]

        left = missing()
        if not left or not wait_for_others or self.options.task_count == 1:
            return not left
        from tqdm import tqdm

        logger.info("waiting for other tasks to scatter %d inputs", len(left))
        deadline = None if self.options.wait_timeout is None else time.monotonic() + self.options.wait_timeout
        total = len(plan.inputs)
        with tqdm(
            total=total,
            desc="waiting for other tasks",
            unit="input",
            disable=not self.options.progress,
            file=sys.stderr,
        ) as bar:
            bar.update(total - len(left))
            while left:
                for unit in left:
                    failure = self._failure(unit)
                    if failure is not None:
                        hint = " (rerun once it is fixed)" if failure.get("transient") else ""
                        raise ConvertError(f"another task failed on {plan.inputs[unit].url}: {failure['error']}{hint}")
                if deadline is not None and time.monotonic() > deadline:
                    raise ConvertError(f"gave up waiting for other tasks: {self._missing_units(plan)}")
                time.sleep(self.options.poll_interval)
                now = missing()
                bar.update(len(left) - len(now))
                left = now
        return True

    def _failure(self, unit: int) -> dict[str, Any] | None:
        """The failure another task recorded for a unit: waiting on would be forever. A bad record fails
        on every attempt under the same --on-bad-record (one recorded under the other policy is from an
        earlier attempt, which the unit's owner clears when it retries). Any other failure also stops
        the waiters, even one an earlier attempt left (quitting early is recoverable by a rerun; waiting
        for an input nobody is converting is not)."""
        failure = WorkDir.read_json(self.workdir.unit_failed(unit))
        if failure is None or failure.get("on_bad_record") != self.options.on_bad_record:
            return None
        return failure

    def _layout(self, plan: Plan) -> tuple[ShardLayout, list[int]]:
        """The shard layout, and each unit's data size. Done-files are summed as they are read, not kept:
        each holds two counts per bucket (inputs x buckets of them would not fit in any budget)."""
        counts = np.zeros(plan.buckets, dtype=np.int64)
        tar_bytes = np.zeros(plan.buckets, dtype=np.int64)
        sizes = []
        for unit in range(len(plan.inputs)):
            done = WorkDir.read_json(self.workdir.unit_done(unit))
            if done is None:
                raise ConvertError(f"the scatter phase has not finished: {self._missing_units(plan)}")
            counts += np.asarray(done["bucket_counts"], dtype=np.int64)
            tar_bytes += np.asarray(done["bucket_tar_bytes"], dtype=np.int64)
            sizes.append(int(done["data_size"]))
        settings = plan.settings
        return ShardLayout(counts, tar_bytes, settings["samples_per_shard"], settings["shard_size"]), sizes

    def _my_buckets(self, plan: Plan) -> list[int]:
        return list(range(self.options.task_index, plan.buckets, self.options.task_count))

    def _write(self, plan: Plan) -> None:
        layout, sizes = self._layout(plan)
        todo = [b for b in self._my_buckets(plan) if not os.path.exists(self.workdir.bucket_done(b))]
        if not todo:
            return
        os.makedirs(os.path.dirname(self.workdir.bucket_done(0)), exist_ok=True)
        if not is_s3(plan.output):
            os.makedirs(local_path(plan.output) or plan.output, exist_ok=True)
        jobs = [(plan, self.workdir, b, layout, sizes, self.budget) for b in todo]
        total = int(sum(layout.counts[b] for b in todo))

        def done(result: dict[str, Any]) -> None:
            self.report.buckets_done += 1

        self.runner.run(_run_bucket, jobs, "write", total, "sample", on_done=done)

    def _all_buckets_done(self, plan: Plan) -> bool:
        return all(os.path.exists(self.workdir.bucket_done(b)) for b in range(plan.buckets))

    # -- finalize --------------------------------------------------------------------------

    def _finalize_once(self, plan: Plan, forced: bool) -> None:
        """Only one task of an array finalizes (the first to take the lock); ``--phase finalize`` always does."""
        if not forced and not self._take_finalize_lock():
            return
        try:
            layout, _ = self._layout(plan)
            Finalizer(plan, self.workdir, layout, self.options, self.report).run()
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.workdir.finalize_lock)
            raise

    def _take_finalize_lock(self) -> bool:
        """The finalize lock, naming the task that holds it. A lock held by this task's own index was
        left by an earlier run of this task killed while finalizing (SLURM runs one process per array
        index at a time: a requeue or a rerun of the command): it is taken over. So is an empty one
        (killed between creating and writing it); finalizing twice is harmless, it is deterministic
        and every write is atomic."""
        path = self.workdir.finalize_lock
        task = self.options.task_index
        for _ in range(2):
            try:
                descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileNotFoundError:  # the work directory is gone: finalized already
                return False
            except FileExistsError:
                with open(path, "rb") as lock:
                    owner = lock.read()
                holder = json.loads(owner).get("task") if owner else None
                if owner and holder != task:
                    logger.info("task %s is finalizing", holder)
                    return False
                logger.warning("taking over the finalize lock left by an earlier run of task %d", task)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            with os.fdopen(descriptor, "wb") as lock:
                lock.write(json.dumps({"task": task, "pid": os.getpid()}).encode())
            return True
        return False


class Finalizer:
    """Checks the books, writes the manifest and the rejects file, and removes the work directory.

    The books: for every input, the records read (non-blank lines) must equal the samples found in
    the shards (counted by the write phase, per input) plus the records rejected, and every shard
    must exist with the size its index records.
    """

    def __init__(
        self, plan: Plan, workdir: WorkDir, layout: ShardLayout, options: ConvertOptions, report: ConvertReport
    ):
        self.plan = plan
        self.workdir = workdir
        self.layout = layout
        self.options = options
        self.report = report

    def run(self) -> None:
        plan = self.plan
        missing = [b for b in range(plan.buckets) if not os.path.exists(self.workdir.bucket_done(b))]
        if missing:
            owners = sorted({b % self.options.task_count for b in missing})
            raise ConvertError(
                f"the write phase has not finished: {len(missing)} buckets left (e.g. {missing[:5]}; "
                f"tasks {owners[:10]} of {self.options.task_count})"
            )
        inputs = []
        for unit, source in enumerate(plan.inputs):
            done = WorkDir.read_json(self.workdir.unit_done(unit))
            if done is None:
                raise ConvertError(f"no scatter record for {source.url}")
            inputs.append(
                InputReport(source.url, done["lines"], done["blank_lines"], done["records"], 0, done["rejected"])
            )
        shards: list[dict[str, Any]] = []
        for bucket in range(plan.buckets):
            done = WorkDir.read_json(self.workdir.bucket_done(bucket))
            assert done is not None
            shards.extend(done["shards"])
            for unit, count in done["per_unit"]:
                inputs[unit].samples += count
        expected = [plan.shard_name(shard) for shard in range(self.layout.total_shards)]
        if [shard["name"] for shard in shards] != expected:
            raise ConvertError(f"the buckets wrote {len(shards)} shards, {len(expected)} expected")
        unbalanced = [item for item in inputs if not item.balanced]
        if unbalanced:
            raise ConvertError(
                "records lost: "
                + "; ".join(
                    f"{i.url}: {i.records} read, {i.samples} written, {i.rejected} rejected" for i in unbalanced
                )
            )
        self._check_shards(shards)
        rejects = self._merge_rejects()
        conversion = {
            "tool": "wdsraft convert",
            "fingerprint": plan.fingerprint,
            **plan.settings,
            "samples_per_shard_used": self.layout.per_shard,
            "rejects": REJECTS_NAME if rejects else None,
        }
        manifest = Manifest(name=plan.name, inputs=[item.to_dict() for item in inputs], conversion=conversion)
        for shard in shards:
            manifest.shards.append(ManifestEntry(shard["name"], shard["samples"], shard["size"], shard["sha256"]))
        if manifest.num_samples != sum(item.samples for item in inputs):
            raise ConvertError(
                f"the shards hold {manifest.num_samples} samples, the buckets wrote {sum(i.samples for i in inputs)}"
            )
        manifest_url = f"{plan.output}/{MANIFEST_NAME}"
        manifest.save(manifest_url)
        report = self.report
        report.finalized = True
        report.inputs = inputs
        report.num_shards, report.num_samples, report.size = len(shards), manifest.num_samples, manifest.size
        report.manifest_url = manifest_url
        report.rejects_url = f"{plan.output}/{REJECTS_NAME}" if rejects else None
        logger.info("finalized %s: %d shards, %d samples", manifest_url, len(shards), manifest.num_samples)
        if not self.options.keep_workdir:
            self.workdir.remove()

    def _check_shards(self, shards: list[dict[str, Any]]) -> None:
        output = self.plan.output
        if is_s3(output):
            parsed = urlparse(output + "/")
            prefix = parsed.path.lstrip("/")
            sizes = {}
            for page in s3_client().get_paginator("list_objects_v2").paginate(Bucket=parsed.netloc, Prefix=prefix):
                for item in page.get("Contents", []):
                    sizes[item["Key"][len(prefix) :]] = int(item["Size"])
        else:
            directory = local_path(output) or output
            sizes = {n: os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)}
        wrong = [
            shard["name"]
            for shard in shards
            if sizes.get(shard["name"]) != shard["size"] or shard["name"] + INDEX_SUFFIX not in sizes
        ]
        if wrong:
            raise ConvertError(f"shards missing or of the wrong size in {output}: {', '.join(wrong[:5])}")

    def _merge_rejects(self) -> bool:
        parts = [self.workdir.unit_rejects(u) for u in range(len(self.plan.inputs))]
        parts = [path for path in parts if os.path.exists(path)]
        target = f"{self.plan.output}/{REJECTS_NAME}"
        if not parts:
            return False
        stream = open_atomic(target)
        try:
            for path in parts:
                with open(path, "rb") as handle:
                    shutil.copyfileobj(handle, stream, 1 << 20)
        except BaseException:
            _abort(stream)
            raise
        stream.close()
        return True


def convert(options: ConvertOptions) -> ConvertReport:
    """Run (this task's share of) a conversion; see the module docstring and ``wdsraft convert --help``."""
    return Converter(options).run()
