"""examples/mixture/train_mixture.py in real processes (issue 17, item 5): a three-source mixture on two
ranks, preempted; resumed on one rank with other weights (elastic); preempted again; resumed with other
workers (elastic again) to the epoch's end. The delivered logs, counted up to each run's committed
checkpoints, hold every sample exactly once per pass of its source."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.shardutil import free_port

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "mixture" / "train_mixture.py"


def _run(workdir: Path, sources: list[str], *extra: str, rank: int = 0, world: int = 1, port: int = 0, run: str):
    env = {**os.environ, "PYTHONPATH": str(REPO), "WDSRAFT_RUN": run, "RANK": str(rank), "WORLD_SIZE": str(world)}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    args = [sys.executable, str(SCRIPT), "--demo-shards", str(workdir / "demo"), "--workdir", str(workdir)]
    args += [arg for source in sources for arg in ("--source", source)]
    return subprocess.Popen([*args, "--checkpoint-every", "3", *extra], env=env, stdout=subprocess.PIPE, text=True)


def _finish(*processes) -> str:
    outputs = []
    for process in processes:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0, out
        outputs.append(out)
    return "".join(outputs)


@pytest.mark.timeout(240)
def test_weights_changed_between_preempted_runs_serve_every_sample_once_per_pass(tmp_path) -> None:
    before, after = ["web=5", "code=3", "books=2:2"], ["web=1", "code=2", "books=6:2"]
    port = free_port()
    ranks = [_run(tmp_path, before, "--stop-at-step", "7", rank=r, world=2, port=port, run="one") for r in (0, 1)]
    assert "fresh start at step 0" in _finish(*ranks)
    out = _finish(_run(tmp_path, after, "--stop-at-step", "20", run="two"))
    assert "elastic start at step 6" in out
    out = _finish(_run(tmp_path, after, "--workers", "2", run="three"))
    assert "elastic start at step 18" in out and "the epoch is done" in out
    check = subprocess.run(
        [sys.executable, str(SCRIPT), "--demo-shards", str(tmp_path / "demo"), "--workdir", str(tmp_path), "--check"]
        + [arg for source in after for arg in ("--source", source)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0 and "OK:" in check.stdout, check.stdout + check.stderr
