"""The README's main job runs end to end on the bundled corpus."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_quickstart_example(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quickstart.py"), "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "same as webdataset: True; content intact: True" in result.stdout
    assert "rest of shard identical: True" in result.stdout
    assert "quickstart OK" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir())[-1] == "manifest.json"


@pytest.mark.parametrize("tokenizer", ["tiktoken", "hf"])
def test_llm_example(tmp_path: Path, tokenizer: str) -> None:
    """The README's LLM example: tokenize, pack and batch in workers, then an exact mid-epoch resume."""
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_llm.py"), "--tokenizer", tokenizer, "--length", "256"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "of [4, 256]" in result.stdout and "padding" in result.stdout
    assert "identical to the uninterrupted run: True" in result.stdout and "train_llm OK" in result.stdout
