"""Clusters of several nodes on this one machine, for the tests: each driver in a process of its own.

- `run_driver`: a driver script in a fresh process with a private Ray temp dir,
  so the clusters it starts (``ray.cluster_utils.Cluster``) never meet the test
  session's Ray; it must stop what it starts.
- `AutoscalingHead`: a ``ray start --head`` with Ray's autoscaler on its fake
  multi-node provider, which starts real raylets when a placement group cannot
  be placed. Not ``ray.cluster_utils.AutoscalingCluster``: its ``start()`` runs
  ``ray stop --force`` (every Ray on the machine), and the 2.60 wheel lacks the
  example.yaml it reads. Stopped by the PIDs it started, never by name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

from raydist.net import free_port

TESTS = Path(__file__).resolve().parent
RAY = [sys.executable, "-m", "ray.scripts.scripts"]  # Ray's CLI, whether or not its venv is on PATH


# A shell's background job starts with SIGINT ignored, and so would its drivers: they could not be
# interrupted (`run_driver`'s timeout) and their `finally` would not stop their clusters.
INTERRUPTIBLE = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def run_driver(code: str, timeout: float = 240, env: dict | None = None, cwd: str | None = None) -> str:
    """Run ``code`` as ``__main__`` of a fresh driver process; its stdout (it must succeed)."""
    temp = tempfile.mkdtemp(prefix="rdn", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_TMPDIR": temp, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(TESTS), **(env or {})}
    if not env.get("RAY_ADDRESS"):
        env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen([sys.executable, "-c", INTERRUPTIBLE + textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=cwd)  # fmt: skip
    try:
        out, err = driver.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        driver.send_signal(signal.SIGINT)  # its `finally` stops the clusters it started
        try:
            out, err = driver.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            driver.kill()
            out, err = driver.communicate()
        raise AssertionError(f"the driver did not end in {timeout:.0f} s; it printed:\n" + (out + err)[-6000:])
    assert driver.returncode == 0, (out + err)[-6000:]
    return out


def driver_env(**more: str) -> dict:
    """The environment of a driver process of the tests': this one's, no RAY_ADDRESS unless given in
    ``more``, no token authentication, the tests' modules importable."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(TESTS), **more}


