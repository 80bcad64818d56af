"""The bench's real model blocks (bench/models.py) held to one plain process, and the ranks' fast
step path held to Paddle's own ``Executor.run`` on them, bit for bit.

These are the models whose small steps bench/paired.py times: a transformer's MLP block (mp2),
a GPT block (mp2) and the tiny LLaMA of Paddle's auto-parallel tests (dp2 x mp2: RMSNorm over a
hidden dim split on "mp", so an all-reduce of reduce type avg).
"""

import numpy as np
import paddle
import pytest

import raydist
from bench import models
from bench.reference import adamw, one_process
from models import assert_close

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(400)]

STEPS = 6
PADDLES_RUN = {"RAYDIST_COMPAT_DISABLE": "executor", "FLAGS_new_executor_serial_run": "0"}


def sgd(params):  # for one process: AdamW scales the round-off of a near-zero gradient up to a full step
    return paddle.optimizer.SGD(0.05, parameters=params)


def through_raydist(name: str, env: dict, optimizer=adamw) -> tuple[list[float], dict]:
    with raydist.to_static(lambda: models.build_layer(name), None, models.loss(name), optimizer,
                           num_workers=models.world_size(name), runtime_env={"env_vars": env}) as dm:  # fmt: skip
        losses = [dm(x, y) for x, y in models.data(name, STEPS)]
        return [float(loss) for loss in losses], dm.state_dict("all")


@pytest.mark.parametrize("name", ["block-mp2", "gptblock-mp2", "llama-dp2xmp2"])
@pytest.mark.long
def test_a_real_block_trains_as_one_process(name):
    losses, state = through_raydist(name, {}, sgd)
    ref_losses, ref_params = one_process(name, STEPS, sgd)
    assert_close(losses, ref_losses, rtol=1e-5, what="losses")
    for key, value in ref_params.items():
        assert_close(state[key], value, rtol=1e-5, atol=1e-6, what=key)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["block-mp2", "llama-dp2xmp2"])
@pytest.mark.long
def test_the_fast_path_equals_paddles_executor_run_bit_for_bit_on_a_real_block(name):
    fast, fast_state = through_raydist(name, {})
    slow, slow_state = through_raydist(name, PADDLES_RUN)
    assert fast == slow, (fast, slow)
    assert fast_state.keys() == slow_state.keys()
    for key in fast_state:
        assert np.array_equal(fast_state[key], slow_state[key]), key


def test_inputs_and_labels_take_no_gradient():
    """As in Paddle's own programs from a DataLoader: the train step of a column- then
    row-parallel block all-reduces its output once and its input's gradient never (the
    default of a spec, stop_gradient=False, would differentiate through the data, with an
    all-reduce more per step)."""
    with raydist.to_static(lambda: models.build_layer("block-mp2"), None, models.loss("block-mp2"), adamw,
                           num_workers=2) as dm:  # fmt: skip
        dm(*models.data("block-mp2", 1)[0])
        program = dm.dist_main_program("train")
        assert_public_view(dm, steps=1)
    data = [line for line in program.splitlines() if '"pd_op.data"' in line and ('"input0"' in line or '"label0"' in line)]
    assert len(data) == 2 and all("stop_gradient:[true]" in line for line in data), data
    assert program.count("all_reduce") == 1, program


def assert_public_view(dm, steps: int) -> None:
    """`dm.ranks`, `dm.dispatch` and `dm.step`: what a user (or a test) sees of a model's ranks."""
    import os

    ranks = dm.ranks
    assert [r.rank for r in ranks] == list(range(dm.num_workers)), ranks
    assert len({r.pid for r in ranks}) == len(ranks) and os.getpid() not in {r.pid for r in ranks}
    assert {(r.device, r.mode, r.step, r.kind) for r in ranks} == {("cpu", "train", steps, "model")}, ranks
    assert all(r.node_id and r.node_ip and r.group for r in ranks), ranks
    assert dm.dispatch == "calls" and dm.step == steps
