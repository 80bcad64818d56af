"""A failing or dead rank reaches the driver as RankError, fast; bad input fails before dispatch."""

import os
import signal
import sys
import time

import numpy as np
import paddle
import pytest
import ray
from ray.util.placement_group import placement_group_table

import raydist
from raydist import testing
from helpers import schedule, wait_gone
from models import MLP, Reference, assert_close, assert_params_equal, batches, build, sgd

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's own tasks here: workers cannot import tests/
pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]


def raising_build():
    import paddle.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("build_layer fails on rank 1 on purpose")
    return build("dp")()


def test_exception_in_build_layer_names_the_rank():
    start = time.monotonic()
    with pytest.raises(raydist.RankError) as info:
        raydist.to_static(raising_build, loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2)
    assert info.value.rank == 1 and not info.value.died
    assert "build_layer fails on rank 1 on purpose" in info.value.cause
    assert "Traceback" in info.value.cause
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_rank_failing_while_peers_wait_in_a_collective():
    """Rank 1 raises while building the program; rank 0 waits in a barrier and is torn down."""
    x, y = batches(1)[0]
    dm = raydist.to_static(build("dp", fail_on_rank=1), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2)
    pids = [r.pid for r in dm.ranks]
    start = time.monotonic()
    with pytest.raises(raydist.RankError) as info:
        dm(x, y)
    assert info.value.rank == 1 and "forward fails on rank 1 on purpose" in info.value.cause
    assert time.monotonic() - start < 30
    wait_gone(pids)
    with pytest.raises(raydist.GroupShutdownError):
        dm(x, y)


@pytest.mark.parametrize("dispatch", ["calls", "compiled"])
def test_killed_rank_surfaces_as_died(dispatch):
    data = batches(2)
    dm = raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2, dispatch=dispatch)
    float(dm(*data[0]))
    pids = [r.pid for r in dm.ranks]
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    loss = dm(*data[1])  # returns at once: the step runs
    with pytest.raises(raydist.RankError) as info:
        float(loss)
    assert info.value.rank == 1 and info.value.died and info.value.during == "step 1"
    assert time.monotonic() - start < 30
    wait_gone(pids)


def _pg_count():
    return len(placement_group_table())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(layer=MLP()), TypeError, "function that returns it"),
        (dict(layer=42), TypeError, "callable"),
        (dict(optimizer=paddle.optimizer.SGD(0.1, parameters=MLP().parameters())), TypeError, "callable"),
        (dict(loss="mse"), TypeError, "loss"),
        (dict(strategy={"amp": True}), TypeError, "Strategy"),
        (dict(num_workers=0), ValueError, "num_workers"),
        (dict(num_workers=None), ValueError, "num_workers"),
    ],
)
def test_bad_arguments_fail_before_any_actor_starts(kwargs, error, match):
    args = dict(layer=build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2)
    args.update(kwargs)
    before = _pg_count()
    with pytest.raises(error, match=match):
        raydist.to_static(args.pop("layer"), **args)
    assert _pg_count() == before


def test_unpicklable_layer_builder_fails_before_any_actor_starts():
    import threading

    lock = threading.Lock()
    before = _pg_count()
    with pytest.raises(TypeError, match="pickled"):
        raydist.to_static(lambda: (lock, MLP())[1], loss=paddle.nn.MSELoss(), num_workers=2)
    assert _pg_count() == before


