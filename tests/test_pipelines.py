"""Pipeline parallelism on CPU ranks, held to one plain process.

Stages are meshes of their own; activations cross between them by
``dist.reshard`` (send/recv, which raydist runs over gloo: `raydist.compat.collectives`).
"""

import os
import signal
import time

import paddle
import paddle.distributed as dist
import pytest
import faults
import raydist
from helpers import wait_blocked, wait_gone
from models import Chain, Reference, Rows, adamw, assert_close, assert_params_equal, batches, build_chain, global_batches, sgd

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240)]


def _pipeline(schedule: str, accumulate: int, **more) -> dist.Strategy:
    return dist.Strategy({"pipeline": {"enable": True, "schedule_mode": schedule, "accumulate_steps": accumulate,
                                       **more}})  # fmt: skip


def _assert_params(dm, ref: Reference) -> None:
    params = dm.state_dict("param")
    assert sorted(params) == sorted(ref.params())
    assert_params_equal(params, ref.params())


@pytest.mark.parametrize(
    "stages, blocks, strategy, optimizer",
    [
        ([[0], [1]], 2, _pipeline("FThenB", 2), sgd()),
        ([[0], [1]], 2, _pipeline("FThenB", 4), adamw()),
        ([[0], [1]], 2, _pipeline("1F1B", 2), adamw()),
        ([[0], [1]], 2, _pipeline("1F1B", 4), sgd()),
        ([[0], [1]], 4, _pipeline("VPP", 2, vpp_degree=2, vpp_seg_method="Block"), adamw()),
        pytest.param([[0], [1], [2]], 3, _pipeline("1F1B", 4), adamw(), marks=pytest.mark.slow),
        pytest.param([[0, 1], [2, 3]], 2, _pipeline("1F1B", 2), adamw(),
                     marks=pytest.mark.slow),  # pp2 x mp2: each stage column-parallel
        ([[0], [1]], 2, None, sgd()),  # stages without the pipeline section: one batch, stage after stage
    ],
    ids=["FThenB-2-sgd", "FThenB-4-adamw", "1F1B-2-adamw", "1F1B-4-sgd", "VPP-2-adamw", "3stages-1F1B-4-adamw",
         "pp2xmp2-1F1B-2-adamw", "stages-only"],  # fmt: skip
)
@pytest.mark.long
def test_pipelines_train_eval_and_predict_like_one_process(stages, blocks, strategy, optimizer):
    """Every mode, in any order (predict and eval before the first train step, and between
    train steps), from parameters set through set_state_dict, and the parameters after:
    equal to one process."""
    ref = Reference(optimizer, net=Chain(None, blocks))
    start = {name: value.numpy() for name, value in Chain(None, blocks, seed=3).state_dict().items()}
    ref.net.set_state_dict(start)
    steps = batches(4)
    x_eval, y_eval = batches(1, seed=5)[0]
    with raydist.to_static(build_chain(stages, blocks, dim="mp"), loss=paddle.nn.MSELoss(), optimizer=optimizer,
                           strategy=strategy, num_workers=sum(map(len, stages))) as dm:  # fmt: skip
        dm.set_state_dict(start)  # every stage keeps its own
        dm.predict()
        assert_close(dm(x_eval), ref.predict(x_eval))
        for i, (x, y) in enumerate(steps):
            dm.train()
            assert_close(dm(x, y), ref.train(x, y), what=f"step {i}")
            if i == 1:
                dm.eval()
                assert_close(dm(x_eval, y_eval), ref.eval(x_eval, y_eval))
                dm.predict()
                assert_close(dm(x_eval), ref.predict(x_eval))
        _assert_params(dm, ref)
        if isinstance(ref.opt, paddle.optimizer.AdamW):  # every stage's optimizer state
            state = dm.state_dict("opt")
            assert len([n for n in state if "moment1" in n]) == 2 * blocks, sorted(state)


