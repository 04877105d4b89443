"""A local directory and an S3 prefix holding the same tree give the same inputs (every input file at any
depth, hidden names left out), and so do a local glob and the same glob on S3 (wildcards stay within one
path component, and do not match a leading dot)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from wdsraft.convert import ConvertError, expand_inputs

TREE = {
    "top.jsonl": 1,
    "en/x.jsonl": 2,
    "fr/sub/y.jsonl.gz": 3,
    "fr/sub/deeper/z.ndjson": 4,
    "notes.txt": 5,  # not an input file: left out of a directory, matched by a glob that names it
    ".hidden/h.jsonl": 6,
    "en/.partial.jsonl": 7,
}


@pytest.fixture
def trees(tmp_path: Path, s3_bucket: str) -> tuple[str, str]:
    """The same tree in a local directory and under an S3 prefix; returns both roots (no trailing /)."""
    import boto3

    client = boto3.client("s3")
    root = tmp_path / "in"
    for relative, n in TREE.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"text": "x" * n}) + "\n")
        client.put_object(Bucket=s3_bucket, Key=f"raw/{relative}", Body=path.read_bytes())
    return str(root), f"s3://{s3_bucket}/raw"


def _relative(spec: str, root: str) -> list[tuple[str, int]]:
    return [(item.url[len(root) + 1 :], item.size) for item in expand_inputs([spec])]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("/", ["en/x.jsonl", "fr/sub/deeper/z.ndjson", "fr/sub/y.jsonl.gz", "top.jsonl"]),
        ("/*.jsonl", ["top.jsonl"]),
        ("/*", ["notes.txt", "top.jsonl"]),
        ("/*/*.jsonl", ["en/x.jsonl"]),
        ("/**.jsonl", ["top.jsonl"]),  # (not recursive locally without recursive=True; nor on S3)
        ("/*/*/*", ["fr/sub/y.jsonl.gz"]),
        ("/en/.*.jsonl", ["en/.partial.jsonl"]),  # a pattern that names the dot matches hidden names
        ("/.hidden/*", [".hidden/h.jsonl"]),
        ("/f?/s[u]b/*.gz", ["fr/sub/y.jsonl.gz"]),
    ],
    ids=["directory", "star", "star-all", "one-level", "double-star", "three-levels", "dot", "in-hidden", "marks"],
)
def test_a_local_tree_and_the_same_s3_tree_give_the_same_inputs(trees, pattern: str, expected: list[str]) -> None:
    local, remote = trees
    local_found = _relative(local + pattern, local)
    remote_found = _relative(remote + pattern, remote)
    assert [name for name, _ in local_found] == expected
    assert remote_found == local_found, (remote_found, local_found)


def test_the_same_tree_gives_the_same_input_names(trees) -> None:
    """Names (which the shuffle keys and sample keys are made of) agree too: a directory converted
    locally or from S3 gives the same shards."""
    local, remote = trees
    assert [i.name for i in expand_inputs([local])] == [i.name for i in expand_inputs([remote + "/"])]


def test_a_directory_with_input_files_only_in_hidden_places_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d" / ".cache").mkdir(parents=True)
    (tmp_path / "d" / ".cache" / "a.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ConvertError, match=r"no \.jsonl files in or under directory"):
        expand_inputs([str(tmp_path / "d")])


def test_a_link_back_up_the_tree_is_walked_once(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "d" / "sub" / "loop").symlink_to(tmp_path / "d")
    assert [i.url for i in expand_inputs([str(tmp_path / "d")])] == [str(tmp_path / "d" / "sub" / "a.jsonl")]


def test_a_directory_linked_twice_is_named_by_its_first_name(tmp_path: Path) -> None:
    """A directory reached under two names is read once, under the name that sorts first, whatever the order
    the directory lists in: the same tree gives the same input names (and so the same shards) anywhere."""
    root = tmp_path / "in"
    (root / "b").mkdir(parents=True)
    (root / "b" / "x.jsonl").write_text('{"text": "x"}\n')
    (root / "a").symlink_to(root / "b")  # (a sorts first; a directory may list b first)
    assert [item.url for item in expand_inputs([str(root)])] == [str(root / "a" / "x.jsonl")]


def test_the_conversions_own_output_inside_an_input_directory_is_no_input(tmp_path: Path) -> None:
    """``convert data/ --output data/shards`` twice: the second run does not take the first one's manifest and
    rejects (JSON files under the input directory) for inputs; it finds the conversion done."""
    from wdsraft.convert import ConvertOptions, convert

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"text": f"t{n}"}) + "\n" for n in range(5)))
    (data / "b.jsonl").write_text('{"text": "ok"}\n{"broken\n')
    options = ConvertOptions(inputs=[str(data)], output=str(data / "shards"), on_bad_record="skip", name="ds")
    first = convert(options)
    assert (data / "shards" / "manifest.json").exists() and (data / "shards" / "rejects.jsonl").exists()
    again = convert(options)
    assert [item.url for item in expand_inputs([str(data)], excluded=[str(data / "shards")])] == [
        str(data / "a.jsonl"),
        str(data / "b.jsonl"),
    ]
    assert again.num_samples == first.num_samples == 6


def test_an_unreadable_input_directory_is_named(tmp_path: Path, monkeypatch) -> None:
    """A subdirectory that cannot be listed (no permission, a stale NFS handle) stops the conversion naming it:
    its inputs are not left out unseen."""
    root = tmp_path / "in"
    (root / "locked").mkdir(parents=True)
    (root / "locked" / "x.jsonl").write_text('{"text": "x"}\n')
    (root / "y.jsonl").write_text('{"text": "y"}\n')
    real_scandir = os.scandir

    def scandir(path: Any = ".") -> Any:  # (as for a directory without read permission, even for root)
        if os.fspath(path).endswith("locked"):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(ConvertError, match=r"cannot read the input directory .*locked \(Permission denied\)"):
        expand_inputs([str(root)])


def test_an_s3_prefix_with_a_hash_lists_that_prefix_only(s3_bucket: str) -> None:
    """``#`` and ``?`` are parts of an S3 key: a URL parser would cut ``data#1/`` to ``data`` and list
    ``data/`` too."""
    import boto3

    client = boto3.client("s3")
    for key in ("data#1/a.jsonl", "data/b.jsonl", "data2/c.jsonl"):
        client.put_object(Bucket=s3_bucket, Key=key, Body=b'{"text": "x"}\n')
    assert [item.url for item in expand_inputs([f"s3://{s3_bucket}/data#1/"])] == [f"s3://{s3_bucket}/data#1/a.jsonl"]