def test_mesh_larger_than_the_group():
    with pytest.raises(raydist.UsageError, match="num_workers"):
        raydist.to_static(build("dpmp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2)


def _live_pgs():
    return sum(1 for pg in placement_group_table().values() if pg["state"] != "REMOVED")


@pytest.mark.parametrize("kind", ["dpmp", "optimizer"])
def test_a_builder_that_cannot_run_on_the_group_says_why_and_leaves_nothing(kind):
    """A mesh of 4 processes on 2 ranks, an optimizer factory that returns None: the rank's
    UsageError names the cause (not "process died"), and no rank or placement stays behind."""
    before = _live_pgs()
    if kind == "dpmp":
        with pytest.raises(raydist.UsageError, match=r"uses processes \[2, 3\].*raise num_workers to 4"):
            raydist.to_static(build("dpmp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2)
    else:
        with pytest.raises(raydist.UsageError, match="factory returned None, not a paddle.optimizer.Optimizer"):
            raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=lambda params: None, num_workers=2)
    assert _live_pgs() == before


def test_fit_takes_a_shard_dataloader_or_a_paddle_dataloader_and_refuses_the_rest():
    """fit([...]) is a TypeError that says what fit wants, before a step; a paddle.io.DataLoader's
    batches are global ones, trained as one process trains them; a shuffling one cannot resume."""
    data = batches(3)
    ref = Reference(sgd())
    xs = np.concatenate([x for x, _ in data])
    ys = np.concatenate([y for _, y in data])
    dataset = paddle.io.TensorDataset([paddle.to_tensor(xs), paddle.to_tensor(ys)])
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2) as dm:
        with pytest.raises(TypeError, match=r"fit wants a raydist.shard_dataloader\(...\) or a paddle.io.DataLoader, "
                                            r"got list .*loop yourself"):  # fmt: skip
            dm.fit([data[0]], progress=False)
        assert dm.step == 0
        shuffled = paddle.io.DataLoader(dataset, batch_size=8, shuffle=True)
        with pytest.raises(ValueError, match="shuffling paddle.io.DataLoader"):
            dm.fit(shuffled, max_failures=1, checkpoint_dir="unused", progress=False)
        history = dm.fit(paddle.io.DataLoader(dataset, batch_size=8, shuffle=False), progress=False)
        assert_close(history, [ref.train(x, y) for x, y in data])
        assert_params_equal(dm.state_dict("param"), ref.params())


def test_bad_batches_fail_at_the_driver_and_the_model_stays_usable():
    data = batches(2)
    ref = Reference(sgd())
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2) as dm:
        x, y = data[0]
        with pytest.raises(ValueError, match="does not divide by the 2 ranks"):
            dm(x[:7], y[:7])
        assert_close(dm(x, y), ref.train(x, y))
        with pytest.raises(ValueError, match="takes 2 inputs and labels"):
            dm(x)
        with pytest.raises(TypeError, match="dtype float64"):
            dm(x.astype(np.float64), y)
        with pytest.raises(ValueError, match="shape"):
            dm(x[:, :6], y)
        with pytest.raises(TypeError, match="numpy arrays or paddle Tensors"):
            dm(x.tolist(), y)
        dm.predict()
        with pytest.raises(ValueError, match="takes 1 inputs"):
            dm(x, y)
        dm.train()
        assert_close(dm(*data[1]), ref.train(*data[1]))


# -- every failure is a RankError, on every path (issue 11, A) -----------------------------


def wait_noticed(dm, pid, timeout=20.0):
    """Until Ray has noticed that the rank of ``pid`` is dead (its actor is DEAD)."""
    deadline = time.monotonic() + timeout
    actor = testing.actors(dm)[testing.group(dm).pids.index(pid)]
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=1)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.2)
    raise AssertionError("Ray did not notice the dead rank")


@pytest.mark.slow
@pytest.mark.parametrize("dispatch, when", [("calls", "send"), ("compiled", "receive")])  # each of both, once
def test_a_rank_killed_between_steps_is_a_rank_error_at_the_next_send_or_receive(dispatch, when):
    """"send": Ray has torn the graph down before the next call; "receive": the call goes out first."""
    data = batches(3)
    ref = Reference(sgd())
    dm = raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2, dispatch=dispatch)
    assert_close(dm(*data[0]), ref.train(*data[0]))
    pids = [r.pid for r in dm.ranks]
    os.kill(pids[0], signal.SIGKILL)
    if when == "send":
        wait_noticed(dm, pids[0])
    start = time.monotonic()
    with pytest.raises(raydist.RankError) as info:
        float(dm(*data[1]))  # the call itself or its loss: either way a RankError
    assert info.value.rank == 0 and info.value.died and info.value.during == "step 1"
    assert time.monotonic() - start < 30
    wait_gone(pids)
    with pytest.raises(raydist.GroupShutdownError):
        dm(*data[2])
    dm.restart()  # and the model comes back
    assert_close(dm(*data[0]), Reference(sgd()).train(*data[0]))
    dm.shutdown()


