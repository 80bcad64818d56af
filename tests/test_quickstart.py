"""The README's quickstart runs as a user runs it: its own embedded local Ray."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.cluster  # an embedded local Ray of its own, as a user's run starts
@pytest.mark.timeout(300)
@pytest.mark.long
def test_quickstart_runs_and_learns():
    env = {**os.environ, "QUICKSTART_STEPS": "40", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run([sys.executable, "examples/quickstart.py"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=280)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    loss = float(out.split("eval loss on held-out data: ")[1].split()[0])
    variance = float(out.split("variance of the targets: ")[1].split(")")[0])
    assert loss < 0.5 * variance, out  # it learned something
    assert "predict: output (32, 4)" in out
