"""Peer memory (``to_static(..., peer_memory=K)``): a killed rank whose shards no replica holds comes
back from the copies in the keepers' memory and the driver's batches since, no disk read; the run
equals one process. These run on the session's one-node Ray (a killed rank, its keeper alive); the
lost nodes are in tests/test_clusters.py."""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import paddle
import pytest
import ray

import raydist
from raydist import testing
from raydist.driver.lifecycle.peers import Keeper, keeper_nodes
from raydist.driver.lifecycle.recovery import Recovery
from helpers import wait_gone
from models import Chain, Reference, adamw, assert_close, assert_params_equal, batches, build, build_chain

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


def _pipeline(schedule: str, accumulate: int) -> paddle.distributed.Strategy:
    return paddle.distributed.Strategy({"pipeline": {"enable": True, "schedule_mode": schedule,
                                                     "accumulate_steps": accumulate}})  # fmt: skip


def test_copies_go_to_the_next_node_that_runs_ranks_else_another_node_else_their_own():
    assert keeper_nodes(["a", "a", "b", "b"], ["a", "b", "head"]) == ["b", "b", "a", "a"]
    assert keeper_nodes(["b", "c", "a"], ["a", "b", "c"]) == ["c", "a", "b"]
    assert keeper_nodes(["a", "a"], ["head", "a", "z"]) == ["head", "head"]
    assert keeper_nodes(["a", "a"], ["a"]) == ["a", "a"]


def test_the_driver_keeps_the_train_steps_since_a_copy_and_their_rates():
    recovery = Recovery()
    recovery.started(keep=6, base=10)
    for number in range(5):
        recovery.sent(number, rate=0.1 * number, message=f"m{number}")
    # steps 3 and 4 (numbers) did not complete: the model completed 10 + 3 train steps
    assert recovery.completed(done=3) == 13
    assert recovery.since(11, 13) == [(0.1, "m1"), (0.2, "m2")]
    assert recovery.since(13, 13) == []
    assert recovery.resume_rate(done=3, rate_now=9.0) == pytest.approx(0.3)
    assert recovery.resume_rate(done=5, rate_now=9.0) == 9.0
    for number in range(5, 9):
        recovery.sent(number, rate=0.0)
    assert recovery.since(11, 17) is None  # index 11 is no longer kept (6 at most)


def test_a_keeper_keeps_the_complete_copy_and_the_newest():
    keeper = ray.remote(Keeper).remote()

    def copy(generation, rank, index, keep, value):
        ray.get(keeper.keep.remote(generation, rank, index, keep, [ray.put({"w": (np.full(3, value), None)})]))

    copy(1, 0, 0, None, 0.0)
    copy(1, 0, 2, [0], 2.0)
    copy(1, 1, 2, [0], 2.0)
    assert ray.get(keeper.held.remote()) == [(1, 0, 0), (1, 0, 2), (1, 1, 2)]
    copy(1, 0, 4, [2], 4.0)  # index 2 is complete everywhere: rank 0's 0 goes
    assert ray.get(keeper.held.remote()) == [(1, 0, 2), (1, 0, 4), (1, 1, 2)]
    copy(2, 0, 4, None, 4.5)  # a new group's first copy lets nothing go
    assert len(ray.get(keeper.held.remote())) == 4
    copy(2, 0, 6, [4], 6.0)  # ... its second does: generation 1 is older than a complete copy
    assert ray.get(keeper.held.remote()) == [(2, 0, 4), (2, 0, 6)]
    assert ray.get(keeper.pieces.remote((2, 0, 6), ["w"])).tolist() == [6.0] * 3  # to the rank that asks
    [(name, piece)] = ray.get(keeper.describe.remote((2, 0, 6))).items()  # to the driver: no data
    assert name == "w" and piece.shape == (3,) and piece.layout is None
    ray.kill(keeper)


