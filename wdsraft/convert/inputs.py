"""Inputs: paths, globs, brace patterns, directories and ``s3://`` keys or prefixes expanded into input
files (URL, stored size, compression), each given a unique tar-safe name.
"""

from __future__ import annotations

import collections
import glob
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any
from urllib.parse import urlparse

import braceexpand
import zstandard

from wdsraft.convert.keys import tar_safe_key
from wdsraft.convert.options import ConvertError
from wdsraft.io.s3 import list_objects, s3_client, split_s3_url
from wdsraft.io.storage import is_s3, local_path

# Assumed expansion of compressed inputs whose uncompressed size their header does not tell.
_ASSUMED_RATIO = {"gzip": 4, "zstd": 5, "bz2": 5, "xz": 6}
_COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
_DATA_SUFFIXES = (".jsonl", ".ndjson", ".json")


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
    # What tells a changed file from the planned one at the same size: the modification time in ns of a
    # local file, the ETag of an S3 object; None where unknown (a plan written before it was recorded).
    # Not part of the fingerprint: the output depends on the contents only.
    version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "size": self.size,
            "compression": self.compression,
            "name": self.name,
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> InputFile:
        return cls(record["url"], record["size"], record.get("compression"), record["name"], record.get("version"))

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


Found = tuple[str, int, str]  # (url, stored size, version: see InputFile.version)


def _hidden(part: str) -> bool:
    return part.startswith(".")


def _glob_match(key: str, pattern: str) -> bool:
    """Whether an S3 key matches a glob as a local path would: component by component (``*``, ``?`` and
    ``[...]`` never match ``/``), and a wildcard never matches a leading dot (hidden names)."""
    parts, patterns = key.split("/"), pattern.split("/")
    return len(parts) == len(patterns) and all(
        fnmatchcase(part, wanted) and (not _hidden(part) or _hidden(wanted))
        for part, wanted in zip(parts, patterns, strict=True)
    )


def _list_s3(url: str) -> list[Found]:
    """Objects matching an ``s3://bucket/glob``, or the input files at any depth under an
    ``s3://bucket/prefix/`` but in hidden "directories" (as for a local directory)."""
    bucket, key = split_s3_url(url)
    magic = re.search(r"[*?\[]", key)
    prefix = key[: magic.start()] if magic else key

    def wanted(name: str) -> bool:
        if magic is not None:
            return _glob_match(name, key)
        return _looks_like_input(name) and not any(_hidden(part) for part in name[len(prefix) :].split("/"))

    listed = list_objects(f"s3://{bucket}/{prefix}")
    return sorted((item.url, item.size, item.etag) for item in listed if wanted(item.key))


def _walk_local(directory: str, excluded: frozenset[str] = frozenset()) -> list[str]:
    """The input files at any depth under a local directory (as under an S3 prefix), but in hidden
    directories and hidden files, and in ``excluded`` (real paths: the conversion's own output and work
    directories); directory links are followed, each directory once, in name order (a tree reached two
    ways is named the same way whatever the order a directory lists in)."""
    found: list[str] = []
    seen: set[str] = set()

    def unreadable(error: OSError) -> None:
        raise ConvertError(f"cannot read the input directory {error.filename} ({error.strerror})")

    for root, directories, files in os.walk(directory, onerror=unreadable, followlinks=True):
        real = os.path.realpath(root)
        if real in seen or real in excluded:  # (a link back up the tree; the conversion's own output)
            directories.clear()
            continue
        seen.add(real)
        directories[:] = sorted(name for name in directories if not _hidden(name))
        found.extend(os.path.join(root, name) for name in files if not _hidden(name) and _looks_like_input(name))
    return sorted(found)


def _s3_object(url: str) -> Found:
    bucket, key = split_s3_url(url)
    try:
        head = s3_client().head_object(Bucket=bucket, Key=key)
    except Exception as exn:
        raise ConvertError(f"input not found or not readable: {url} ({exn})") from None
    return url, int(head["ContentLength"]), str(head.get("ETag", ""))


def _local_file(url: str, path: str) -> Found:
    try:
        stat = os.stat(path)
    except OSError as exn:  # (a link to nothing, say)
        raise ConvertError(f"input not readable: {url} ({exn.strerror})") from None
    return url, stat.st_size, str(stat.st_mtime_ns)


def local_version(url: str) -> str | None:
    """The version (modification time) of a local input now; None for an S3 input or a missing file."""
    path = local_path(url)
    try:
        return None if path is None else str(os.stat(path).st_mtime_ns)
    except FileNotFoundError:
        return None


def expand_inputs(specs: Sequence[str], excluded: Sequence[str] = ()) -> list[InputFile]:
    """Input files from paths, globs, brace patterns, directories, ``s3://`` keys, globs and prefixes
    (ending in ``/``). Directories and prefixes contribute their ``.jsonl``/``.ndjson``/``.json``
    files, plain or compressed, at any depth; a glob's wildcards match within one path component, on
    S3 as locally. Hidden names are left out of both, and so are the local directories ``excluded``
    (the conversion's output and work directories, when they lie inside an input directory). Each
    pattern's matches are sorted; the order of patterns is kept."""
    skipped = frozenset(os.path.realpath(local_path(path) or path) for path in excluded if not is_s3(path))
    found: list[Found] = []
    for spec in specs:
        for item in braceexpand.braceexpand(spec):
            if is_s3(item):
                if item.endswith("/") or re.search(r"[*?\[]", item):
                    matches = _list_s3(item)
                    if not matches:
                        raise ConvertError(f"no input matches {item}")
                    found.extend(matches)
                else:
                    found.append(_s3_object(item))
            elif urlparse(item).scheme not in ("", "file"):
                raise ConvertError(f"unsupported input URL {item} (local paths and s3:// only)")
            else:
                path = local_path(item) or item
                if os.path.isdir(path):
                    names = _walk_local(path, skipped)
                    if not names:
                        raise ConvertError(f"no .jsonl files in or under directory {item}")
                    found.extend(_local_file(name, name) for name in names)
                elif glob.has_magic(path):
                    names = sorted(p for p in glob.glob(path) if os.path.isfile(p))
                    if not names:
                        raise ConvertError(f"no input matches {item}")
                    found.extend(_local_file(name, name) for name in names)
                else:
                    if not os.path.isfile(path):
                        raise ConvertError(f"input not found: {item}")
                    found.append(_local_file(item, path))
    seen: dict[str, str] = {}
    for url, _, _ in found:
        # The same file spelled two ways (./a, a, /abs/a, file://...) would be converted twice.
        identity = url if is_s3(url) else os.path.realpath(local_path(url) or url)
        if identity in seen:
            twice = url if seen[identity] == url else f"{url} (the same file as {seen[identity]})"
            raise ConvertError(f"input given twice: {twice}")
        seen[identity] = url
    inputs = [InputFile(url, size, _split_suffixes(url)[1], "", version) for url, size, version in found]
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
