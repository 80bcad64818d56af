"""Clusters that change: ranks across nodes, the autoscaler's new nodes, lost nodes, elastic size.

Every test drives real raylets on this machine (``ray.cluster_utils.Cluster`` or
Ray's autoscaler on its fake multi-node provider) from a driver process of its
own (`clusters.run_driver`), and holds the numbers to one plain process.
"""

import re

import pytest

from clusters import TESTS, AutoscalingHead, cluster, run_driver

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster]  # raylets and heads of their own


def test_a_driver_past_its_timeout_is_interrupted_and_what_it_printed_is_shown():
    """A stuck driver gets Ctrl-C (so its `finally` stops its clusters), and the failure shows its output."""
    with pytest.raises(AssertionError, match=r"(?s)did not end in 3 s.*waiting.*stopped what it started"):
        run_driver("""
        import time
        try:
            print("waiting")
            time.sleep(100)
        finally:
            print("stopped what it started")
        """, timeout=3)


@pytest.mark.long
def test_ranks_wait_for_the_autoscaler_then_train():
    """No worker node at the start: to_static waits while the autoscaler adds two, then trains."""
    with AutoscalingHead(max_nodes=2) as head:
        out = run_driver("""
        import logging, time
        import ray, paddle, paddle.distributed as dist
        import raydist
        from raydist import testing
        from models import Reference, assert_close, assert_params_equal, batches, build, sgd

        logging.basicConfig(level=logging.WARNING)
        ray.init(log_to_driver=False)
        start = time.monotonic()
        dm = raydist.to_static(build("dpmp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=4,
                               resources_per_rank={"CPU": 1, "rank": 1})
        waited = time.monotonic() - start
        ref = Reference(sgd())
        for x, y in batches(3):
            assert_close(dm(x, y), ref.train(x, y))
        print(f"nodes {len({s.node_id for s in raydist.status()})} waited {waited:.1f} s "
              f"trained {time.monotonic() - start:.1f} s")
        dm.shutdown()
        ray.shutdown()
        """, env={"RAY_ADDRESS": head.address})
    print(out)
    assert re.search(r"nodes 2 waited [\d.]+ s", out)