def test_a_keeper_gone_with_its_node_does_not_fail_the_ranks_step_and_the_copy_stays_the_ranks():
    """Seen in the fault soak: after a move off a draining node, a keeper there died with it, and the
    rank's next step raised ActorDiedError from its copy's hand-over."""
    from raydist.messages import MirrorPlan
    from raydist.worker.mirror import Mirror

    keeper = ray.remote(Keeper).remote()
    ray.kill(keeper)
    mirror = Mirror(0, MirrorPlan(2, 1, 0, keeper), trained=0)
    mirror.after_step(2, lambda: {"w": np.ones(2)})
    mirror.before_step(3)  # waits for the hand-over, which failed: no error
    assert list(mirror.copies()) == [2]
    mirror.close()


def test_the_copies_kept_at_or_before_the_last_three_checks_and_the_oldest_message_in_flight():
    from raydist.worker.mirror import kept

    assert kept({8, 10, 12}, None) == {12}
    # checks every 3: the last three at or before 12 are 12, 9 and 6; the copies made every 2
    assert kept({2, 4, 6, 8, 10, 12}, 3) == {12, 8, 6}
    assert kept({4, 5}, 3) == {5}  # no copy at or before a check: only the newest
    assert kept({10, 20, 30}, 10) == {30, 20, 10}
    # a message of many steps: the driver sees them complete only with its answer, so the copy at or
    # before where the oldest message it may not have seen began stays (the fault soak lost it)
    assert kept({2, 4, 6, 8}, None, floor=3) == {8, 2}
    assert kept({2, 4, 6, 8}, 3, floor=7) == {8, 6, 2}


def test_peer_memory_is_refused_when_not_a_positive_int():
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ValueError, match="peer_memory must be None or an int >= 1"):
            raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2,
                              peer_memory=bad)  # fmt: skip


def _kept(dm, index: int, timeout: float = 60.0) -> None:
    """Until the keepers hold every rank's copy after ``index`` train steps (a copy still being
    handed over when its rank dies is lost with it: the test waits for the event, not a timer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = testing.lifecycle(dm).peers.copies()
        if any(i == index and len(ranks) == len(dm.ranks) for (_, i), ranks in held.items()):
            return
        time.sleep(0.05)
    raise TimeoutError(f"no complete copy after {index} steps")


def _kill_and_go_on(dm, data, ref, kill_after: int, rank: int, in_flight: int = 2, kept: int | None = None):
    """Train on ``data``: after ``kill_after`` steps (and, with ``kept``, once that copy is kept),
    kill ``rank`` with ``in_flight`` steps sent, restart, and go on from the first step that failed,
    as a plain loop would; every loss and the parameters equal to ``ref`` (one process)."""
    losses = []
    for x, y in data[:kill_after]:
        losses.append(float(dm(x, y)))
    if kept is not None:
        _kept(dm, kept)
    pids = [r.pid for r in dm.ranks]
    os.kill(pids[rank], signal.SIGKILL)
    wait_gone([pids[rank]])
    done = kill_after
    with pytest.raises(raydist.RankError) as info:
        sent = [dm(x, y) for x, y in data[kill_after : kill_after + in_flight]]
        for loss in sent:
            losses.append(float(loss))
            done += 1
    assert info.value.rank == rank and info.value.died
    wait_gone(pids)
    dm.restart()
    for x, y in data[done:]:
        losses.append(float(dm(x, y)))
    expected = [ref.train(x, y) for x, y in data]
    assert_close(losses, expected)
    restarts = [e for e in dm.events() if e["kind"] == "restart"]
    return restarts[-1], dm.state_dict("param")


@pytest.mark.parametrize("every", [1, 3])
def test_a_killed_tensor_parallel_rank_comes_back_from_peer_memory_and_replays_the_steps_since(every):
    """mp2, AdamW: rank 1 killed after 7 steps; its shards exist nowhere else. restart() takes the
    newest copy every shard has (after 6 steps with every=3, after 7 with every=1), replays the
    steps since from the driver's batches, and the run goes on as one process."""
    data, ref = batches(10, seed=4), Reference(adamw())
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2,
                           peer_memory=every) as dm:  # fmt: skip
        event, params = _kill_and_go_on(dm, data, ref, kill_after=7, rank=1, kept=7 - 7 % every)
    assert event["kind"] == "restart" and event["source"] == "peer_memory", event
    assert event["replayed"] == 7 % every and event["behind"] == 0, event  # the restart replayed them
    assert_params_equal(params, ref.params())


