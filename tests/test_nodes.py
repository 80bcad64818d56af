"""Ranks on nodes of their own (real raylets from ray.cluster_utils.Cluster), in a driver process of its own.

Each test runs a driver script in a subprocess with a private Ray temp dir, so
its cluster never meets the session's Ray, and stops every node it started.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from clusters import TESTS, run_driver

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster]  # raylets of their own

TWO_NODES = """
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=2, resources={"rank": 2})  # ranks live here only: not on the driver's node
    ray.init(address=cluster.address, log_to_driver=False)
"""


@pytest.mark.long
def test_user_modules_the_builder_reaches_travel_by_value_to_another_node():
    """``lambda: mymodels.MLP(mesh)`` in __main__, MLP in a module no node can import."""
    out = run_driver(TWO_NODES + """
    import importlib, shutil, sys, tempfile, uuid
    import numpy as np, paddle, paddle.distributed as dist
    import raydist
    from models import Reference, assert_close, batches, sgd

    where = tempfile.mkdtemp()
    name = f"mymodels_{uuid.uuid4().hex[:8]}"
    with open(f"{where}/{name}.py", "w") as f:
        f.write("from models import MLP as Base\\n"
                "class MLP(Base):\\n"
                "    pass\\n")
    sys.path.insert(0, where)
    mymodels = importlib.import_module(name)
    shutil.rmtree(where)  # gone: no node can import it now

    try:
        data, ref = batches(3), Reference(sgd())
        with raydist.to_static(lambda: mymodels.MLP(dist.ProcessMesh([0, 1], dim_names=["dp"])),
                               loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                               resources_per_rank={"CPU": 1, "rank": 1}) as dm:
            nodes = {s.node_ip for s in raydist.status()}
            for x, y in data:
                assert_close(dm(x, y), ref.train(x, y))
        print("trained on another node", len(nodes))
    finally:
        ray.shutdown()
        cluster.shutdown()
    """)
    assert "trained on another node" in out


@pytest.mark.long
def test_a_stale_ray_address_file_starts_a_fresh_local_ray():
    """Ray's address file names a cluster that is gone: raydist starts its own, and says why."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="rds", dir="/tmp")
    os.makedirs(f"{temp}/ray")
    Path(f"{temp}/ray/ray_current_cluster").write_text(f"127.0.0.1:{dead}")
    env = {**os.environ, "RAY_TMPDIR": temp, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(TESTS),
           "QUICKSTART_STEPS": "3"}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, str(TESTS.parent / "examples" / "quickstart.py")], env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"names the cluster 127.0.0.1:{dead}, which does not answer" in done.stderr
    assert "predict: output (32, 4)" in done.stdout