@pytest.mark.long
def test_fit_shrinks_on_a_lost_node_grows_when_one_joins_during_a_save_and_ends_as_one_process():
    """dp x mp2 under AdamW, num_workers=(2, 4) over two 2-CPU nodes, 3 epochs of 8 steps: one
    node lost after step 3 (training goes on at 2 ranks from the surviving data-parallel
    group's state), another joins while the checkpoint after step 12 is being written in the
    background. The loop waits after step 13 until raydist has seen room for 2 more ranks;
    growing waits for the save, which completes at 2 ranks, and the model runs at 4 from step
    16 on at the latest (the step in flight first); the checkpoint written at 2 ranks loads at
    4. Every step's loss and the final parameters equal one plain process."""
    out = run_driver(cluster(2) + """
    import glob, json, logging, os, sys, tempfile, threading, time
    import numpy as np, paddle, paddle.distributed as dist
    import faults, raydist
    from raydist import testing
    from models import Rows, adamw, assert_fit_like_one_process, build

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)  # raydist's account, if this fails
    flag = tempfile.mktemp()
    try:
        rows = Rows(64)
        loader = raydist.shard_dataloader(rows, dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]),
                                          shard_dims="dp", batch_size=8, shuffle=True, seed=3)
        env = faults.hook("pause_a_save_when_flagged")
        resume = tempfile.mktemp()  # the paused save goes on once this exists
        env["env_vars"].update(RAYDIST_TEST_FLAG=flag, RAYDIST_TEST_RESUME=resume)
        # one step at a time: the node goes between two steps, and the survivors break off the
        # next one at the same collective (test_units covers survivors at different steps)
        dm = raydist.to_static(build("elastic"), loader, paddle.nn.MSELoss(), adamw(), num_workers=(2, 4),
                               resources_per_rank={"CPU": 1, "rank": 1}, runtime_env=env, max_in_flight=1,
                               steps_per_message=1)
        placed = raydist.status()
        assert dm.num_workers == 4 and len({s.node_id for s in placed}) == 2, placed
        events, sizes, lose, lost, joined = {}, [], threading.Event(), threading.Event(), threading.Event()
        start, flagged = time.monotonic(), threading.Event()

        def mark(event):  # the run's timeline, printed if it fails
            events.setdefault(event, time.monotonic())

        class Chaos(paddle.callbacks.Callback):
            def on_train_batch_end(self, step, logs=None):
                sizes.append(dm.num_workers)
                if len(sizes) == 3:
                    lose.set()
                    lost.wait()
                if len(sizes) == 9:
                    open(flag, "w").close()  # the save after step 12 pauses (its write, beside the steps)
                    flagged.set()
                if len(sizes) == 13:
                    mark("step 13 waits")
                    joined.wait()  # the loop goes on once raydist has seen the joined node's room
                if len(sizes) > 1 and sizes[-1] != sizes[-2]:
                    mark(f"size {sizes[-1]}")

        # fit runs beside: Ray's add_node and remove_node must run on the main thread
        ck, run = tempfile.mkdtemp() + "/ck", {}
        fit = threading.Thread(target=lambda: run.update(losses=dm.fit(
            loader, epochs=3, checkpoint_every=6, checkpoint_dir=ck, max_failures=1, progress=False,
            callbacks=[Chaos()])))
        fit.start()
        lose.wait()
        cluster.remove_node(nodes[1])
        mark("lost")
        lost.set()
        # the loop's own waits are for events, not timers: the test's timeout bounds them all
        flagged.wait()  # after step 9
        while os.path.exists(flag) or not glob.glob(ck + "/*.saving-*/*"):  # the paused save
            assert fit.is_alive(), "fit ended before the save after step 12 paused"
            time.sleep(0.02)
        mark("save paused")
        saving = glob.glob(ck + "/*.saving-*")
        cluster.add_node(num_cpus=2, resources={"rank": 2})
        mark("node added")
        # the run goes on after step 13 once raydist has seen room for the 2 more ranks
        while testing.lifecycle(dm).can_grow() is None:
            time.sleep(0.05)
        mark("joined")
        during = bool(saving) and os.path.exists(saving[0])  # the save was still being written
        open(resume, "w").close()  # the paused write ends; growing waits for the save's commit
        joined.set()
        fit.join()
        visible = 13
        losses = run["losses"]
        params = dm.state_dict("param")
        redone = dm.step - len(losses)
        timeline = {k: round(t - start, 1) for k, t in sorted(events.items(), key=lambda e: e[1])}
        print("sizes", sizes, "steps sent again", redone, "join visible after step", visible,
              "joined during a save", during, "timeline (s)", timeline)
        # from the survivors' state: only the step in flight runs again (the checkpoint is 3 steps older)
        assert testing.last_restart_source(dm) == "replicas" and redone == 1, (testing.last_restart_source(dm), redone)
        assert during and len(sizes) == 24, (during, sizes, timeline)
        assert sizes[:3] == [4] * 3 and sizes[3:visible] == [2] * (visible - 3), sizes  # shrank, no room to grow
        assert sizes[visible + 2 :] == [4] * (24 - visible - 2), sizes  # at the next boundary, after the step in flight
        print(f"loss to smaller step {events['size 2'] - events['lost']:.1f} s; "
              f"visible join to larger step {events['size 4'] - events['joined']:.1f} s")
        assert not glob.glob(ck + "/*.saving-*"), os.listdir(ck)
        assert_fit_like_one_process(losses, params, rows, 8, 2, 3, adamw(), shuffle=True, seed=3)
        saved = ck + "/step-00000012"  # written at 2 ranks while the node joined
        assert json.load(open(saved + "/manifest.json"))["num_workers"] == 2
        dm.load(saved)  # loads at 4
        assert dm.num_workers == 4
        dm.shutdown()
        print("shrank and grew like one process")
    finally:
        ray.shutdown()
        cluster.shutdown()
    """)
    print(out)
    assert "shrank and grew like one process" in out


