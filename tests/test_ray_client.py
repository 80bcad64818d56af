"""Ray Client: a driver on a laptop or in a notebook reaching a remote cluster through
``ray://head:port``, here a `ray start --head` with a client server port (`clusters.RayHead`)
and each driver a process of its own. Such a driver has no connection of its own to Ray's
GCS; what raydist reads there (draining nodes, free resources per node, ended jobs) it reads
on the cluster. Every result is held to one plain process."""

import json
import subprocess
import sys

import pytest

from clusters import TESTS, driver_env, start_driver
from helpers import detached_story, said, tell

pytestmark = [pytest.mark.timeout(600), pytest.mark.cluster]  # a Ray head of its own


@pytest.mark.long
def test_a_detached_model_through_ray_client_is_attached_after_its_driver_is_killed_and_taken_over(ray_head, tmp_path):
    """`helpers.detached_story` with every driver through ``ray://`` (``RAY_ADDRESS``): a killed
    client's job outlives it by Ray's reconnect grace, yet the next driver attaches without
    take_over once the silent holder counts as gone."""
    story = detached_story(driver_env(RAY_ADDRESS=ray_head.client), tmp_path)
    assert story["stands"]["step"] == 5  # attached without take_over, the killed client's hold lapsed
    assert "through Ray Client" in story["took"]["holder"] and "through Ray Client" in story["took"]["from"]


# A driver through Ray Client that trains an elastic model (dp x mp2, 2 to 4 ranks of {"rank": 1}) with
# fit and tells the test where it stands; the test adds, drains and removes nodes when told, and says so
# on the driver's stdin. Every wait is for an event.
ELASTIC = """
    import json, logging, sys, time
    import paddle, paddle.distributed as dist, ray
    import raydist
    from raydist import testing
    from models import Rows, adamw, assert_fit_like_one_process, build

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")  # what raydist saw and did

    def say(*words):
        print(*words, flush=True)

    def heard(word):
        line = sys.stdin.readline().split()
        assert line and line[0] == word, line
        return line[1:]

    raydist.driver.cluster.connect.init(ADDRESS, log_to_driver=False)
    rows = Rows(64)  # 8 steps an epoch
    loader = raydist.shard_dataloader(rows, dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]),
                                      shard_dims="dp", batch_size=8, shuffle=True, seed=3)
    dm = raydist.to_static(build("elastic"), loader, paddle.nn.MSELoss(), adamw(), num_workers=(2, 4),
                           resources_per_rank={"CPU": 1, "rank": 1})
    say("started", dm.num_workers)
    sizes, times = [], {}

    class Story(paddle.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            sizes.append(dm.num_workers)
            if len(sizes) == 2:
                say("grow?")
                heard("added")
                while testing.lifecycle(dm).can_grow(look=True) is None:  # raydist's own look sees the new room
                    time.sleep(0.2)
            if sizes[-1] == 4 and "drained" not in times:
                say("nodes", json.dumps(sorted({s.node_id for s in raydist.status()})))
                node, = heard("drained")
                times["drained"] = time.monotonic()
                while node not in testing.lifecycle(dm)._drains.draining:  # raydist's watch saw the notice
                    time.sleep(0.1)
            if len(sizes) > 1 and sizes[-2] == 4 and sizes[-1] == 2:
                say("moved", f"{time.monotonic() - times['drained']:.1f}",
                    json.dumps(sorted({s.node_id for s in raydist.status()})))
                heard("removed")

    losses = dm.fit(loader, epochs=2, progress=False, callbacks=[Story()])  # max_failures=0: no failure is allowed
    say("sizes", json.dumps(sizes))
    say("events", json.dumps([{k: e[k] for k in ("kind", "why", "action", "deadline") if k in e} for e in dm.events()]))
    assert dm.step == 16  # no step ran twice
    assert_fit_like_one_process(losses, dm.state_dict("param"), rows, 8, 2, 2, adamw(), shuffle=True, seed=3)
    dm.shutdown()
    say("like one process")
"""


@pytest.mark.long
def test_an_elastic_fit_through_ray_client_grows_into_a_joining_node_and_moves_off_a_draining_one(ray_head):
    """One worker node: the model starts at 2 ranks. A node joins after step 2: raydist, through the
    client, sees the room and grows to 4. A preemption notice (``ray drain-node``, deadline 120 s)
    for the first node: the model moves to 2 ranks on the other with its live state, before the
    deadline and with no failure (``max_failures=0``); the node goes. Every loss and parameter
    equals one plain process, and no watch said it could not read the cluster."""
    first = ray_head.add_node("first")
    driver = start_driver(ELASTIC.replace("ADDRESS", repr(ray_head.client)))
    try:
        assert said(driver, "started") == "2"
        said(driver, "grow?")
        second = ray_head.add_node("second")
        tell(driver, "added")
        on = json.loads(said(driver, "nodes"))
        assert on == sorted([first, second]), on
        ray_head.drain(first, deadline_s=120)
        tell(driver, f"drained {first}")
        seconds, on = said(driver, "moved").split(" ", 1)
        assert float(seconds) < 120 and json.loads(on) == [second], (seconds, on)
        ray_head.remove_node("first")  # what the cloud does at the deadline
        tell(driver, "removed")
        sizes = json.loads(said(driver, "sizes"))
        events = json.loads(said(driver, "events"))
        said(driver, "like one process")
        assert driver.wait(timeout=120) == 0
    finally:
        if driver.poll() is None:
            driver.kill()
        ray_head.remove_nodes()
    printed = "".join(driver.printed)
    print(printed)
    grew, moved = sizes.index(4), len(sizes) - sizes[::-1].index(4)
    assert sizes == [2] * grew + [4] * (moved - grew) + [2] * (16 - moved) and grew >= 2, sizes
    assert "preemption notice" in printed and "cannot read the cluster's state" not in printed
    drain = next(e for e in events if e["kind"] == "drain")
    assert drain["action"] == "move" and drain["deadline"] is not None, events
    assert [(e["kind"], e.get("why")) for e in events if e["kind"] != "drain"] == [("resize", "grow"), ("resize", "drain")]


@pytest.mark.long
def test_a_killed_client_drivers_run_resumes_through_ray_client_and_ends_as_one_process(ray_head, tmp_path):
    """tests/resumable.py through ``ray://``: fit checkpointing every 2 steps, the driver SIGKILLed after
    step 5; run again with ``resume=True`` it goes on after step 4 and its 12 losses and parameters
    equal one plain process."""
    import numpy as np

    from helpers import one_process_losses, wait_gone
    from models import assert_close, assert_params_equal

    env = driver_env(RAY_ADDRESS=ray_head.client, CKPT_DIR=str(tmp_path / "ck"), OUT=str(tmp_path / "run.npz"))

    def run(hang_after: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(TESTS / "resumable.py")], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**env, "HANG_AFTER": str(hang_after)})

    first = run(hang_after=5)
    pids = json.loads(said(first, "ranks"))
    first.kill()
    first.wait()
    wait_gone(pids, timeout=60)  # a client driver's ranks go with its job, after Ray's reconnect grace
    again = run(hang_after=0)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0 and "done after 12 steps" in out, out[-3000:]
    assert "resuming the run" in out and "after 4 steps" in out, out[-3000:]
    expected, params = one_process_losses(epochs=2)
    got = np.load(tmp_path / "run.npz")
    assert_close(got["history"], expected, what="losses")
    assert_params_equal(got, params)