def start_driver(code: str, **env: str) -> subprocess.Popen:
    """``code`` (dedented) as a driver process of its own, talked to by lines (`helpers.said`,
    `helpers.tell`), its output on stdout; ``env``: more of its environment (`driver_env`)."""
    return subprocess.Popen([sys.executable, "-c", INTERRUPTIBLE + textwrap.dedent(code)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=driver_env(**env))  # fmt: skip


# Real raylets: a 1-CPU head the driver runs on, and worker nodes with a "rank" resource
# only they have, so ranks live on them and a removed node takes its ranks away.
CLUSTER = """
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [cluster.add_node(num_cpus=2, resources={"rank": 2}) for _ in range(NODES)]
    ray.init(address=cluster.address, log_to_driver=False)
"""


def cluster(nodes: int) -> str:
    """Driver code that starts a `Cluster` of ``nodes`` worker nodes (``cluster``, ``nodes``)."""
    return CLUSTER.replace("NODES", str(nodes))


class AutoscalingHead:
    """A head with Ray's autoscaler on the fake multi-node provider; worker nodes of
    ``{"CPU": 2, "rank": 2}`` come (up to ``max_nodes``) when something cannot be placed."""

    def __init__(self, max_nodes: int = 2):
        self.temp = tempfile.mkdtemp(prefix="rda", dir="/tmp")
        self.port = free_port("127.0.0.1")
        self.address = f"{self._ip()}:{self.port}"
        config = {
            "cluster_name": "raydist-fake",
            "max_workers": max_nodes,
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": 1.0,
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True, "gcs_address": self.address},  # fmt: skip
            "auth": {"ssh_user": "ubuntu"},
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
                "ray.worker.rank": {"resources": {"CPU": 2, "rank": 2}, "node_config": {}, "min_workers": 0,
                                    "max_workers": max_nodes},  # fmt: skip
            },
            "head_node_type": "ray.head.default",
            "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
            "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
        }  # fmt: skip
        self.config = Path(self.temp) / "autoscaling.json"
        self.config.write_text(json.dumps(config))
        self.env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
                    "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": self.temp}  # fmt: skip
        self.env.pop("RAY_ADDRESS", None)

    @staticmethod
    def _ip() -> str:
        from ray.util import get_node_ip_address

        return get_node_ip_address()

    def __enter__(self) -> "AutoscalingHead":
        subprocess.run([*RAY, "start", "--head", f"--autoscaling-config={self.config}", "--num-cpus=2",
                        f"--port={self.port}", f"--temp-dir={self.temp}", "--include-dashboard=false",
                        "--disable-usage-stats"], env=self.env, check=True, capture_output=True,
                       timeout=120)  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every process this head started: those naming its temp dir, and their children."""
        mine = set()
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(self.temp in part for part in p.info["cmdline"] or []):
                    mine.add(p)
                    mine.update(p.children(recursive=True))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        for p in mine:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(list(mine), timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)

    def nodes(self) -> int:
        """Alive worker nodes (from a `ray status` of this head)."""
        out = subprocess.run([*RAY, "status", f"--address={self.address}"], env=self.env, capture_output=True,
                             text=True, timeout=60).stdout  # fmt: skip
        return out.count("ray.worker.rank")


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.5)


class RayHead:
    """A ``ray start --head --block`` on this machine, as an operator starts one: its GCS at
    `address`, a Ray Client server at `client` (``ray://``), a Prometheus endpoint (`metrics`), no
    dashboard, ``num_cpus`` CPUs and no "rank" resource. `add_node` joins worker nodes (``ray start --address``) that have one, so a
    model asking ``{"rank": 1}`` per rank runs there only, and `remove_node` takes one away. Every
    process is stopped by the PID it was started with (``ray start --block`` stops its raylet and
    workers when it gets SIGTERM), never by name."""

    def __init__(self, num_cpus: int = 4):
        self.temp = tempfile.mkdtemp(prefix="rdc", dir="/tmp")  # Ray's socket paths must stay short
        self.port, self.client_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        self.metrics_port = free_port("127.0.0.1")  # the head's Prometheus endpoint: `metrics`
        self.num_cpus = num_cpus
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                    "PYTHONPATH": str(TESTS)}  # fmt: skip
        self.env.pop("RAY_ADDRESS", None)
        self._head: subprocess.Popen | None = None
        self._nodes: dict[str, subprocess.Popen] = {}

    @property
    def address(self) -> str:
        return f"{self._ip()}:{self.port}"

    @property
    def client(self) -> str:
        return f"ray://127.0.0.1:{self.client_port}"

    _ip = staticmethod(AutoscalingHead._ip)

    def _start(self, args: list[str], log: str) -> subprocess.Popen:
        out = open(Path(self.temp) / log, "w")
        return subprocess.Popen([*RAY, "start", "--block", *args], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip

    def __enter__(self) -> "RayHead":
        self._head = self._start(["--head", f"--port={self.port}", f"--ray-client-server-port={self.client_port}",
                                  f"--num-cpus={self.num_cpus}", f"--temp-dir={self.temp}",
                                  f"--metrics-export-port={self.metrics_port}",
                                  "--include-dashboard=false", "--disable-usage-stats"], "head.log")  # fmt: skip
        try:
            wait_until(lambda: self._answers(self.client_port), 120, "the head's Ray Client server did not come up")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _answers(self, port: int) -> bool:
        assert self._head.poll() is None, (Path(self.temp) / "head.log").read_text()[-3000:]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    def add_node(self, name: str, resources: dict | None = None, num_cpus: int = 2) -> str:
        """A worker node named ``name`` with ``resources`` (default {"rank": 2}); its Ray node id,
        once the cluster lists it."""
        resources = {"rank": 2} if resources is None else resources
        self._nodes[name] = self._start([f"--address={self.address}", f"--num-cpus={num_cpus}",
                                         f"--resources={json.dumps(resources)}", f"--node-name={name}",
                                         "--disable-usage-stats"], f"node-{name}.log")  # fmt: skip
        found: dict = {}

        def listed() -> bool:
            assert self._nodes[name].poll() is None, (Path(self.temp) / f"node-{name}.log").read_text()[-3000:]
            found.update(self.nodes())
            return name in found

        wait_until(listed, 120, f"node {name} did not join")
        return found[name]

    def nodes(self) -> dict[str, str]:
        """The alive nodes' ids by name (the head's name is its IP)."""
        return self.ask("{n['NodeName']: n['NodeID'] for n in ray.nodes() if n['Alive']}")

    def ask(self, expression: str):
        """``expression``, evaluated by a driver of this cluster in a process of its own (JSON)."""
        code = ("import json, ray; from ray.util.placement_group import placement_group_table; "
                f"ray.init(address={self.address!r}, logging_level='ERROR', log_to_driver=False); "
                f"print(json.dumps({expression}))")  # fmt: skip
        done = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def remove_node(self, name: str) -> None:
        """Take node ``name`` away (its raylet and every process on it), as a cloud ends a machine."""
        stop_ray_start(self._nodes.pop(name))

    def metrics(self) -> str:
        """What the head's metrics agent serves to Prometheus now (its text format)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as answer:
            return answer.read().decode()

    def remove_nodes(self) -> None:
        """Take every worker node away."""
        for name in list(self._nodes):
            self.remove_node(name)

    def drain(self, node_id: str, deadline_s: int, reason: str = "spot preemption (test)") -> None:
        """Ray's preemption notice for ``node_id`` with a deadline, as a cloud's autoscaler sends it."""
        subprocess.run([*RAY, "drain-node", "--address", self.address, "--node-id", node_id, "--reason",
                        "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", reason, "--deadline-remaining-seconds",
                        str(deadline_s)], env=self.env, check=True, capture_output=True, timeout=60)  # fmt: skip

    def stop(self) -> None:
        self.remove_nodes()
        if self._head is not None:
            stop_ray_start(self._head)


def stop_ray_start(process: subprocess.Popen) -> None:
    """Stop a ``ray start --block`` by its PID (it stops what it started), then anything left in its
    session (it was started in a session of its own)."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