@pytest.mark.slow
@pytest.mark.parametrize("stages", [[[0], [1]], [[0, 1], [2, 3]]], ids=["pp2", "pp2xmp2"])
@pytest.mark.long
def test_a_killed_pipeline_rank_comes_back_from_peer_memory_in_a_plain_loop(stages):
    """1F1B pipelines (pp2, and pp2 x mp2 whose stages are column-parallel): the last rank killed
    after 5 steps; peer memory every 2 steps gives the state after 4, the 5th is replayed."""
    ref = Reference(adamw(), net=Chain(None, 2))
    data = batches(8, seed=6)
    with raydist.to_static(build_chain(stages, 2, dim="mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(),
                           strategy=_pipeline("1F1B", 2), num_workers=sum(map(len, stages)),
                           peer_memory=2) as dm:  # fmt: skip
        event, params = _kill_and_go_on(dm, data, ref, kill_after=5, rank=len(dm.ranks) - 1)
    assert event["source"] == "peer_memory" and event["replayed"] == 1, event
    assert_params_equal(params, ref.params())


def test_before_the_first_copy_a_restart_replays_from_the_builders_state():
    """peer_memory=50 and a rank killed after 3 steps: no copy yet but the one of the start (the
    train program is built at the first step); the builders make it again, 3 steps replayed."""
    data, ref = batches(6, seed=2), Reference(adamw())
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2,
                           peer_memory=50) as dm:  # fmt: skip
        event, params = _kill_and_go_on(dm, data, ref, kill_after=3, rank=0, in_flight=1)
    assert event["source"] in ("peer_memory", "start") and event["replayed"] == 3, event
    assert_params_equal(params, ref.params())


@pytest.mark.long
def test_after_a_load_a_restart_never_takes_a_copy_of_the_state_before_it(tmp_path):
    """mp2, peer_memory=2: a model trains 2 steps (a copy after 2), then loads a checkpoint another
    model saved after 5 steps, trains one more, and loses a rank. The copy after 2 is of the state
    before the load: the restart goes on from the loaded state's own copy (taken at the load) and
    replays the step since; the run is one process's 5 + 1 steps."""
    data, ref = batches(8, seed=5), Reference(adamw())
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2) as other:
        for x, y in data[:5]:
            assert_close(other(x, y), ref.train(x, y))
        other.save(str(tmp_path / "five"))
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2,
                           peer_memory=2) as dm:  # fmt: skip
        for x, y in data[6:8]:
            dm(x, y)
        _kept(dm, 2)
        dm.load(str(tmp_path / "five"))
        _kept(dm, 2)  # the loaded state's copy: the one before went with its timeline
        assert_close(dm(*data[5]), ref.train(*data[5]))
        pids = [r.pid for r in dm.ranks]
        os.kill(pids[1], signal.SIGKILL)
        wait_gone([pids[1]])
        with pytest.raises(raydist.RankError):
            float(dm(*data[6]))
        wait_gone(pids)
        dm.restart()
        [restart] = [e for e in dm.events() if e["kind"] == "restart"]
        assert restart["source"] in ("peer_memory", "checkpoint"), restart
        assert_close(dm(*data[6]), ref.train(*data[6]))
        assert_params_equal(dm.state_dict("param"), ref.params())


