"""Job submission: the quickstart submitted to a Ray head with token authentication on.

The head is started here (`ray start --head --block` on loopback, its own ports
and temp dir) and stopped by its PID; its children die with it (Ray sets
PR_SET_PDEATHSIG on Linux).
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from raydist.net import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.timeout(900), pytest.mark.cluster]  # a Ray head of their own


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A Ray head with token auth: (dashboard url, token, env for clients)."""
    token = secrets.token_hex(32)
    temp = tmp_path_factory.mktemp("head")
    short = Path("/tmp") / f"rdh{os.getpid()}"  # Ray's unix sockets need a short path
    short.mkdir(exist_ok=True)
    gcs, dashboard, client, agent = (free_port("127.0.0.1") for _ in range(4))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # fmt: skip
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_JOB_HEADERS"):
        env.pop(name, None)
    log = open(temp / "head.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--include-dashboard=true",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}", "--num-cpus=8",
         f"--temp-dir={short}", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, (temp / "head.log").read_text()[-3000:]
            try:
                if requests.get(f"{url}/api/version", headers=_auth(token), timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the head's job server did not come up"
            time.sleep(1)
        yield url, token, env
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        try:  # anything of this head's session that outlived it
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(short, ignore_errors=True)


def _auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _check_quickstart_output(logs: str) -> None:
    assert "eval loss on held-out data" in logs, logs[-3000:]
    assert "predict: output (32, 4)" in logs


def test_token_auth_is_on(head):
    url, token, _ = head
    assert requests.get(f"{url}/api/version", timeout=5).status_code == 401
    assert requests.get(f"{url}/api/version", headers=_auth(token), timeout=5).ok


def test_ray_job_submit_cli(head):
    url, _, env = head  # the CLI reads the token from RAY_AUTH_TOKEN (RAY_AUTH_MODE=token)
    done = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", url,
         "--working-dir", str(ROOT / "examples"),
         "--runtime-env-json", json.dumps({"env_vars": {"QUICKSTART_STEPS": "30"}}),
         "--", sys.executable, "quickstart.py"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "succeeded" in done.stdout.lower()
    _check_quickstart_output(done.stdout)


def test_job_submission_client(head):
    from ray.job_submission import JobStatus, JobSubmissionClient

    url, token, _ = head
    client = JobSubmissionClient(url, headers=_auth(token))
    job = client.submit_job(entrypoint=f"{sys.executable} quickstart.py",
                            runtime_env={"working_dir": str(ROOT / "examples"),
                                         "env_vars": {"QUICKSTART_STEPS": "30"}})  # fmt: skip
    deadline = time.monotonic() + 600
    while (status := client.get_job_status(job)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.monotonic() < deadline
        time.sleep(2)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    _check_quickstart_output(logs)