@pytest.mark.long
def test_a_lost_node_is_a_rank_error_then_restart_comes_back_at_the_size_that_fits():
    """Outside fit: RankError naming the rank; restart() at 2 ranks from the state the surviving
    data-parallel group held (newer than the checkpoint), the numbers of one process; then a
    model whose minimum no longer fits: TimeoutError."""
    out = run_driver(cluster(2) + """
    import tempfile, time
    import paddle
    import raydist
    from raydist import testing
    from models import Reference, adamw, assert_close, assert_params_equal, batches, build, sgd

    try:
        data, ref = batches(6), Reference(adamw())
        dm = raydist.to_static(build("elastic"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=(2, 4),
                               resources_per_rank={"CPU": 1, "rank": 1})
        assert dm.num_workers == 4
        assert_close(dm(*data[0]), ref.train(*data[0]))
        dm.save(tempfile.mkdtemp() + "/ck")  # older than the survivors' state: not what restart uses
        for x, y in data[1:3]:
            assert_close(dm(x, y), ref.train(x, y))
        on_lost = {s.rank for s in raydist.status() if s.node_id == nodes[1].node_id}
        cluster.remove_node(nodes[1])
        lost = time.monotonic()
        try:
            float(dm(*data[3]))
            raise AssertionError("a lost node went unnoticed")
        except raydist.RankError as e:
            assert e.rank in on_lost, (e.rank, on_lost)
            print(f"RankError naming rank {e.rank} after {time.monotonic() - lost:.1f} s")
        dm.restart()
        assert dm.num_workers == 2 and len(raydist.status()) == 2 and testing.last_restart_source(dm) == "replicas"
        for x, y in data[3:]:  # AdamW's moments came over too, or these would differ
            assert_close(dm(x, y), ref.train(x, y))
        params = dm.state_dict("param")
        assert_params_equal(params, ref.params())
        dm.shutdown()
        print("restarted at 2 from the survivors like one process")

        cluster.add_node(num_cpus=2, resources={"rank": 2})
        dm = raydist.to_static(build("elastic"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=(4, 6),
                               resources_per_rank={"CPU": 1, "rank": 1}, placement_timeout_s=6)
        victim = next(s.node_id for s in raydist.status() if s.node_id != nodes[0].node_id)
        on_victim = {s.rank for s in raydist.status() if s.node_id == victim}
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == victim))
        try:
            float(dm(*data[0]))
            raise AssertionError("a lost node went unnoticed")
        except raydist.RankError as e:
            assert e.rank in on_victim and e.died, (e, on_victim)
            print(f"RankError naming rank {e.rank} of the lost node")
        try:
            dm.restart()
            raise AssertionError("restarted below the minimum")
        except TimeoutError as e:
            assert "waiting for 4 x" in str(e) and "2 placeable" in str(e), e
            print("below the minimum:", e)
    finally:
        ray.shutdown()
        cluster.shutdown()
    """)
    print(out)
    assert "restarted at 2 from the survivors like one process" in out and "below the minimum" in out
    assert out.count("RankError naming rank") == 2


@pytest.mark.long
def test_messages_relayed_through_the_ranks_of_two_nodes_train_like_one_process_and_a_lost_node_is_named():
    """dispatch="tree", dp2 x mp2 over two nodes: the driver sends each message to rank 0, which
    passes it to its node's other rank and to the other node's first rank. Losses, outputs and
    parameters of one plain process; a lost node: RankError naming one of its ranks, at once."""
    out = run_driver(cluster(2) + """
    import time
    import paddle
    import raydist
    from raydist import testing
    from models import Reference, assert_close, assert_params_equal, batches, build, sgd

    try:
        data, ref = batches(8), Reference(sgd())
        dm = raydist.to_static(build("dpmp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=4,
                               resources_per_rank={"CPU": 1, "rank": 1}, dispatch="tree", steps_per_message=3)
        placed = {s.rank: s.node_id for s in raydist.status()}
        assert placed[0] == placed[1] != placed[2] == placed[3], placed
        losses = [dm(x, y) for x, y in data[:6]]  # 0, 1 alone; then 2-4 together, 5 alone
        assert_close(losses, [ref.train(x, y) for x, y in data[:6]])
        assert testing.transport(dm) == "tree" and testing.tree(dm) == {0: [2, 1], 1: [], 2: [3], 3: []}
        dm.predict()
        assert_close(dm(data[6][0]), ref.predict(data[6][0]))
        params = dm.state_dict("param")
        assert_params_equal(params, ref.params())
        dm.train()
        cluster.remove_node(next(n for n in nodes if n.node_id == placed[2]))  # ranks 2, 3: below rank 0
        lost = time.monotonic()
        try:
            for x, y in data:
                dm(x, y)
            dm.wait()
            raise AssertionError("a lost node went unnoticed")
        except raydist.RankError as e:
            assert e.rank in (2, 3) and e.died and time.monotonic() - lost < 30, (e, time.monotonic() - lost)
            print(f"RankError naming rank {e.rank} after {time.monotonic() - lost:.1f} s")
        dm.shutdown()
        print("relayed like one process")
    finally:
        ray.shutdown()
        cluster.shutdown()
    """)
    print(out)
    assert "relayed like one process" in out