# -- lost nodes: real raylets (ray.cluster_utils.Cluster), a driver of its own ---------------

# A 1-CPU head the driver runs on, and NODES worker nodes of one rank each: ranks of mp2 are on
# two nodes, and a removed node takes its rank (and the copies its keeper held) away.
ONE_RANK_NODES = """
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [cluster.add_node(num_cpus=1, resources={"rank": 1}) for _ in range(NODES)]
    ray.init(address=cluster.address, log_to_driver=False)
"""

LOSE_NODES = """
    import logging, sys, tempfile, threading, time
    import paddle, paddle.distributed as dist
    import raydist
    from raydist import checkpoint, testing
    from models import Rows, adamw, assert_fit_like_one_process, build

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, force=True)  # raydist's account of the restart
    GUARD
    try:
        rows = Rows(64)  # 8 steps an epoch
        loader = raydist.shard_dataloader(rows, dist.ProcessMesh([0, 1], dim_names=["mp"]), batch_size=8)
        dm = raydist.to_static(build("mp"), loader, paddle.nn.MSELoss(), adamw(), num_workers=2, peer_memory=4,
                               resources_per_rank={"CPU": 1, "rank": 1}, max_in_flight=1, steps_per_message=1)
        where = {s.rank: s.node_id for s in raydist.status()}
        assert where[0] != where[1], where
        paused, go_on = threading.Event(), threading.Event()

        class Pause(paddle.callbacks.Callback):  # the loop waits after step 5 while nodes go
            def on_train_batch_end(self, step, logs=None):
                if not paused.is_set() and step == 4:
                    paused.set()
                    go_on.wait()

        run = {}
        fit = threading.Thread(target=lambda: run.update(losses=dm.fit(loader, epochs=2, max_failures=1,
                                                                        callbacks=[Pause()], progress=False, **DISK)))
        fit.start()
        paused.wait()
        peers = testing.lifecycle(dm).peers  # the copy after 4 steps kept everywhere before the loss
        while not any(i == 4 and len(r) == 2 for (_, i), r in peers.copies().items()):
            time.sleep(0.05)
        for rank in LOSE:
            cluster.remove_node(next(n for n in nodes if n.node_id == where[rank]))
        go_on.set()
        fit.join()
        [restart] = [e for e in dm.events() if e["kind"] == "restart"]
        print("restart", restart)
        assert_fit_like_one_process(run["losses"], dm.state_dict("param"), rows, 8, 1, 2, adamw())
        dm.shutdown()
        print("ended as one process")
    finally:
        ray.shutdown()
        cluster.shutdown()
"""


@pytest.mark.cluster
@pytest.mark.long
def test_a_lost_node_of_a_tensor_parallel_fit_comes_back_from_peer_memory_with_no_disk():
    """mp2 on two nodes and a spare one, ``fit`` with no checkpoint_dir and peer_memory=4: the node of
    rank 1 goes after 5 steps (with it, rank 0's copies; a 6th may be in flight). Rank 0's own copy
    and rank 1's, on rank 0's node, give the state after 4 steps; the run goes back to it and ends
    as one process.
    Nothing is written to or read from disk: raydist's checkpoint functions fail if called."""
    from clusters import run_driver

    guard = "for name in ('write_pieces', 'read_manifest', 'assemble', 'write_json', 'complete'): " \
            "setattr(checkpoint, name, lambda *a, **k: sys.exit('a checkpoint was written or read'))"
    code = ONE_RANK_NODES.replace("NODES", "3") + LOSE_NODES.replace("DISK", "{}").replace("LOSE", "[1]")
    code = code.replace("GUARD", guard)
    out = run_driver(code, timeout=280)
    print(out)
    assert "ended as one process" in out
    assert re.search(r"'source': 'peer_memory', 'checkpoint': None, 'replayed': [12]\b", out), out