@ray.remote
class _Owner:
    def make(self):
        return [ray.put(np.ones(3))]


def _ref_of_a_dead_owner(timeout: float = 30.0):
    """An object whose owner is gone: ObjectLostError (OwnerDiedError).

    Until the driver's Ray has seen the owner's death, which takes 1-2 s here even after
    the actor is reported dead, the object's copy in the local object store still reads.
    Once one read raised, every later read raises: that is the event waited for.
    """
    owner = _Owner.remote()
    (ref,) = ray.get(owner.make.remote())
    ray.kill(owner)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(ref, timeout=timeout)
        except ray.exceptions.ObjectLostError:
            return ref
        time.sleep(0.05)
    raise AssertionError(f"a dead owner's object still reads after {timeout} s")


class _NoUnpickling:
    def __reduce__(self):
        return (_fail_to_unpickle, ())


def _fail_to_unpickle():
    raise ImportError("this result cannot be unpickled at the driver")


@ray.remote
def _undeserializable():
    return _NoUnpickling()


def _ref_the_driver_cannot_read():
    """A result that cannot be unpickled at the driver: RaySystemError."""
    return _undeserializable.remote()


@pytest.mark.parametrize("make_ref, kind", [
    pytest.param(_ref_of_a_dead_owner, ray.exceptions.ObjectLostError, marks=pytest.mark.slow),
    (_ref_the_driver_cannot_read, ray.exceptions.RaySystemError),
])
def test_every_ray_error_of_a_rank_call_is_a_rank_error_and_tears_the_group_down(make_ref, kind):
    """Not just RayTaskError and RayActorError: whatever Ray raises for a call's result."""
    dm = raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2)
    pids = [r.pid for r in dm.ranks]
    with pytest.raises(raydist.RankError) as info:
        testing.group(dm).gather([make_ref()], "a test", ranks=[1])
    assert isinstance(info.value.__cause__, kind), repr(info.value.__cause__)
    assert info.value.rank == 1 and info.value.during == "a test" and type(info.value.__cause__).__name__ in info.value.cause
    assert not testing.group(dm).alive
    wait_gone(pids)
    with pytest.raises(raydist.GroupShutdownError):
        dm(*batches(1)[0])


@pytest.mark.slow
def test_a_bad_first_batch_is_refused_and_the_model_goes_on():
    """A batch the layer cannot take fails Paddle's program build on every rank: the caller's mistake."""
    x, y = batches(1)[0]
    ref = Reference(sgd())
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2) as dm:
        pids = [r.pid for r in dm.ranks]
        with pytest.raises(raydist.UsageError, match="(?s)train program cannot be built.*Type promotion.*int64"):
            dm(x.astype("int64"), y)
        assert_close(dm(x, y), ref.train(x, y))  # the specs of the failed call are forgotten
        assert [r.pid for r in dm.ranks] == pids  # the same ranks
    with raydist.to_static(build("mp"), num_workers=2) as dm:  # predict only: its first build
        with pytest.raises(raydist.UsageError, match="predict program cannot be built"):
            dm(x.astype("int64"))
        assert_close(dm(x), Reference().predict(x))


@pytest.mark.slow
def test_restart_counts_steps_on(tmp_path):
    data = batches(4)
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2) as dm:
        assert [dm(x, y).step for x, y in data[:3]] == [0, 1, 2]
        dm.save(str(tmp_path / "a"))
        os.kill(dm.ranks[1].pid, signal.SIGKILL)
        with pytest.raises(raydist.RankError, match="during step 3"):
            float(dm(*data[3]))
        dm.restart()
        loss = dm(*data[3])
        assert loss.step == 4  # step 3 was sent (and failed): counted
        float(loss)
        dm.save(str(tmp_path / "b"))
    import json

    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["step"] == 3
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["step"] == 5


