"""A failing or dead rank reaches the driver as RankError, fast; bad input fails before dispatch."""

import os
import signal
import time

import numpy as np
import paddle
import pytest
from ray.util.placement_group import placement_group_table

import raydist
from models import MLP, Reference, assert_close, batches, build, sgd

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]


def wait_gone(pids, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"rank processes still alive: {alive}")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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


def test_rank_failing_while_peers_wait_in_a_collective():
    """Rank 1 raises while building the program; rank 0 waits in a barrier and is torn down."""
    x, y = batches(1)[0]
    dm = raydist.to_static(build("dp", fail_on_rank=1), loss=paddle.nn.MSELoss(), optimizer=sgd(), num_workers=2)
    pids = list(dm._group.pids)
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
    pids = list(dm._group.pids)
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