@pytest.mark.cluster
@pytest.mark.long
def test_a_rank_and_the_node_of_its_copy_both_lost_fall_back_to_the_checkpoint_and_say_so(tmp_path):
    """mp2 on two nodes, two spare ones; rank 0's copies are on rank 1's node and rank 1's on rank
    0's. Both nodes go after 5 steps: no copy is left, the restart goes back to the checkpoint after
    step 3 (checkpoint_every=3), says so in the log and in its event, and the run ends as one process."""
    from clusters import run_driver

    disk = f"dict(checkpoint_dir={str(tmp_path / 'ck')!r}, checkpoint_every=3)"
    code = ONE_RANK_NODES.replace("NODES", "4") + LOSE_NODES.replace("DISK", disk).replace("LOSE", "[0, 1]")
    code = code.replace("GUARD", "")
    out = run_driver(code, timeout=280)
    print(out)
    assert "ended as one process" in out
    assert "peer memory cannot serve the restart: no copy is left" in out, out
    assert re.search(r"'source': 'checkpoint', 'checkpoint': '[^']*step-00000003', 'replayed': [23]\b", out), out


# -- the replica check ---------------------------------------------------------------------


def test_replicas_that_disagree_are_named_by_the_majority_or_all_of_them_without_one():
    from raydist.driver.lifecycle.replicas import compare

    agree = {r: {"w": ((r % 2,), 100 + r % 2), "b": ((), 7)} for r in range(4)}  # two pieces, two replicas each
    assert compare(agree, 6) is None
    two = {**agree, 2: {"w": ((0,), 999), "b": ((), 7)}}
    found = compare(two, 6)
    assert (found.ranks, found.names, found.step, found.rank) == ([0, 2], ["w"], 6, 0)
    three = {r: {"w": ((), 5)} for r in range(3)} | {1: {"w": ((), 6)}}
    assert compare(three, 2).ranks == [1]  # the majority says who differs
    assert compare({0: {"w": ((), 5)}, 1: None}, 2) is None  # a rank that no longer kept the codes
    assert isinstance(found, raydist.RankError)


