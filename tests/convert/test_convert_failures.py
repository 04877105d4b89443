"""`wdsraft convert` when writing fails (a full disk, an I/O error, a quota, a permission): one line naming the
file being written, no temporary file left anywhere (hidden ones included), and a rerun once the cause is
gone gives byte for byte what a clean run gives."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from wdsraft import cli
from wdsraft.index.shard_index import ShardIndex
from wdsraft.io import storage

PYTHON = sys.executable
COMMON = ["--name", "ds", "--samples-per-shard", "700", "--workers", "1", "-q"]


def _inputs(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"text": "word " * (40 + n % 50), "n": n}) for n in range(2500)]
    lines[17] = "{oops"  # a bad record, so that rejects.jsonl is written too (--on-bad-record skip)
    path.write_text("\n".join(lines) + "\n")
    return path


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _temporaries(directory: Path) -> list[str]:
    return [str(p) for p in directory.rglob("*") if ".tmp-" in p.name]


@pytest.fixture
def clean(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    source = _inputs(tmp_path)
    out = tmp_path / "clean"
    assert cli.main(["convert", str(source), "-o", str(out), *COMMON, "--on-bad-record", "skip"]) == 0
    return source, _files(out)


def _limited(limit: int, *argv: str) -> subprocess.CompletedProcess[str]:
    """`wdsraft convert` in a process whose files may not grow past ``limit`` bytes (RLIMIT_FSIZE, with
    SIGXFSZ ignored: a write past it fails with EFBIG, as a full disk fails with ENOSPC)."""
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
        "from wdsraft.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run([PYTHON, "-c", code, "convert", *argv], capture_output=True, text=True, check=False)


@pytest.mark.parametrize("phase", ["scatter", "write"])
def test_a_file_size_limit_for_real(tmp_path: Path, clean, phase: str) -> None:
    source, expected = clean
    out = tmp_path / "out"
    argv = [str(source), "-o", str(out), *COMMON, "--on-bad-record", "skip"]
    if phase == "write":  # scatter with room, then the shards hit the limit
        subprocess.run([PYTHON, "-m", "wdsraft.cli", "convert", *argv, "--phase", "scatter"], check=True)
    # The scatter data file grows to about 1 MB, a shard to about 1.3 MB; scatter comes first.
    failed = _limited(300_000, *argv)
    assert failed.returncode == 1, failed.stderr
    (line,) = failed.stderr.splitlines()  # one line, no traceback
    name = "unit-000000.data" if phase == "scatter" else "ds-000000.tar"
    assert line.startswith("wdsraft: error: ") and line.endswith(f"{name}: File too large"), line
    assert _temporaries(out) == []
    assert not (out / "manifest.json").exists() and not list(out.glob("ds-*.tar"))
    # The limit lifted, a rerun finishes what is left: the same bytes as a clean run.
    assert cli.main(["convert", *argv]) == 0
    assert _files(out) == expected


class _Failing:
    """A file whose writes (or opening) fail with ``code`` once the file named ``target`` has had ``after``
    bytes; delegates everything else to the real file."""

    def __init__(self, real: Any, code: int, after: int):
        self._real, self._code, self._left = real, code, after

    def write(self, data: bytes) -> int:
        if len(data) > self._left:
            raise OSError(self._code, os.strerror(self._code))
        self._left -= len(data)
        return self._real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


CASES: dict[str, tuple[str, int, int | None]] = {
    "scatter data, disk full": ("unit-000000.data", errno.ENOSPC, 100_000),
    "unit rejects, I/O error": ("unit-000000.rejects.jsonl", errno.EIO, 0),
    "scatter done-file, quota": ("unit-000000.done", errno.EDQUOT, 0),
    "a shard, disk full": ("ds-000002.tar", errno.ENOSPC, 50_000),
    # Every sample written, then its end-of-archive blocks fail (written as the shard is closed).
    "a shard, at its closing write": ("ds-000003.tar", errno.ENOSPC, None),
    "a shard index, disk full": ("ds-000001.tar.idx", errno.ENOSPC, 0),
    "a bucket done-file, disk full": ("bucket-000000.done", errno.ENOSPC, 0),
    "rejects.jsonl, disk full": ("rejects.jsonl", errno.ENOSPC, 10),
    "the manifest, disk full": ("manifest.json", errno.ENOSPC, 100),
    "the manifest, permission": ("manifest.json", errno.EACCES, -1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_write_error_names_its_file_and_leaves_no_temporary(tmp_path, clean, monkeypatch, capsys, case) -> None:
    target, code, after = CASES[case]
    source, expected = clean
    if after is None:
        after = ShardIndex.from_bytes(expected[f"{target}.idx"]).offsets[-1]
    real_open = open

    def failing_open(path: str, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if os.path.basename(path).startswith(f".{target}.tmp-"):  # the temporary file of the target
            if after < 0:
                raise OSError(code, os.strerror(code), path)
            return _Failing(real_open(path, mode, *args, **kwargs), code, after)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(storage, "open", failing_open, raising=False)
    out = tmp_path / "out"
    argv = ["convert", str(source), "-o", str(out), *COMMON, "--on-bad-record", "skip"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{target}: {os.strerror(code)}" in err, err
    assert _temporaries(out) == []
    assert all(Path(f"{shard}.idx").exists() for shard in out.glob("ds-*.tar"))  # no shard without its index
    if target != "manifest.json":
        assert not (out / "manifest.json").exists()
    monkeypatch.undo()
    assert cli.main(argv) == 0
    assert _files(out) == expected
