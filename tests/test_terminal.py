"""The terminal, as an operator and a shell use it against a `ray start` head (`clusters.RayHead`):
``raydist status``, ``raydist stop`` and ``raydist launch --address``, each a subprocess, on the
head's GCS address, through ``RAY_ADDRESS`` and through Ray Client (``ray://``)."""

import json
import re
import subprocess
import sys

import pytest

from clusters import TESTS, driver_env as _env, start_driver
from helpers import said, said_all, seen_env, tell, wait_gone
from models import Reference, assert_close, batches, sgd
from raydist.net import free_port

pytestmark = [pytest.mark.timeout(600), pytest.mark.cluster]  # a Ray head of its own
RAYDIST = [sys.executable, "-m", "raydist"]


def raydist_command(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*RAYDIST, *args], env=env or _env(), capture_output=True, text=True, timeout=timeout)


# A driver that holds a detached model NAME (2 ranks, dp): 3 steps and a checkpoint, then it waits for a
# line and tries one more step.
HOLDER = """
    import json, os, sys, tempfile
    import paddle, raydist
    from models import batches, build, sgd

    dm = raydist.to_static(build("dp"), None, paddle.nn.MSELoss(), sgd(), num_workers=2, name=NAME, detached=True)
    for x, y in batches(3):
        dm(x, y)
    path = os.path.join(tempfile.mkdtemp(), "ck")
    dm.save(path)
    print("ready", json.dumps({"pids": sorted(s.pid for s in raydist.status() if s.group == NAME),
                               "checkpoint": path}), flush=True)
    if HOLD:
        sys.stdin.readline()
        try:
            dm(*batches(4)[3])
            print("stepped", flush=True)
        except raydist.GroupShutdownError as e:
            print("refused", e, flush=True)
"""


def _holder(head, name: str, hold: bool = True) -> subprocess.Popen:
    return start_driver(HOLDER.replace("NAME", repr(name)).replace("HOLD", str(hold)), RAY_ADDRESS=head.address)


@pytest.mark.long
def test_status_lists_a_held_detached_model_and_stop_ends_it_only_with_force(ray_head):
    """A detached model a live driver holds: ``raydist status`` (through Ray Client) names its holder, size,
    mode, step, node, last checkpoint and each rank; ``--json`` (through RAY_ADDRESS) says the same.
    ``raydist stop`` refuses it, naming the holder; ``--force`` ends it: its ranks, placement group and
    record are gone, and the holder's next call is refused."""
    holder = _holder(ray_head, "terminal-held")
    ready = json.loads(said(holder, "ready"))
    pids, checkpoint = ready["pids"], ready["checkpoint"]
    head_node = ray_head.nodes()[ray_head._ip()]

    table = raydist_command("status", "--address", ray_head.client)
    assert table.returncode == 0, table.stderr
    text = table.stdout
    print(text)
    assert f"terminal-held  detached model, held by the driver with pid {holder.pid} " in text
    assert f"2 ranks, on 1 node, mode train, step 3, last checkpoint {checkpoint}" in text
    assert all(f"  {rank}     {pid}  " in text for rank, pid in enumerate(pids)), text
    assert "  last events:" in text and f"checkpoint step 3, path {checkpoint}, background False" in text, text

    listed = raydist_command("status", "--json", env=_env(RAY_ADDRESS=ray_head.address))
    assert listed.returncode == 0, listed.stderr
    model = next(m for m in json.loads(listed.stdout) if m["name"] == "terminal-held")
    assert f"the driver with pid {holder.pid} " in model["holder"]
    assert {k: model[k] for k in ("kind", "detached", "size", "bounds", "mode", "step", "nodes", "last_checkpoint",
                                  "missing")} == {
        "kind": "model", "detached": True, "size": 2, "bounds": [2, 2], "mode": "train", "step": 3,
        "nodes": [head_node], "last_checkpoint": checkpoint, "missing": []}  # fmt: skip
    assert [(r["rank"], r["pid"], r["step"], r["node_id"]) for r in model["ranks"]] == \
        [(0, pids[0], 3, head_node), (1, pids[1], 3, head_node)]  # fmt: skip
    assert all(r["peak_rss_mib"] > 50 and r["last_answer"] is not None for r in model["ranks"])
    assert [(e["kind"], e["path"]) for e in model["events"]] == [("checkpoint", checkpoint)]

    refused = raydist_command("stop", "terminal-held", "--address", ray_head.client)
    assert refused.returncode == 1 and f"held by the driver with pid {holder.pid} " in refused.stderr, refused.stderr
    assert "--force" in refused.stderr
    stopped = raydist_command("stop", "terminal-held", "--force", "--address", ray_head.address)
    assert stopped.returncode == 0, stopped.stderr
    wait_gone(pids)
    left = ray_head.ask("[sorted(v['state'] for v in placement_group_table().values()), "
                        "sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True))]")  # fmt: skip
    assert set(left[0]) <= {"REMOVED"} and not [n for n in left[1] if "terminal-held" in n], left
    tell(holder)
    assert "ended by another driver" in said(holder, "refused")
    assert holder.wait(timeout=120) == 0
    assert "terminal-held" not in raydist_command("status", "--address", ray_head.address).stdout


