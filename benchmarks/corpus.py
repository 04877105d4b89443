"""The benchmarks' corpus: one that every clone has, replicated deterministically.

Every script takes ``--corpus PATH`` and ``--copies N``. The default corpus is the bundled
``examples/data/kernel-docs-sample.jsonl.zst``: 434 documents of the Linux kernel's
documentation as JSONL (``{"id", "text"}`` per line, 2.5 MB uncompressed). It is used ``N``
times over: copy ``c`` of document ``n`` is keyed ``{c:04d}-{n:08d}`` and is otherwise the same
record (``convert_throughput.py`` copies the file ``N`` times under distinct names instead), so
a clone reproduces the same input byte for byte. Twenty copies are about the size of the full
corpus the project's older figures used (``kernel-docs.jsonl.zst``, 8,667 documents, not in
the repository); pass it with ``--corpus`` where you have it. Each script prints the corpus
and the size it used at the top of its output.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import zstandard

REPOSITORY = Path(__file__).resolve().parent.parent
SAMPLE = REPOSITORY / "examples" / "data" / "kernel-docs-sample.jsonl.zst"


def add_arguments(parser: argparse.ArgumentParser, copies: int) -> None:
    """``--corpus`` and ``--copies``, the same in every script (``copies``: this script's default)."""
    parser.add_argument(
        "--corpus",
        type=Path,
        default=SAMPLE,
        help="a .jsonl.zst file of {'id', 'text'} records (default: the bundled 434-document "
        "examples/data/kernel-docs-sample.jsonl.zst, in every clone)",
    )
    parser.add_argument(
        "--copies",
        type=int,
        default=copies,
        help=f"use the corpus this many times over, keys made distinct (default {copies}; "
        "20 copies of the bundled sample are about the full 8,667-document corpus)",
    )


def documents(path: Path) -> Iterator[dict]:
    """The records of a ``.jsonl.zst`` file, in order."""
    with open(path, "rb") as raw:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8"):
            yield json.loads(line)


def replicated(path: Path, copies: int) -> Iterator[tuple[str, dict]]:
    """``(key, record)`` for every copy of every record: copy-major, the same on every machine."""
    records = list(documents(path))
    for copy in range(copies):
        for number, record in enumerate(records):
            yield f"{copy:04d}-{number:08d}", record


def jsonl_bytes(path: Path) -> int:
    """The uncompressed size of a ``.jsonl.zst`` file."""
    with open(path, "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        return sum(len(chunk) for chunk in iter(lambda: reader.read(1 << 20), b""))


def describe(path: Path, copies: int) -> str:
    """One line naming the corpus (path, checksum, size) and the size used."""
    count = sum(1 for _ in documents(path))
    size = jsonl_bytes(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    try:
        shown = str(path.resolve().relative_to(REPOSITORY))
    except ValueError:
        shown = str(path)
    return (
        f"corpus: {shown} (sha256 {digest}..., {count:,} documents, {size / 1e6:.1f} MB of JSONL) "
        f"x {copies} copies = {count * copies:,} documents, {size * copies / 1e6:.0f} MB of JSONL"
    )
