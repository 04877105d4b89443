"""The SLURM flow end to end, on a real SLURM: scripts/slurm-e2e.sh (see its header).

It runs where SLURM answers ``sinfo``, or where it can install and start one (root, apt-get: CI);
elsewhere it is skipped, with the reason in pytest's summary. ``WDSRAFT_SLURM_E2E=0`` skips it,
``WDSRAFT_SLURM_E2E=1`` makes a missing SLURM a failure. About 2 to 3 minutes on 2 cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "slurm-e2e.sh"


@pytest.mark.slow
@pytest.mark.timeout(960)
def test_slurm_flow_end_to_end() -> None:
    if os.environ.get("WDSRAFT_SLURM_E2E") == "0":
        pytest.skip("WDSRAFT_SLURM_E2E=0")
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON") or sys.executable}
    env.pop("AWS_ENDPOINT_URL", None)  # (the S3 fixtures' endpoint: nothing here reads S3)
    process = subprocess.Popen(
        ["bash", str(SCRIPT)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = process.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # (its trap cancels the jobs and stops the daemons it started)
        output, _ = process.communicate(timeout=60)
        pytest.fail(f"scripts/slurm-e2e.sh ran over 15 minutes:\n{output[-6000:]}")
    print(output)
    skipped = [line for line in output.splitlines() if line.startswith("SKIPPED:")]
    if process.returncode == 0 and skipped:
        pytest.skip(skipped[0])
    assert process.returncode == 0, output[-8000:]
    assert "PASSED: the SLURM flow" in output, output[-8000:]