@pytest.mark.slow
def test_restart_goes_on_from_the_survivors_state_with_the_schedule_where_it_stood():
    """dp2 under AdamW: rank 1 killed with two steps in flight. restart() takes rank 0's state
    (no checkpoint exists; the step it broke off updated nothing, as its per-parameter counts
    show) and puts the schedule back where it stood before the failed step; the run redone
    from that step equals one process."""

    def scheduled_adamw(params):
        return paddle.optimizer.AdamW(learning_rate=schedule("step"), parameters=params, weight_decay=0.01)

    data, ref = batches(7, seed=8), Reference(scheduled_adamw)
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=scheduled_adamw, num_workers=2,
                           max_in_flight=3) as dm:  # fmt: skip
        for x, y in data[:3]:
            assert_close(dm(x, y), ref.train(x, y))
            dm.lr_scheduler.step()
            ref.opt._learning_rate.step()
        pids = [r.pid for r in dm.ranks]
        os.kill(pids[1], signal.SIGKILL)
        wait_gone(pids[1:])
        with pytest.raises(raydist.RankError) as info:
            sent = []
            for x, y in data[3:5]:  # in flight when the failure is seen; the schedule moves on
                sent.append(dm(x, y))
                dm.lr_scheduler.step()
            float(sent[0])
        assert info.value.during == "step 3" and dm.lr_scheduler.last_lr != ref.opt._learning_rate.last_lr
        dm.restart()
        assert testing.last_restart_source(dm) == "replicas" and dm.lr_scheduler.last_lr == ref.opt._learning_rate.last_lr
        for x, y in data[3:]:
            assert_close(dm(x, y), ref.train(x, y))
            dm.lr_scheduler.step()
            ref.opt._learning_rate.step()
        params = dm.state_dict("param")
    assert_params_equal(params, ref.params())


@pytest.mark.slow
def test_spare_ranks_replace_the_lost_group_and_the_run_equals_one_process():
    """spare_ranks=2 on dp2: started after the group's first step, not listed as ranks; rank 1
    killed: restart() adopts both spares (no new process for the ranks), goes on from the
    survivor's state like one process, and starts two new spares for the next restart once the new
    group's first step is done (their Paddle import would slow it); shutdown stops them all."""
    data, ref = batches(6), Reference(sgd())
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2,
                           spare_ranks=2) as dm:  # fmt: skip
        assert len(testing.lifecycle(dm).spares) == 0
        for x, y in data[:3]:
            assert_close(dm(x, y), ref.train(x, y))
        spare_pids = {pid for _, pid in ray.get([a.place.remote() for a in testing.lifecycle(dm).spares._actors])}
        assert len(spare_pids) == 2 and not spare_pids & {r.pid for r in dm.ranks}
        assert sorted(s.rank for s in raydist.status()) == [0, 1]  # spares are no ranks yet
        pids = [r.pid for r in dm.ranks]
        os.kill(pids[1], signal.SIGKILL)
        wait_gone(pids[1:])
        with pytest.raises(raydist.RankError, match="step 3"):
            float(dm(*data[3]))
        dm.restart()
        assert {r.pid for r in dm.ranks} == spare_pids and testing.group(dm).adopted == [0, 1]
        assert testing.last_restart_source(dm) == "replicas" and len(testing.lifecycle(dm).spares) == 0
        for x, y in data[3:]:
            assert_close(dm(x, y), ref.train(x, y))
        assert len(testing.lifecycle(dm).spares) == 2
        params = dm.state_dict("param")
        ranks = raydist.status()
        assert [s.rank for s in ranks] == [0, 1] and {s.pid for s in ranks} == spare_pids
        assert len({s.group for s in ranks}) == 1  # one group, though the spares were named by the pool
        new_spares = {pid for _, pid in ray.get([a.place.remote() for a in testing.lifecycle(dm).spares._actors])}
    assert_params_equal(params, ref.params())
    wait_gone(list(spare_pids | new_spares))
    with pytest.raises(ValueError, match="spare_ranks"):
        raydist.to_static(build("dp"), num_workers=2, spare_ranks=-1)