@pytest.mark.long
def test_a_detached_model_no_driver_holds_is_listed_so_and_stopped_without_force(ray_head):
    holder = _holder(ray_head, "terminal-free", hold=False)
    pids = json.loads(said(holder, "ready"))["pids"]
    assert holder.wait(timeout=120) == 0  # it ends without shutdown: it lets go of the model
    text = raydist_command("status", env=_env(RAY_ADDRESS=ray_head.client)).stdout
    assert "terminal-free  detached model, held by no live driver (raydist.attach takes it)" in text, text
    stopped = raydist_command("stop", "terminal-free", env=_env(RAY_ADDRESS=ray_head.client))
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped the detached model 'terminal-free'" in stopped.stdout
    wait_gone(pids)
    unknown = raydist_command("stop", "terminal-free", "--address", ray_head.address)
    assert unknown.returncode == 1 and "no detached model named 'terminal-free'" in unknown.stderr


WAITS = """
import os, sys, time
print("waiting", os.environ["PADDLE_TRAINER_ID"], flush=True)
time.sleep(600)
"""


@pytest.mark.long
def test_status_shows_a_launched_script_and_stop_ends_it(ray_head, tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(WAITS)
    launch = subprocess.Popen([*RAYDIST, "launch", "-n", "2", "--address", ray_head.address, "--name",
                               "terminal-script", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=_env())  # fmt: skip
    try:
        said_all(launch, ["[rank 0] waiting", "[rank 1] waiting"])  # in either order
        listed = raydist_command("status", "--json", "--address", ray_head.client)
        assert listed.returncode == 0, listed.stderr
        script_status = next(m for m in json.loads(listed.stdout) if m["name"] == "terminal-script")
        assert {k: script_status[k] for k in ("kind", "detached", "size", "script", "missing")} == \
            {"kind": "script", "detached": False, "size": 2, "script": "waits.py", "missing": []}  # fmt: skip
        assert f"the driver with pid {launch.pid} " in script_status["holder"]
        assert [r["rank"] for r in script_status["ranks"]] == [0, 1]
        assert all(r["last_answer"] is not None for r in script_status["ranks"])  # they printed
        text = raydist_command("status", "--address", ray_head.address).stdout
        assert f"terminal-script  launched script waits.py, launched by the driver with pid {launch.pid} " in text

        stopped = raydist_command("stop", "terminal-script", "--address", ray_head.address)  # no --force needed
        assert stopped.returncode == 0 and "stopped the 2 ranks" in stopped.stdout, stopped.stderr
        out, _ = launch.communicate(timeout=120)
        assert launch.returncode == 1 and "failed (stopped by raydist stop" in out, out
    finally:
        if launch.poll() is None:
            launch.kill()


def test_the_commands_fail_clearly_and_at_once_when_no_cluster_is_there():
    nowhere = f"127.0.0.1:{free_port('127.0.0.1')}"
    for args, env in ((["status", "--address", nowhere], None), (["stop", "x"], _env(RAY_ADDRESS=nowhere)),
                      (["status", "--address", f"ray://{nowhere}"], None)):  # fmt: skip
        done = raydist_command(*args, env=env, timeout=60)
        assert done.returncode == 1 and "no Ray cluster answers at" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


@pytest.mark.long
def test_raydist_launch_gives_every_rank_the_launching_shells_environment_on_a_cluster(ray_head):
    """``FOO=bar raydist launch --address <head>``: every rank sees FOO and ``--env BAZ=qux``, its own
    PADDLE_TRAINER_ID (over the shell's and ``--env``'s), and none of the launching machine's
    variables (its virtualenv, device visibility, Ray's own, paths, home). Through ``RAY_ADDRESS=ray://``
    with ``--no-env``: only ``--env``'s."""
    script = TESTS / "shows_env.py"
    shell = _env(FOO="bar", PADDLE_TRAINER_ID="42", VIRTUAL_ENV="/launching/venv", CUDA_VISIBLE_DEVICES="7",
                 RAY_RAYDIST_PROBE="Ray's own", PYTHONPATH="/launching/path", HOME="/launching/home")  # fmt: skip
    done = subprocess.run([*RAYDIST, "launch", "-n", "2", "--address", ray_head.address, "--env", "BAZ=qux",
                           "--env", "PADDLE_TRAINER_ID=99", str(script)], env=shell, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for rank, seen in enumerate(seen_env(done.stdout)):
        assert seen["FOO"] == "bar" and seen["BAZ"] == "qux" and seen["PADDLE_TRAINER_ID"] == str(rank), seen
        assert seen["VIRTUAL_ENV"] != "/launching/venv" and seen["CUDA_VISIBLE_DEVICES"] != "7", seen
        assert "/launching" not in seen["PYTHONPATH"] and seen["HOME"] != "/launching/home", seen
        assert seen["RAY_RAYDIST_PROBE"] is None, seen

    no_env = subprocess.run([*RAYDIST, "launch", "-n", "2", "--no-env", "--env", "BAZ=qux", str(script)],
                            env=_env(FOO="bar", RAY_ADDRESS=ray_head.client), capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert no_env.returncode == 0, no_env.stderr[-3000:]
    for rank, seen in enumerate(seen_env(no_env.stdout)):
        assert seen["FOO"] is None and seen["BAZ"] == "qux" and seen["PADDLE_TRAINER_ID"] == str(rank), seen


def test_a_paddle_style_script_configured_by_its_environment_runs_the_configuration_it_was_given(ray_head):
    """tests/paddle_style/mesh_by_env.py reads dp and mp as Paddle's own tests do (default dp 2): launched
    with ``dp=1 mp=2`` exported, it runs tensor parallel, and its losses equal one plain process."""
    done = subprocess.run([*RAYDIST, "launch", "-n", "2", "--address", ray_head.address,
                           str(TESTS / "paddle_style" / "mesh_by_env.py")],
                          env=_env(dp="1", mp="2"), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[rank 0] config dp 1 mp 2 on 2 ranks" in done.stdout, done.stdout
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("[rank 0] loss ")]
    ref = Reference(sgd())
    assert_close(losses, [ref.train(x, y) for x, y in batches(3)])


RESUMES = TESTS / "paddle_style" / "resumes.py"


@pytest.mark.long
def test_a_preemption_notice_restarts_a_launched_script_on_another_node_before_the_deadline(ray_head, tmp_path):
    """``raydist launch --max-restarts 1`` of a script that resumes from its own checkpoints, its two
    ranks on one of two worker nodes: a preemption notice for that node (``ray drain-node``, 120 s
    deadline) ends both ranks and starts the script again on the other node at once, before the node
    goes. The node is then taken away: the restart does not notice, and the run's losses equal an
    uninterrupted run's."""
    nodes = {name: ray_head.add_node(name, {"rank": 2}) for name in ("pre-a", "pre-b")}
    command = [*RAYDIST, "launch", "-n", "2", "--address", ray_head.address, "--max-restarts", "1",
               "--resources-per-rank", '{"CPU": 1, "rank": 1}', str(RESUMES)]  # fmt: skip
    (tmp_path / "calm").mkdir()
    calm = subprocess.run([*command, str(tmp_path / "calm")], capture_output=True, text=True, env=_env(), timeout=300)
    assert calm.returncode == 0, calm.stdout + calm.stderr
    (tmp_path / "held").mkdir()
    launch = subprocess.Popen([*command, str(tmp_path / "held"), "hold"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=_env())  # fmt: skip
    try:
        said_all(launch, ["[rank 0] HOLDING", "[rank 1] HOLDING"])  # both ranks past the step-2 checkpoint
        listed = json.loads(raydist_command("status", "--json", "--address", ray_head.address).stdout)
        (on,) = next(m for m in listed if m["kind"] == "script")["nodes"]  # PACK: both ranks on one node
        victim = next(name for name, node in nodes.items() if node == on)
        ray_head.drain(on, 120)
        restart = said(launch, "raydist launch: restart")
        assert restart.startswith("1 of 1, after a preemption notice: node") and "(it runs ranks 0, 1)" in restart, restart
        ray_head.remove_node(victim)  # only now: the restarted ranks are elsewhere, or the run fails here
        rest, _ = launch.communicate(timeout=300)
        out = "".join(launch.printed) + rest
        assert launch.returncode == 0, out
    finally:
        if launch.poll() is None:
            launch.kill()
    for rank in (0, 1):
        losses = re.findall(rf"^\[rank {rank}\] LOSS (\d+) (\S+)$", out, re.M)
        first = dict(re.findall(rf"^\[rank {rank}\] LOSS (\d+) (\S+)$", calm.stdout, re.M))
        assert len(first) == 8 and dict(losses) == first, out  # steps 0-1 before, 2-7 after the restart
        assert f"[rank {rank}] RESUMED 2 restart 1 of 1" in out, out
    assert re.findall(r"FINAL (\S+)", out) == re.findall(r"FINAL (\S+)", calm.stdout)
