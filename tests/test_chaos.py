"""The fault soak's short seeds (tests/chaos.py): a plain loop meets three faults in turn (in the README's
test command), and one ``fit`` of dp2 x mp2 meets every kind of fault (``-m long``); each ends as one plain
process. The long soak: ``python -m bench chaos --minutes 30``."""

import os
import subprocess
import sys
import tempfile

import pytest

from clusters import TESTS

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _soak(*args: str, timeout: float) -> str:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": tempfile.mkdtemp(prefix="rdk", dir="/tmp")}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "bench", "chaos", "--minutes", "0", *args], cwd=TESTS.parent,
                          env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-8000:]
    return done.stdout


@pytest.mark.timeout(600)
def test_a_plain_loop_meets_three_faults_in_turn_and_ends_as_one_process():
    out = _soak("--seed", "2", "--cases", "dp2xmp2", "--loops", "plain", "--faults", "3", timeout=550)
    print(out)
    assert "3 faults over" in out and "equal to one process, every fault survived" in out, out
    rows = [line.split("|")[2:4] for line in out.splitlines() if line.startswith("| ") and
            line.split("|")[2].strip().isdigit()]  # fmt: skip
    assert sum(int(injected) for injected, _ in rows) == 3 and all(i == s for i, s in rows), out


@pytest.mark.timeout(900)
@pytest.mark.long
def test_a_fit_meets_every_kind_of_fault_in_turn_and_ends_as_one_process():
    out = _soak("--seed", "1", "--cases", "dp2xmp2", "--loops", "fit", "--faults", "8", timeout=850)
    print(out)
    for kind in ("kill", "kill2", "node", "node_in_restart", "hang", "flip", "preempt", "driver"):
        assert f"| {kind} |" in out, (kind, out)
    assert "every fault survived" in out