@pytest.mark.long
def test_placement_strategy_puts_ranks_on_one_node_or_spreads_them():
    """Two nodes of room for two ranks each (one cluster, both models in turn): PACK puts the two
    ranks on one node, STRICT_SPREAD on two, and both train like one process."""
    out = run_driver(cluster(2) + """
    import paddle
    import raydist
    from models import Reference, assert_close, batches, build, sgd

    try:
        for strategy in ("PACK", "STRICT_SPREAD"):
            ref = Reference(sgd())
            with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                                   resources_per_rank={"CPU": 1, "rank": 1}, placement_strategy=strategy) as dm:
                for x, y in batches(3):
                    assert_close(dm(x, y), ref.train(x, y))
                print(strategy, "nodes", len({s.node_id for s in raydist.status()}))
    finally:
        ray.shutdown()
        cluster.shutdown()
    """)
    assert "PACK nodes 1" in out and "STRICT_SPREAD nodes 2" in out, out


@pytest.mark.long
def test_the_elastic_example_runs_on_a_local_ray():
    """examples/elastic.py, as the README runs it, on its own local Ray (4 ranks: room for all)."""
    out = run_driver("""
    import runpy, sys
    sys.path.insert(0, "examples")
    sys.argv = ["elastic.py", "--epochs", "1"]
    runpy.run_path("examples/elastic.py", run_name="__main__")
    """, cwd=str(TESTS.parent))
    assert re.search(r"training on [24] ranks", out) and "64 steps" in out, out


@pytest.mark.long
def test_two_losses_in_a_row_the_second_during_a_save():
    """(2, 6) over three nodes, dp3 x mp2 at 6 ranks: a node lost between steps (on to 2
    ranks from the survivors' state: 4 would split 3 shards unevenly), then the node of those
    2 lost in the middle of a checkpoint save (no survivor: on to 2 ranks on the last node,
    from the checkpoint before). Every loss and the final parameters equal one process; no
    half-written checkpoint remains."""
    out = run_driver(cluster(3) + """
    import glob, os, tempfile, threading, time
    import paddle, paddle.distributed as dist
    import faults, raydist
    from raydist import testing
    from models import Rows, assert_fit_like_one_process, build, sgd

    flag = tempfile.mktemp()
    try:
        rows = Rows(96)
        mesh = dist.ProcessMesh([[0, 1], [2, 3], [4, 5]], dim_names=["dp", "mp"])
        loader = raydist.shard_dataloader(rows, mesh, shard_dims="dp", batch_size=12)
        env = faults.hook("pause_a_save_when_flagged")
        env["env_vars"]["RAYDIST_TEST_FLAG"] = flag
        dm = raydist.to_static(build("elastic"), loader, paddle.nn.MSELoss(), sgd(), num_workers=(2, 6),
                               resources_per_rank={"CPU": 1, "rank": 1}, runtime_env=env)
        assert dm.num_workers == 6
        ck = tempfile.mkdtemp() + "/ck"
        sizes, lost = [], []

        def node_of_ranks():
            ids = {r.node_id for r in dm.ranks}
            return next(n for n in cluster.worker_nodes if n.node_id in ids)

        def lose_during_save():
            while os.path.exists(flag) or not glob.glob(ck + "/*.saving-*/*"):
                time.sleep(0.02)
            cluster.remove_node(node_of_ranks())
            lost.append("during a save")

        class Chaos(paddle.callbacks.Callback):
            def on_train_batch_end(self, step, logs=None):
                sizes.append(dm.num_workers)
                if len(sizes) == 3 and not lost:
                    cluster.remove_node(node_of_ranks())
                    lost.append("between steps")
                    open(flag, "w").close()
                    threading.Thread(target=lose_during_save, daemon=True).start()

        losses = dm.fit(loader, epochs=2, checkpoint_every=2, checkpoint_dir=ck, max_failures=2, progress=False,
                        callbacks=[Chaos()])
        params = dm.state_dict("param")
        print("sizes", sizes, "lost", lost)
        assert lost == ["between steps", "during a save"] and sizes[0] == 6 and sizes[-1] == 2, (lost, sizes)
        assert not glob.glob(ck + "/*.saving-*"), os.listdir(ck)
        assert_fit_like_one_process(losses, params, rows, 12, 3, 2, sgd())
        dm.shutdown()
        print("two losses like one process")
    finally:
        ray.shutdown()
        cluster.shutdown()
    """)
    print(out)
    assert "two losses like one process" in out
