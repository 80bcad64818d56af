"""The rank group's life: names, ports, shutdown by call, by `with` and by garbage collection."""

import gc
import socket
import time

import paddle
import pytest
import ray
from ray.util.placement_group import placement_group_table

import raydist
from raydist import testing
from helpers import wait_gone
from models import Reference, assert_close, batches, build, sgd

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]


def _pg_state(dm):
    return placement_group_table(testing.placement_group(dm))["state"] if testing.placement_group(dm) is not None else "REMOVED"


def test_named_actors_and_shutdown_by_with():
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                           name="rdtest") as dm:  # fmt: skip
        pg = testing.placement_group(dm)
        assert placement_group_table(pg)["state"] == "CREATED"
        assert len(placement_group_table(pg)["bundles"]) == 2
        for rank in range(2):
            status = ray.get(ray.get_actor(f"rdtest-rank-{rank}").status.remote())
            assert status["rank"] == rank and status["device"] == "cpu"
        pids = [r.pid for r in dm.ranks]
    wait_gone(pids)
    assert placement_group_table(pg)["state"] == "REMOVED"
    with pytest.raises(ValueError):
        ray.get_actor("rdtest-rank-0")


def test_status_lists_the_live_ranks():
    data = batches(1)
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                           name="rdstatus") as dm:  # fmt: skip
        float(dm(*data[0]))
        mine = [s for s in raydist.status() if s.group == "rdstatus"]
        assert [(s.rank, s.pid, s.device, s.mode) for s in mine] == [(0, dm.ranks[0].pid, "cpu", "train"),
                                                                     (1, dm.ranks[1].pid, "cpu", "train")]
        assert all(s.node_ip == ray.util.get_node_ip_address() for s in mine)
    assert not [s for s in raydist.status() if s.group == "rdstatus"]


def test_garbage_collection_shuts_the_group_down():
    dm = raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2)
    pids, pg = [r.pid for r in dm.ranks], testing.placement_group(dm)
    del dm
    gc.collect()  # the group goes down on a thread of its own (never inside a Ray call the collector interrupted)
    wait_gone(pids)
    deadline = time.monotonic() + 10
    while placement_group_table(pg)["state"] != "REMOVED" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert placement_group_table(pg)["state"] == "REMOVED"


def _master_port(dm) -> int:
    """The port of Paddle's TCP store that the ranks were given (the same on every rank)."""
    masters = {env["PADDLE_MASTER"] for env in testing.group(dm).envs}
    assert len(masters) == 1, masters
    return int(masters.pop().rsplit(":", 1)[1])


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` listens on TCP ``port`` (rank 0 serves Paddle's store there)."""
    import psutil

    return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.Process(pid).net_connections("tcp"))  # fmt: skip


@pytest.mark.slow
def test_a_free_master_port_is_used_and_a_taken_one_is_replaced():
    x, y = batches(1)[0]
    with socket.socket() as probe:
        probe.bind(("", 0))
        free = probe.getsockname()[1]
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                           master_port=free) as dm:  # fmt: skip
        assert _master_port(dm) == free and _listens(dm.ranks[0].pid, free)
        assert_close(dm(x, y), Reference(sgd()).train(x, y))
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                               master_port=port) as dm:  # fmt: skip
            used = _master_port(dm)
            assert used != port and _listens(dm.ranks[0].pid, used)
            assert not _listens(dm.ranks[0].pid, port)
            assert_close(dm(x, y), Reference(sgd()).train(x, y))


@pytest.mark.slow
def test_programs_of_any_rank_and_mode():
    x, y = batches(1)[0]
    with raydist.to_static(build("dpmp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=4) as dm:
        with pytest.raises(ValueError, match="first train step"):
            dm.dist_main_program()
        dm(x, y)
        train0 = dm.dist_main_program("train")
        assert "pd_op.matmul" in train0 and "all_reduce" in dm.dist_main_program(rank=0)
        assert dm.dist_main_program("train", rank=3) != train0  # other rings
        assert "pd_op" in dm.dist_startup_program()
        assert "pd_op.matmul" in dm.serial_main_program()
        assert "pd_op" in dm.serial_startup_program()
        eval0 = dm.dist_main_program("eval")  # built on demand, mode unchanged
        assert "pd_op.matmul" in eval0 and dm.mode == "train"
        assert "sgd" not in eval0 and "sgd" in train0
        with pytest.raises(ValueError, match="rank"):
            dm.dist_main_program(rank=4)
        with pytest.raises(ValueError, match="mode"):
            dm.dist_main_program("fit")


DRIVER = """
import sys, ray, paddle, raydist
sys.path.insert(0, {tests!r})
from helpers import DPMP_MESH as MESH
from helpers import dataset
from models import batches, build, sgd
ray.init(address={address!r})
loader = raydist.shard_dataloader(dataset(), MESH, input_keys=["x", "y"], shard_dims="dp", batch_size=8)
with raydist.to_static(build("dpmp"), loader, paddle.nn.MSELoss(), sgd(), num_workers=4) as dm:
    for batch in loader():
        dm(batch["x"], batch["y"])
    x, y = batches(1)[0]
    float(dm(x, y))
    dm.eval(); float(dm(x, y))
    dm.predict(); dm(x); dm.state_dict(); dm.save({checkpoint!r}); dm.load({checkpoint!r})
    dm.dist_main_program()
print(sorted(m for m in sys.modules if m.startswith("raydist")))
"""


@pytest.mark.slow
@pytest.mark.long
def test_the_driver_never_imports_worker_code(tmp_path):
    """Every mode, a loader, state and checkpoints: the driver process imports no rank-only module."""
    import os
    import subprocess
    import sys

    address = ray.get_runtime_context().gcs_address
    code = DRIVER.format(tests=os.path.dirname(__file__), address=address, checkpoint=str(tmp_path / "ckpt"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = eval(out.stdout.strip().splitlines()[-1])
    assert "raydist.driver.api.model" in loaded and "raydist.protocol" in loaded
    assert not [m for m in loaded if m.startswith(("raydist.worker", "raydist.compat", "raydist.integrations"))]
