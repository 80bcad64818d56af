"""Peer memory (``to_static(..., peer_memory=K)``): a killed rank whose shards no replica holds comes
back from the copies in the keepers' memory and the driver's batches since, no disk read; the run
equals one process. These run on the session's one-node Ray (a killed rank, its keeper alive); the
lost nodes are in tests/test_clusters.py."""

from __future__ import annotations

import os
import signal

import numpy as np
import paddle
import pytest
import ray

import raydist
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


def test_a_keeper_owns_its_copies_and_keeps_the_complete_one_and_the_newest():
    keeper = ray.remote(Keeper).remote()

    def copy(generation, rank, index, keep_from, value):
        ray.get(keeper.keep.remote(generation, rank, index, keep_from, [ray.put({"w": np.full(3, value)})]))

    copy(1, 0, 0, None, 0.0)
    copy(1, 0, 2, 0, 2.0)
    copy(1, 1, 2, 0, 2.0)
    assert ray.get(keeper.held.remote()) == [(1, 0, 0), (1, 0, 2), (1, 1, 2)]
    copy(1, 0, 4, 2, 4.0)  # index 2 is complete everywhere: rank 0's 0 goes
    assert ray.get(keeper.held.remote()) == [(1, 0, 2), (1, 0, 4), (1, 1, 2)]
    copy(2, 0, 4, None, 4.5)  # a new group's first copy lets nothing go
    assert len(ray.get(keeper.held.remote())) == 4
    copy(2, 0, 6, 4, 6.0)  # ... its second does: generation 1 is older than a complete copy
    assert ray.get(keeper.held.remote()) == [(2, 0, 4), (2, 0, 6)]
    [[ref]] = ray.get(keeper.take.remote([(2, 0, 6)]))
    assert ray.get(ref)["w"].tolist() == [6.0] * 3
    ray.kill(keeper)


def test_peer_memory_is_refused_when_not_a_positive_int():
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ValueError, match="peer_memory must be None or an int >= 1"):
            raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2,
                              peer_memory=bad)  # fmt: skip


def _kill_and_go_on(dm, data, ref, kill_after: int, rank: int, in_flight: int = 2):
    """Train on ``data``: after ``kill_after`` steps, kill ``rank`` with ``in_flight`` steps sent,
    restart, and go on from the first step that failed, as a plain loop would; every loss and the
    parameters equal to ``ref`` (one process)."""
    losses = []
    for x, y in data[:kill_after]:
        losses.append(float(dm(x, y)))
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
        event, params = _kill_and_go_on(dm, data, ref, kill_after=7, rank=1)
    assert event["kind"] == "restart" and event["source"] == "peer_memory", event
    assert event["replayed"] == 7 % every, event
    assert_params_equal(params, ref.params())


@pytest.mark.slow
@pytest.mark.parametrize("stages", [[[0], [1]], [[0, 1], [2, 3]]], ids=["pp2", "pp2xmp2"])
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
