"""Pipeline scripts written as Paddle's own auto-parallel tests are (tests/paddle_style: unittest,
no raydist import, pp_degree left at its default, dist.shard_dataloader over a paddle.io.DataLoader),
run unchanged through raydist launch on CPU ranks. Every loss they print equals the same model through
raydist's driver path and in one plain process. And a launch ends, whatever a rank's process does
after its script."""

import io
import re
import sys
import time
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed as dist
import pytest

import raydist
from models import assert_close
from raydist.launch import launch

STYLE = Path(__file__).resolve().parent / "paddle_style"
sys.path.insert(0, str(STYLE))
import pp_net  # noqa: E402

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600), pytest.mark.slow]


def run(script: str, n: int, *args: str, env: dict | None = None) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    status = launch(str(STYLE / script), list(args), n, stdout=out, stderr=err, env=env)
    return status, out.getvalue(), err.getvalue(), time.monotonic() - started


def printed(out: str, label: str) -> dict[int, list[float]]:
    """{rank: losses} of the lines ``[rank r] <label> losses ...``."""
    found = {}
    for rank, values in re.findall(rf"^\[rank (\d+)\] {re.escape(label)} losses (.*)$", out, re.M):
        found[int(rank)] = [float(v) for v in values.split()]
    return found


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.asarray(x), np.asarray(y)) for x, y in pp_net.loader()]


def one_process(net, optimizer) -> list[float]:
    opt = optimizer(net.parameters())
    losses = []
    for x, y in batches():
        loss = paddle.nn.functional.mse_loss(net(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def driver_path(build_layer, optimizer, strategy, n: int) -> list[float]:
    with raydist.to_static(build_layer, None, paddle.nn.MSELoss(), optimizer, strategy, num_workers=n) as dm:
        return [float(dm(x, y)) for x, y in batches()]


def sgd(params):
    return paddle.optimizer.SGD(learning_rate=0.1, parameters=params)


def two_stages():
    return pp_net.PPDemoNet(dist.ProcessMesh([0], dim_names=["pp"]), dist.ProcessMesh([1], dim_names=["pp"]))


@pytest.mark.long
def test_fthenb_then_1f1b_in_one_script_equal_the_driver_path_and_one_process():
    status, out, err, _ = run("pp_schedules.py", 2)
    assert status == 0, err[-4000:]
    expected = one_process(pp_net.PPDemoNet(), sgd)
    for mode in ("FThenB", "1F1B"):
        losses = printed(out, mode)
        assert list(losses) == [1], out[-3000:]  # the last stage holds the loss
        assert_close(losses[1], expected, what=mode)
        assert_close(driver_path(two_stages, sgd, pp_net.pipeline_strategy(mode), 2), expected, what=f"{mode}, driver path")


@pytest.mark.long
def test_pp2_x_dp2_equals_the_driver_path_and_one_process():
    """Four ranks: fleet.init (which DistModel calls under a launcher) makes hybrid gloo groups after
    the global one, two of them at once (raydist.compat.groups)."""
    status, out, err, _ = run("pp_dp.py", 4)
    assert status == 0, err[-4000:]
    losses = printed(out, "pp2xdp2")
    assert sorted(losses) == [2, 3], out[-3000:]
    expected = one_process(pp_net.PPDemoNet(), sgd)
    # each last-stage rank prints the loss of its data-parallel half of the batch: their mean is the batch's
    assert_close(np.mean([losses[2], losses[3]], axis=0), expected, what="ranks 2 and 3")
    assert not np.allclose(losses[2], losses[3])

    def build():
        return pp_net.PPDemoNet(dist.ProcessMesh([0, 1], dim_names=["dp"]), dist.ProcessMesh([2, 3], dim_names=["dp"]))

    assert_close(driver_path(build, sgd, pp_net.pipeline_strategy("1F1B"), 4), expected, what="driver path")


@pytest.mark.parametrize("place", ["0,1,0,1", "0,0,1,1"])
@pytest.mark.long
def test_vpp_with_segments_by_block_class_equals_the_driver_path_and_one_process(place):
    """Blocks on stages 0,1,0,1 (as VPP assigns segments), and 0,0,1,1: VPP then moves blocks 1 and 2
    to the other stage's mesh at initialisation (raydist.compat.stages, case 2)."""
    status, out, err, _ = run("pp_vpp.py", 2, place)
    assert status == 0, err[-4000:]
    losses = printed(out, "VPP")
    assert len(losses) == 1, out[-3000:]

    def adamw(params):
        return paddle.optimizer.AdamW(learning_rate=0.01, parameters=params)

    expected = one_process(pp_net.VPPDemoNet(), adamw)
    assert_close(next(iter(losses.values())), expected, what="launched")

    blocks = tuple(int(p) for p in place.split(","))

    def build():
        return pp_net.VPPDemoNet([dist.ProcessMesh([0], dim_names=["pp"]), dist.ProcessMesh([1], dim_names=["pp"])],
                                 blocks)  # fmt: skip

    vpp = pp_net.pipeline_strategy("VPP", vpp_degree=2, vpp_seg_method="Block")
    assert_close(driver_path(build, adamw, vpp, 2), expected, what="driver path")


@pytest.mark.long
def test_a_rank_process_that_outlives_its_script_is_ended_with_the_scripts_status_and_named():
    status, out, err, took = run("lingers.py", 2, "--fail")
    assert status == 3, err[-3000:]
    assert "[rank 0] done 0" in out and "[rank 1] done 1" in out
    assert re.search(r"rank \d's process lingered after its script ended .* ended after \d+ s, with the "
                     r"script's status 3", err), err[-3000:]  # fmt: skip
    assert took < 60, took
    status, out, err, _ = run("lingers.py", 2)
    assert status == 0 and "lingered" in err, err[-3000:]


@pytest.mark.long
def test_without_the_degree_fix_1f1b_fails_on_cpu_and_the_launch_still_ends():
    """Canary for raydist.compat.degree: with pp_degree left at 1, Paddle puts both ranks in stage 0,
    and 1F1B on CPU blocks until gloo's timeout. The launch ends, with a failure, either way."""
    status, out, err, took = run("pp_schedules.py", 2, env={"RAYDIST_COMPAT_DISABLE": "degree"})
    assert "FThenB losses" in out, out[-3000:]
    assert status != 0 and "1F1B losses" not in out, (out[-2000:], err[-2000:])
    assert took < 300, took


def test_without_the_stages_fix_vpp_moving_blocks_to_another_stage_segfaults_on_cpu():
    """Canary for raydist.compat.stages, case 2: Paddle's eager reshard of a parameter to another
    stage's mesh at initialisation segfaults on a CPU build."""
    status, out, err, _ = run("pp_vpp.py", 2, "0,0,1,1", env={"RAYDIST_COMPAT_DISABLE": "stages"})
    assert status != 0 and "VPP losses" not in out, out[-2000:]
    assert "exited with status -11" in err, err[-3000:]  # SIGSEGV