def _flip(tmp_path) -> dict:
    import faults

    env = faults.hook("flip_a_bit_on_rank_2_after_step_5")
    env["env_vars"]["RAYDIST_TEST_FLAG"] = str(tmp_path / "flipped")
    return env


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.long
def test_a_flipped_bit_in_one_replica_is_caught_at_the_next_check_and_restart_goes_back_before_it(dynamic, tmp_path):
    """dp2 x mp2, AdamW, check_replicas=2 and peer_memory=2; a bit of a parameter flips on rank 2
    after step 5. The check after step 6 finds ranks 0 and 2 (its two replicas: no majority)
    disagree on that one parameter, at a later call; restart() goes back to the copy after step 4
    (the last check that passed), replays, and the run ends as one process."""
    data, ref = batches(12, seed=9), Reference(adamw())
    with raydist.to_static(build("dpmp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=4,
                           peer_memory=2, check_replicas=2, runtime_env=_flip(tmp_path), dynamic=dynamic) as dm:  # fmt: skip
        names = set(dm.state_dict("param"))
        caught, i = None, 0
        while i < len(data):
            try:
                loss = float(dm(*data[i]))
            except raydist.ReplicaMismatchError as e:
                if caught is None:  # found within two checks' distance of the flip after step 5
                    assert i <= 5 + 2 * 2, f"raised when step {i + 1} was to be sent"
                caught = caught or e
                dm.restart()
                continue  # step i again
            if i < 5:
                assert_close(loss, ref.train(*data[i]))
            i += 1
        for x, y in data[5:]:
            ref.train(x, y)
        assert (tmp_path / "flipped").exists()
        assert caught is not None and caught.step == 6 and caught.ranks == [0, 2], caught
        assert len(caught.names) == 1 and caught.names[0] in names, caught.names
        kinds = [(e["kind"], e.get("source")) for e in dm.events() if e["kind"] in ("replica_mismatch", "restart")]
        assert kinds == [("replica_mismatch", None), ("restart", "peer_memory")], kinds
        assert_params_equal(dm.state_dict("param"), ref.params())


@pytest.mark.slow
@pytest.mark.long
def test_fit_recovers_from_a_flipped_bit_and_ends_as_one_process(tmp_path):
    """The same corruption in fit(max_failures=1), no checkpoint_dir: the mismatch is recovered
    like a lost rank, from peer memory before it, and the history is one process's."""
    from models import Rows, assert_fit_like_one_process

    rows = Rows(64)
    mesh = paddle.distributed.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    loader = raydist.shard_dataloader(rows, mesh, shard_dims="dp", batch_size=8)
    with raydist.to_static(build("dpmp"), loader, paddle.nn.MSELoss(), adamw(), num_workers=4, peer_memory=2,
                           check_replicas=2, runtime_env=_flip(tmp_path)) as dm:  # fmt: skip
        losses = dm.fit(loader, epochs=2, max_failures=1, progress=False)
        params = dm.state_dict("param")
        [mismatch] = [e for e in dm.events() if e["kind"] == "replica_mismatch"]
    assert (tmp_path / "flipped").exists() and 2 in mismatch["ranks"] and len(mismatch["names"]) == 1, mismatch
    assert mismatch["step"] <= 5 + 2 * 2, mismatch  # raised before a step past two checks' distance was sent
    assert_fit_like_one_process(losses, params, rows, 8, 2, 2, adamw())


def test_a_mismatch_is_only_logged_with_replica_mismatch_warn(tmp_path, caplog):
    data = batches(10, seed=9)
    with raydist.to_static(build("dpmp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=4,
                           check_replicas=2, replica_mismatch="warn", runtime_env=_flip(tmp_path)) as dm:  # fmt: skip
        with caplog.at_level("WARNING", logger="raydist"):
            for x, y in data:
                float(dm(x, y))
            dm.wait()
    assert (tmp_path / "flipped").exists()
    assert any("differ on ranks [0, 2] after 6 train steps" in r.message for r in caplog.records), caplog.text


@pytest.mark.slow
def test_spare_ranks_come_back_from_peer_memory():
    """mp2 with spare_ranks=2 and peer_memory=2: rank 0 killed after 5 steps; restart() adopts the
    spares, takes the copy after 4 steps, replays one, and the run goes on as one process."""
    data, ref = batches(8, seed=5), Reference(adamw())
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2,
                           spare_ranks=2, peer_memory=2) as dm:  # fmt: skip
        float(dm(*data[0]))
        spares = {pid for _, pid in ray.get([a.place.remote() for a in testing.lifecycle(dm).spares._actors])}
        ref.train(*data[0])
        event, params = _kill_and_go_on(dm, data[1:], ref, kill_after=4, rank=0, in_flight=1)
        assert {r.pid for r in dm.ranks} == spares and testing.group(dm).adopted == [0, 1]
    assert event["source"] == "peer_memory" and event["replayed"] == 1, event
    assert_params_equal(params, ref.params())


def test_a_detached_model_with_peer_memory_comes_back_from_it_and_its_keepers_end_with_it():
    """detached=True, mp2, peer_memory=2: its keepers live in the detached namespace; a killed rank
    comes back from peer memory as one process; shutdown ends the keepers too."""
    from raydist.driver.cluster.config import DETACHED_NAMESPACE, KEEPER_NAME

    def keepers():
        return [a for a in ray.util.list_named_actors(all_namespaces=True)
                if KEEPER_NAME.match(a["name"]) and a["name"].startswith("detached-peers-")]  # fmt: skip

    data, ref = batches(8, seed=7), Reference(adamw())
    dm = raydist.to_static(build("mp"), None, paddle.nn.MSELoss(), adamw(), num_workers=2, name="detached-peers",
                           detached=True, peer_memory=2)  # fmt: skip
    try:
        event, params = _kill_and_go_on(dm, data, ref, kill_after=5, rank=1, in_flight=1)
        assert event["source"] == "peer_memory" and event["replayed"] == 1, event
        assert_params_equal(params, ref.params())
        assert keepers() and all(a["namespace"] == DETACHED_NAMESPACE for a in keepers()), keepers()
    finally:
        dm.shutdown()
    deadline = time.monotonic() + 20
    while keepers() and time.monotonic() < deadline:  # a killed actor's name goes once Ray has seen it die
        time.sleep(0.1)
    assert not keepers()


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.long
def test_after_an_elastic_resize_a_killed_rank_comes_back_from_peer_memory(dynamic):
    """An elastic model, (2, 4) ranks of dp x mp2, peer_memory=2: at 4 ranks for 3 steps, moved to
    2 (the state handed over live; the group's copies start from it), then rank 1 killed after
    2 more steps: at 2 ranks no replica holds its shard, and peer memory's copy after 4 steps
    and one step replayed bring it back as one process."""
    data, ref = batches(9, seed=3), Reference(adamw())
    with raydist.to_static(build("elastic"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=(2, 4),
                           peer_memory=2, dynamic=dynamic) as dm:  # fmt: skip
        assert dm.num_workers == 4
        for x, y in data[:3]:
            assert_close(float(dm(x, y)), ref.train(x, y))
        testing.lifecycle(dm).resize(2)
        assert dm.num_workers == 2
        event, params = _kill_and_go_on(dm, data[3:], ref, kill_after=2, rank=1, in_flight=1)
    assert event["source"] == "peer_memory" and event["replayed"] == 1, event
    assert_params_equal(params, ref.params())


@pytest.mark.slow
@pytest.mark.long
def test_after_a_mismatch_fit_goes_back_to_a_checkpoint_before_it_and_saves_those_steps_again(tmp_path):
    """No peer memory, checkpoints every 2 steps, check_replicas=4; a bit flips on rank 2 after step 5.
    The check after step 8 finds it once steps 6 and 8 are saved: the restart loads step 4 (the last
    clean check), not the newer checkpoints that hold the corruption; those are moved aside, the run
    saves steps 6 and 8 again (no collision) and ends as one process; a resumed run finds the end."""
    from models import Rows, assert_fit_like_one_process

    rows, directory = Rows(64), tmp_path / "run"
    mesh = paddle.distributed.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    loader = raydist.shard_dataloader(rows, mesh, shard_dims="dp", batch_size=8)
    with raydist.to_static(build("dpmp"), loader, paddle.nn.MSELoss(), adamw(), num_workers=4, check_replicas=4,
                           runtime_env=_flip(tmp_path)) as dm:  # fmt: skip
        losses = dm.fit(loader, epochs=2, checkpoint_every=2, checkpoint_dir=str(directory), max_failures=1,
                        progress=False)  # fmt: skip
        params = dm.state_dict("param")
        events = dm.events()
    assert (tmp_path / "flipped").exists()
    [mismatch] = [e for e in events if e["kind"] == "replica_mismatch"]
    [restart] = [e for e in events if e["kind"] == "restart"]
    assert mismatch["after"] == 8 and restart["source"] == "checkpoint", (mismatch, restart)
    assert restart["checkpoint"].endswith("step-00000004"), restart
    assert_fit_like_one_process(losses, params, rows, 8, 2, 2, adamw())
    names = os.listdir(directory)
    aside = sorted(n.split(".abandoned-")[0] for n in names if ".abandoned-" in n)
    assert aside[:2] == ["step-00000006", "step-00000008"], names
    assert {"step-00000006", "step-00000008", "step-00000016"} <= set(names), names
    found = raydist.latest_checkpoint(str(directory))
    assert found.finished and found.steps == 16 and found.history == losses
