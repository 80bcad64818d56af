"""Preemption notices: `ray drain-node` with a deadline on a `ray.cluster_utils.Cluster` node that holds
ranks, and the node removed once the model has acted (or at the deadline). Held to one plain process."""

import pytest

from clusters import cluster, run_driver

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster]  # raylets of their own

# Driver code: the model's data (`rows`, `loader`), and drain(node), which sends Ray's
# preemption notice for a node (as a cloud's spot preemption or the autoscaler's scale-down
# does) and waits until Ray shows it draining.
DRAIN = """
    import subprocess, sys, time
    from ray._private.state import state

    DEADLINE_S = 120

    def drain(node):
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", cluster.address,
                        "--node-id", node.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                        "--reason-message", "spot preemption (test)", "--deadline-remaining-seconds",
                        str(DEADLINE_S)], check=True, capture_output=True)
        deadline = time.monotonic() + 30
        while node.node_id not in state.get_draining_nodes():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        return time.monotonic() + DEADLINE_S

    def wait_for(what, until):
        while not what():
            assert time.monotonic() < until, "the model did not act before the deadline"
            time.sleep(0.05)

    import logging, os, threading, tempfile
    import paddle, paddle.distributed as dist
    import raydist
    from raydist import testing
    from models import Rows, adamw, assert_fit_like_one_process, build

    logging.getLogger("raydist").addHandler(logging.StreamHandler(sys.stdout))  # what it saw and did
    def moved_off(dm):
        # fit(dm) for 2 epochs in a thread, paused after step 3 while the node of a rank gets its
        # notice; once the model is off the node, the node is removed: the sizes after each step, the losses
        victim = next(n for n in nodes if n.node_id in {s.node_id for s in raydist.status()})
        sizes, noticed, go = [], threading.Event(), threading.Event()

        class Notice(paddle.callbacks.Callback):
            def on_train_batch_end(self, step, logs=None):
                sizes.append(dm.num_workers)
                if len(sizes) == 3:
                    noticed.set()
                    go.wait(60)  # the notice is out and Ray shows the node draining

        run = {}
        fit = threading.Thread(target=lambda: run.update(losses=dm.fit(loader, epochs=2, progress=False,
                                                                       callbacks=[Notice()])))  # fmt: skip
        fit.start()
        noticed.wait(120)
        deadline = drain(victim)
        wait_for(lambda: victim.node_id in testing.lifecycle(dm)._drains.draining, deadline)  # raydist's watcher saw it
        go.set()
        wait_for(lambda: victim.node_id not in {s.node_id for s in raydist.status()}, deadline)
        print(f"off the draining node {DEADLINE_S - (deadline - time.monotonic()):.1f} s after the notice")
        cluster.remove_node(victim)  # what the cloud does at the deadline
        fit.join(240)
        return sizes, run["losses"]

    rows = Rows(64)  # 8 steps an epoch, dp x mp2 at 4 ranks
    loader = raydist.shard_dataloader(rows, dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]),
                                      shard_dims="dp", batch_size=8, shuffle=True, seed=3)
"""


@pytest.mark.long
def test_elastic_fit_moves_off_a_draining_node_before_its_deadline_without_a_failure():
    """dp x mp2, num_workers=(2, 4) over two nodes, fit with max_failures=0: a notice for one node
    after step 3; the model moves to 2 ranks on the other with the live state (no step lost, no
    failure), the node is removed, and every loss and parameter equals one plain process."""
    out = run_driver(cluster(2) + DRAIN + """
    try:
        dm = raydist.to_static(build("elastic"), loader, paddle.nn.MSELoss(), adamw(), num_workers=(2, 4),
                               resources_per_rank={"CPU": 1, "rank": 1})
        sizes, losses = moved_off(dm)
        print("sizes", sizes)
        moved = sizes.index(2)  # at the first step boundary after the notice: the steps in flight first
        assert 3 <= moved < 16 and sizes == [4] * moved + [2] * (16 - moved) and len(losses) == 16, sizes
        assert dm.step == 16  # no step ran twice: nothing failed
        assert_fit_like_one_process(losses, dm.state_dict("param"), rows, 8, 2, 2, adamw(), shuffle=True, seed=3)
        dm.shutdown()
        print("moved off like one process")
    finally:
        ray.shutdown()
        cluster.shutdown()
    """)
    print(out)
    assert "moved off like one process" in out and "preemption notice" in out