@pytest.mark.slow
@pytest.mark.long
def test_pp2_by_dp2_reads_a_loader_per_stage_and_checkpoints_move_between_layouts(tmp_path):
    """pp2 x dp2: the first stage's ranks read the inputs, the last stage's the labels, each
    row once (the losses of one process over the loader's global batches). A checkpoint saved
    on pp2 loads on pp2 x dp2, and one saved there loads on one rank."""
    ref = Reference(adamw(), net=Chain(None, 2))
    rows = Rows(32)
    strategy = _pipeline("1F1B", 2)
    with raydist.to_static(build_chain([[0], [1]]), loss=paddle.nn.MSELoss(), optimizer=adamw(), strategy=strategy,
                           num_workers=2) as dm:  # fmt: skip
        for x, y in batches(2):
            assert_close(dm(x, y), ref.train(x, y))
        dm.save(str(tmp_path / "pp2"))
    with raydist.to_static(build_chain([[0, 1], [2, 3]]), loss=paddle.nn.MSELoss(), optimizer=adamw(),
                           strategy=_pipeline("1F1B", 2), num_workers=4) as dm:  # fmt: skip
        dm.load(str(tmp_path / "pp2"))
        stages = [dist.ProcessMesh([0, 1], dim_names=["dp"]), dist.ProcessMesh([2, 3], dim_names=["dp"])]
        loader = raydist.shard_dataloader(rows, stages, input_keys=["x", "y"], shard_dims="dp", batch_size=8)
        losses = dm.fit(loader, epochs=1, progress=False)
        expected = [ref.train(x, y) for x, y in zip(*global_batches(rows, 8, 2, epoch=0))]
        assert_close(losses, expected)
        _assert_params(dm, ref)
        dm.save(str(tmp_path / "pp2xdp2"))
    with raydist.to_static(lambda: Chain(None, 2), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=1) as dm:
        dm.load(str(tmp_path / "pp2xdp2"))
        for x, y in batches(2, seed=7):
            assert_close(dm(x, y), ref.train(x, y))  # the optimizer's state came along too
        _assert_params(dm, ref)


# Kill to RankError: 0.024-0.051 s in 11 runs on a 2-core machine (2026-12-02), 0.033 s with
# the rest of this file before it; the bound leaves room for a loaded machine.
DEATH_TO_ERROR_S = 0.25


@pytest.mark.slow
def test_a_stage_that_dies_mid_schedule_is_a_rank_error_naming_it(tmp_path):
    """Rank 1 (the last stage) is killed inside its second step, waiting in the schedule for
    rank 0's first micro-batch (rank 0 is held at that step's start until rank 1 is gone:
    `faults.hold_step_1_until_rank_1_is_gone`); rank 0 then runs its part against a dead
    peer. A RankError naming rank 1 within DEATH_TO_ERROR_S of the kill (the README says "in
    about a second"), well before gloo's 30 s timeout, and the group is gone."""
    flag = tmp_path / "rank-1-in-step-1"
    env = faults.hook("hold_step_1_until_rank_1_is_gone")
    env["env_vars"]["RAYDIST_TEST_FLAG"] = str(flag)
    with raydist.to_static(build_chain([[0], [1]]), loss=paddle.nn.MSELoss(), optimizer=sgd(),
                           strategy=_pipeline("1F1B", 2), num_workers=2, runtime_env=env) as dm:  # fmt: skip
        (x, y), second = batches(2)
        assert_close(dm(x, y), Reference(sgd(), net=Chain(None, 2)).train(x, y))
        pids = [r.pid for r in dm.ranks]
        loss = dm(*second)  # returns at once: step 1 runs
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert int(flag.read_text()) == pids[1]  # rank 1 began step 1
        wait_blocked(pids[1])  # and is in the schedule now, waiting for rank 0
        assert not loss.done
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(raydist.RankError) as error:
            float(loss)
        took = time.monotonic() - start
        assert error.value.rank == 1 and error.value.died and error.value.during == "step 1", error.value
        assert took < DEATH_TO_ERROR_S, (took, error.value)
    wait_gone(pids)
