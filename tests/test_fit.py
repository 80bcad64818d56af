"""fit(): a training loop that survives a dead rank; stuck steps time out; placement errors."""

import os
import signal
import time

import numpy as np
import paddle
import pytest

import raydist
from helpers import KillOnce, Pairs, wait_gone
from models import Reference, adamw, assert_close, assert_params_equal, assert_fit_like_one_process, batches, build

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

MESH = paddle.distributed.ProcessMesh([0, 1], dim_names=["dp"])


def fit_run(dataset, tmp, dispatch="calls", **kwargs):
    loader = raydist.shard_dataloader(dataset, MESH, shard_dims="dp", batch_size=8, shuffle=True, seed=3,
                                      prefetch=2)  # fmt: skip
    with raydist.to_static(build("dp"), loader, paddle.nn.MSELoss(), adamw(), num_workers=2, dispatch=dispatch) as dm:
        history = dm.fit(loader, epochs=2, checkpoint_every=3, checkpoint_dir=str(tmp), progress=False, **kwargs)
        return history, dm.state_dict("all")


@pytest.fixture(scope="module")
def calm(ray_session, tmp_path_factory):
    """An undisturbed run: 2 epochs of 6 steps, the losses and parameters of one process."""
    data = Pairs(48)
    history, state = fit_run(data, tmp_path_factory.mktemp("calm"))
    assert len(history) == 12
    assert_fit_like_one_process(history, state, data, batch_size=8, shards=2, epochs=2, optimizer=adamw(),
                                shuffle=True, seed=3)  # fmt: skip
    return history, state


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["calls", "compiled"])
@pytest.mark.long
def test_fit_survives_a_killed_rank_and_ends_where_an_undisturbed_run_does(calm, tmp_path, dispatch):
    calm_history, calm_state = calm
    marker = tmp_path / "killed"
    history, state = fit_run(KillOnce(48, row=37, marker=str(marker)), tmp_path / "hurt", dispatch=dispatch,
                             max_failures=1)  # fmt: skip
    assert marker.exists()  # a rank did die
    assert_close(history, calm_history, rtol=0, atol=0, what="losses")
    for name, value in calm_state.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    assert raydist.checkpoint.complete(str(tmp_path / "hurt"))[0].endswith("step-00000000")


def dies_in_its_next_build(killed: str, marker: str):
    """The dp builder; on rank 1, once ``killed`` exists, its next build kills the process (once)."""
    inner = build("dp")

    def build_layer():
        if paddle.distributed.get_rank() == 1 and os.path.exists(killed) and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return inner()

    return build_layer


@pytest.mark.slow
@pytest.mark.parametrize("max_failures", [1, 2])
@pytest.mark.long
def test_a_rank_dead_in_the_restart_is_one_more_failure_and_the_restart_is_tried_again(calm, tmp_path, max_failures):
    """A rank killed in step 4; the restart's new rank 1 dies while it builds the model. That is a
    second failure: with max_failures=1 fit raises it; with 2 the restart runs again and the run ends
    where an undisturbed one does."""
    killed, marker = tmp_path / "killed", tmp_path / "died-in-build"
    loader = raydist.shard_dataloader(KillOnce(48, row=37, marker=str(killed)), MESH, shard_dims="dp", batch_size=8,
                                      shuffle=True, seed=3, prefetch=2)  # fmt: skip
    with raydist.to_static(dies_in_its_next_build(str(killed), str(marker)), loader, paddle.nn.MSELoss(), adamw(),
                           num_workers=2) as dm:  # fmt: skip
        fit = lambda: dm.fit(loader, epochs=2, checkpoint_every=3, checkpoint_dir=str(tmp_path / "run"),  # noqa: E731
                             max_failures=max_failures, progress=False)  # fmt: skip
        if max_failures == 1:
            with pytest.raises(raydist.RankError, match="rank 1 process died") as info:
                fit()
            assert killed.exists() and marker.exists() and info.value.died
            return
        history, state = fit(), dm.state_dict("all")
        kinds = [e["kind"] for e in dm.events() if e["kind"] in ("failure", "restart")]
    assert killed.exists() and marker.exists()
    assert kinds == ["failure", "failure", "restart"], kinds
    assert_close(history, calm[0], rtol=0, atol=0, what="losses")
    for name, value in calm[1].items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


@pytest.mark.slow
def test_fit_gives_up_after_max_failures(tmp_path):
    loader = raydist.shard_dataloader(KillOnce(48, 5, str(tmp_path / "m")), MESH, shard_dims="dp", batch_size=8)
    with raydist.to_static(build("dp"), loader, paddle.nn.MSELoss(), adamw(), num_workers=2) as dm:
        with pytest.raises(raydist.RankError) as info:
            dm.fit(loader, epochs=1, progress=False)
        assert info.value.died
        with pytest.raises(ValueError, match="checkpoint_dir"):
            dm.fit(loader, max_failures=1)


@pytest.mark.slow
def test_restart_after_a_killed_rank_restores_the_last_checkpoint(tmp_path):
    data, ref = batches(4), Reference(adamw())
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=adamw(), num_workers=2) as dm:
        for x, y in data[:2]:
            assert_close(dm(x, y), ref.train(x, y))
        dm.save(str(tmp_path / "ckpt"))
        float(dm(*data[3]))  # a step the checkpoint does not have
        old = [r.pid for r in dm.ranks]
        os.kill(old[0], signal.SIGKILL)
        with pytest.raises(raydist.RankError):
            float(dm(*data[3]))
        dm.restart()
        assert not set(old) & {r.pid for r in dm.ranks}
        for x, y in data[2:]:  # AdamW's moments came back too, or these would differ
            assert_close(dm(x, y), ref.train(x, y))
        assert_params_equal(dm.state_dict("param"), ref.params())


class Stall(Pairs):
    def __getitem__(self, i):
        if i == 9:
            time.sleep(3600)
        return super().__getitem__(i)


@pytest.mark.slow
def test_a_step_that_never_finishes_times_out():
    """The reader of rank 0's group stalls: rank 0 waits step_timeout_s for its batch, then says so."""
    loader = raydist.shard_dataloader(Stall(32), MESH, shard_dims="dp", batch_size=8, prefetch=1)
    with raydist.to_static(build("dp"), loader, paddle.nn.MSELoss(), adamw(), num_workers=2,
                           step_timeout_s=5) as dm:  # fmt: skip
        pids = [r.pid for r in dm.ranks]
        start = time.monotonic()
        with pytest.raises(raydist.RankError, match="no batch for step 1 of epoch 0 within 5 s") as info:
            for batch in loader():
                float(dm(*batch))
        assert info.value.rank == 0 and info.value.during == "step 1"
        assert time.monotonic() - start < 30
    wait_gone(pids)


def test_a_rank_no_node_can_hold_fails_at_once():
    start = time.monotonic()
    with pytest.raises(ValueError, match="no node of this cluster can hold"):
        raydist.to_static(build("dp"), num_workers=2, resources_per_rank={"CPU": 1000})
    assert time.monotonic() - start < 20


def test_waiting_for_resources_says_what_is_missing():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"waiting for 9 x \{'CPU': 1.0\}: 8 placeable"):
        raydist.to_static(build("dp"), num_workers=9, placement_timeout_s=3)
    assert time.monotonic() - start < 30