@pytest.mark.long
def test_a_plain_loop_moves_off_a_draining_node_then_grows_back_when_one_joins():
    """The same in a `for batch in loader(): dm(*batch)` loop: the notice is acted on at the next
    call (the rest of the epoch re-split over the remaining data-parallel group), the node goes, a
    node joins, and the loop grows back to 4 ranks at the call after raydist saw the room; the
    losses and parameters of one plain process."""
    out = run_driver(cluster(2) + DRAIN + """
    try:
        dm = raydist.to_static(build("elastic"), loader, paddle.nn.MSELoss(), adamw(), num_workers=(2, 4),
                               resources_per_rank={"CPU": 1, "rank": 1})
        victim = next(n for n in nodes if n.node_id in {s.node_id for s in raydist.status()})
        losses, sizes = [], []
        for epoch in range(3):
            for batch in loader():
                losses.append(dm(*batch.values()))  # Rows are dicts
                sizes.append(dm.num_workers)
                if len(sizes) == 3:
                    deadline = drain(victim)
                    wait_for(lambda: victim.node_id in testing.lifecycle(dm)._drains.draining, deadline)  # the watcher saw it
                if len(sizes) == 4:  # the call of step 4 moved off
                    assert sizes[-1] == 2, sizes
                    cluster.remove_node(victim)
                if len(sizes) == 6:
                    cluster.add_node(num_cpus=2, resources={"rank": 2})
                    wait_for(lambda: testing.lifecycle(dm).can_grow() is not None, time.monotonic() + 60)  # the room, seen
        print("sizes", sizes)
        assert sizes == [4] * 3 + [2] * 3 + [4] * 18, sizes  # moved at call 4, grew at call 7
        assert_fit_like_one_process([float(x) for x in losses], dm.state_dict("param"), rows, 8, 2, 3, adamw(),
                                    shuffle=True, seed=3)  # fmt: skip
        dm.shutdown()
        print("moved off and grew back like one process")
    finally:
        ray.shutdown()
        cluster.shutdown()
    """)
    print(out)
    assert "moved off and grew back like one process" in out and "moving off it, from 4 to 2 ranks" in out


@pytest.mark.long
def test_a_fixed_size_fit_moves_off_a_draining_node_when_the_others_have_room():
    """dp x mp2 on 4 ranks (fixed) over three nodes with room for 6: a notice for a node of the ranks
    after step 3 moves the 4 ranks off it before its deadline, with the live state: no checkpoint,
    no failure, no step run twice; the losses and parameters of one plain process."""
    out = run_driver(cluster(3) + DRAIN + """
    try:
        dm = raydist.to_static(build("dpmp"), loader, paddle.nn.MSELoss(), adamw(), num_workers=4,
                               resources_per_rank={"CPU": 1, "rank": 1})
        sizes, losses = moved_off(dm)
        kinds = [(e["kind"], e.get("action") or e.get("why")) for e in dm.events()
                 if e["kind"] in ("drain", "resize", "failure", "restart", "checkpoint")]  # fmt: skip
        assert kinds == [("drain", "move"), ("resize", "drain")], kinds
        assert sizes == [4] * 16 and len(losses) == 16 and dm.step == 16, sizes
        assert_fit_like_one_process(losses, dm.state_dict("param"), rows, 8, 2, 2, adamw(), shuffle=True, seed=3)
        dm.shutdown()
        print("a fixed size moved off like one process")
    finally:
        ray.shutdown()
        cluster.shutdown()
    """)
    print(out)
    assert "a fixed size moved off like one process" in out and "moving off it, from 4 to 4 ranks" in out


@pytest.mark.long
def test_a_fixed_size_fit_checkpoints_at_the_notice_and_loses_no_step_when_the_node_goes():
    """dp x mp2 on 4 ranks (fixed) over two nodes, fit with max_failures=0: a notice after step 3
    is a checkpoint at the next step boundary; the node goes, a new one joins, and the ranks restart
    without counting a failure; the losses and parameters of one plain process."""
    out = run_driver(cluster(2) + DRAIN + """
    try:
        dm = raydist.to_static(build("dpmp"), loader, paddle.nn.MSELoss(), adamw(), num_workers=4,
                               resources_per_rank={"CPU": 1, "rank": 1}, max_in_flight=1, steps_per_message=1)
        victim = nodes[1]
        ck = tempfile.mkdtemp() + "/ck"
        sizes, noticed, go, removed = [], threading.Event(), threading.Event(), threading.Event()

        class Notice(paddle.callbacks.Callback):
            def on_train_batch_end(self, step, logs=None):
                sizes.append(dm.num_workers)
                if len(sizes) == 3:
                    noticed.set()
                    go.wait(60)
                if len(sizes) == 5:
                    removed.wait(60)  # the checkpoint came before step 5; the node goes before step 6

        run = {}
        fit = threading.Thread(target=lambda: run.update(losses=dm.fit(
            loader, epochs=2, progress=False, callbacks=[Notice()], checkpoint_dir=ck)))
        fit.start()
        noticed.wait(120)
        deadline = drain(victim)
        wait_for(lambda: victim.node_id in testing.lifecycle(dm)._drains.draining, deadline)  # raydist's watcher saw it
        go.set()
        wait_for(lambda: os.path.exists(ck) and any(n.startswith("step-") and ".saving" not in n
                                                    for n in os.listdir(ck)), deadline)  # fmt: skip
        print("checkpoints at the notice", sorted(os.listdir(ck)))
        cluster.add_node(num_cpus=2, resources={"rank": 2})
        cluster.remove_node(victim)
        removed.set()
        fit.join(240)
        losses = run["losses"]
        saves = sorted(n for n in os.listdir(ck) if n.startswith("step-"))
        assert len(losses) == 16 and saves == ["step-00000004", "step-00000016"], saves  # at the notice, at the end
        assert_fit_like_one_process(losses, dm.state_dict("param"), rows, 8, 2, 2, adamw(), shuffle=True, seed=3)
        dm.shutdown()
        print("checkpointed at the notice like one process")
    finally:
        ray.shutdown()
        cluster.shutdown()
    """)
    print(out)
    assert "checkpointed at the notice like one process" in out and "restarting the ranks after the preemption" in out
