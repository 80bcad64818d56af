"""The ranks' fast step path (raydist.compat.executor.Prepared) changes no number, and no batch
a step uses can change under it."""

import numpy as np
import paddle
import pytest

import raydist
from raydist.testing import on_ranks
from models import Reference, Rows, adamw, assert_close, assert_params_equal, assert_fit_like_one_process, batches, build

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


def train_through_the_loader(kind: str, n: int, data: Rows, env: dict) -> tuple[list[float], dict]:
    import paddle.distributed as dist

    meshes = {"dp": dist.ProcessMesh([0, 1], dim_names=["dp"]),
              "dpmp": dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])}  # fmt: skip
    loader = raydist.shard_dataloader(data, meshes[kind], input_keys=["x", "y"], shard_dims="dp", batch_size=8,
                                      shuffle=True, seed=3)  # fmt: skip
    with raydist.to_static(build(kind), loader, paddle.nn.MSELoss(), adamw(), num_workers=n,
                           runtime_env={"env_vars": env}) as dm:  # fmt: skip
        losses = [dm(b["x"], b["y"]) for epoch in range(2) for b in loader.epoch(epoch)]
        losses = [float(loss) for loss in losses]
        flag = "FLAGS_new_executor_serial_run"
        serial = on_ranks(dm, lambda rank: paddle.get_flags(flag)[flag])
        assert serial == [env.get(flag, "1") == "1"] * n  # raydist's, unless the environment says
        return losses, dm.state_dict("param")


@pytest.mark.slow
@pytest.mark.parametrize("kind, n", [("dp", 2), ("dpmp", 4)])
@pytest.mark.long
def test_the_prepared_steps_equal_paddles_executor_run_bit_for_bit_and_one_process(kind, n):
    """Shuffled loader runs over 2 epochs: the fast path's losses and parameters (ops run on the
    step's thread) are those of Paddle's own Executor.run (RAYDIST_COMPAT_DISABLE=executor) with
    Paddle's pool of threads to the bit, and those of one process."""
    data = Rows(48, seed=5)
    fast, fast_params = train_through_the_loader(kind, n, data, {})
    slow, slow_params = train_through_the_loader(kind, n, data, {"RAYDIST_COMPAT_DISABLE": "executor",
                                                                 "FLAGS_new_executor_serial_run": "0"})  # fmt: skip
    assert fast == slow, (fast, slow)
    assert fast_params.keys() == slow_params.keys()
    for name in fast_params:
        assert np.array_equal(fast_params[name], slow_params[name]), name
    assert_fit_like_one_process(fast, fast_params, data, 8, 2, 2, adamw(), shuffle=True, seed=3)


@pytest.mark.parametrize("dispatch", ["calls", "compiled"])
def test_a_batch_changed_after_it_was_sent_leaves_its_step_alone(dispatch):
    """The driver's arrays are overwritten (and refilled) right after each call, while the steps
    are still in flight (held for the next message, or sent from a compiled graph's thread):
    every step computes on what was passed, as one process does."""
    data = batches(12, seed=7)
    ref = Reference(adamw())
    expected = [ref.train(x, y) for x, y in data]
    x_buf, y_buf = np.empty_like(data[0][0]), np.empty_like(data[0][1])
    with raydist.to_static(build("mp"), None, paddle.nn.MSELoss(), adamw(), num_workers=2, max_in_flight=4,
                           dispatch=dispatch) as dm:  # fmt: skip
        losses = []
        for x, y in data:
            x_buf[...], y_buf[...] = x, y  # one buffer for every batch, as a loop reusing its arrays has
            losses.append(dm(x_buf, y_buf))
            x_buf[...], y_buf[...] = np.nan, np.nan  # the step may not have run yet
        assert_close([float(loss) for loss in losses], expected)
        params = dm.state_dict("param")
    assert_params_equal(params, ref.params())
