"""Job submission: the quickstart submitted to a Ray head with token authentication on.

The head is started here (`ray start --head --block` on loopback, its own ports
and temp dir) and stopped by its PID; its children die with it (Ray sets
PR_SET_PDEATHSIG on Linux).
"""

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from clusters import stop_ray_start
from helpers import detached_story, seen_env, wait_gone
from raydist.net import free_port

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
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
        yield url, token, {**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}  # the CLI and clients are given the url
    finally:
        stop_ray_start(process)
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


@pytest.mark.long
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


@pytest.mark.long
def test_raydist_launch_inside_a_job_gives_its_ranks_the_entrypoints_environment(head):
    """``ray job submit -- FOO=bar raydist launch ...``: the job's driver runs on the head, its ranks start
    from the raylets, and every rank sees FOO."""
    url, _, env = head
    done = subprocess.run(
        [*RAY, "job", "submit", "--address", url, "--working-dir", str(TESTS), "--",
         "FOO=bar", sys.executable, "-m", "raydist", "launch", "-n", "2", "shows_env.py"],  # one shell line
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for rank, seen in enumerate(seen_env(done.stdout)):
        assert seen["FOO"] == "bar" and seen["PADDLE_TRAINER_ID"] == str(rank), seen


@pytest.mark.long
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


# -- a run that outlives its driver: tests/resumable.py, killed and run again -------------------


def _resumable(env: dict, directory: Path, out: Path, hang_after: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(TESTS / "resumable.py")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**env, "PYTHONPATH": str(TESTS), "CKPT_DIR": str(directory), "OUT": str(out),
                                 "HANG_AFTER": str(hang_after)})  # fmt: skip


def _finish(process: subprocess.Popen) -> str:
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out[-4000:]
    return out


def _ranks(lines) -> list[int]:
    """The PIDs the script prints once it waits to be killed."""
    for line in lines:
        if line.startswith("ranks "):
            return json.loads(line[len("ranks ") :])
    raise AssertionError("the script ended without printing its ranks")


def _same_run(out: Path, calm: Path) -> None:
    import numpy as np

    got, want = np.load(out), np.load(calm)
    assert sorted(got.files) == sorted(want.files)
    for name in want.files:  # the 12 losses, then every parameter
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.fixture(scope="module")
def calm(head, tmp_path_factory):
    """tests/resumable.py run through undisturbed: its losses and parameters, which equal one plain process."""
    import numpy as np

    from helpers import one_process_losses
    from models import assert_close, assert_params_equal

    tmp = tmp_path_factory.mktemp("calm")
    _finish(_resumable(head[2], tmp / "ck", tmp / "calm.npz"))
    expected, params = one_process_losses(epochs=2)  # the calm run is held to one process too
    got = np.load(tmp / "calm.npz")
    assert_close(got["history"], expected, what="losses")
    assert_params_equal(got, params)
    return tmp / "calm.npz"


@pytest.mark.long
def test_a_killed_driver_takes_its_ranks_and_the_script_run_again_ends_as_an_undisturbed_run(head, calm, tmp_path):
    """SIGKILL the driver after step 5 (checkpoints every 2 steps): its ranks are gone within seconds;
    the script run again resumes after step 4 and ends with the losses and parameters of the calm run."""
    env = head[2]
    process = _resumable(env, tmp_path / "ck", tmp_path / "run.npz", hang_after=5)
    pids = _ranks(process.stdout)
    process.kill()
    killed = time.monotonic()
    process.wait()
    wait_gone(pids, timeout=30)
    print(f"ranks gone {time.monotonic() - killed:.1f} s after the driver's SIGKILL")
    again = _finish(_resumable(env, tmp_path / "ck", tmp_path / "run.npz"))
    assert "done after 12 steps" in again, again[-3000:]
    assert "resuming the run" in again and "after 4 steps" in again, again[-3000:]
    _same_run(tmp_path / "run.npz", calm)


@pytest.mark.long
def test_a_stopped_job_submitted_again_ends_as_an_undisturbed_run(head, calm, tmp_path):
    """ray job submit; ray job stop after step 5; ray job submit again: the calm run's numbers."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    url, token, env = head
    client = JobSubmissionClient(url, headers=_auth(token))
    runtime_env = {"working_dir": str(TESTS), "env_vars": {"CKPT_DIR": str(tmp_path / "ck"),
                                                            "OUT": str(tmp_path / "job.npz")}}  # fmt: skip

    def submit(*flags: str, hang_after: int = 0) -> subprocess.CompletedProcess:
        job_env = {**runtime_env, "env_vars": {**runtime_env["env_vars"], "HANG_AFTER": str(hang_after)}}
        return subprocess.run([*RAY, "job", "submit", "--address", url, "--runtime-env-json", json.dumps(job_env),
                               *flags, "--", sys.executable, "resumable.py"],
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip

    first = f"resumable-{secrets.token_hex(4)}"
    assert submit("--no-wait", "--submission-id", first, hang_after=5).returncode == 0
    deadline = time.monotonic() + 300
    while "ranks [" not in (logs := client.get_job_logs(first)):
        status = client.get_job_status(first)
        assert status in (JobStatus.PENDING, JobStatus.RUNNING) and time.monotonic() < deadline, (status, logs[-3000:])
        time.sleep(1)
    pids = _ranks(logs.splitlines())
    stop = subprocess.run([*RAY, "job", "stop", "--address", url, first], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert stop.returncode == 0 and client.get_job_status(first) == JobStatus.STOPPED, stop.stdout + stop.stderr
    wait_gone(pids, timeout=30)
    again = submit()
    assert again.returncode == 0 and "done after 12 steps" in again.stdout, (again.stdout + again.stderr)[-3000:]
    _same_run(tmp_path / "job.npz", calm)


# -- a detached model: tests/detached.py, killed, attached from new processes ----------------------


@pytest.mark.long
def test_a_detached_model_outlives_its_killed_driver_and_is_attached_held_taken_over_and_ended(head, tmp_path):
    """`helpers.detached_story`, the drivers on the head's GCS address (with token authentication)."""
    story = detached_story(head[2], tmp_path)
    assert story["stands"]["step"] == 5 and "through Ray Client" not in story["took"]["holder"] + story["took"]["from"]
