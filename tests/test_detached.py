"""Detached models in one process: raydist.attach takes a model over (or finds it let go of) and goes
on at its step, in its mode, with its schedule and specs; the numbers are one process's. A driver
really killed, and a later process attaching, is tests/test_jobs.py's."""

import numpy as np
import paddle
import pytest
import ray

import raydist
from raydist import testing
from helpers import Pairs, scheduled_sgd
from models import Reference, assert_close, assert_params_equal, batches, build, global_batches, sgd

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

MESH = paddle.distributed.ProcessMesh([0, 1], dim_names=["dp"])


def loader(rows: Pairs):
    return raydist.shard_dataloader(rows, MESH, shard_dims="dp", batch_size=8, shuffle=True, seed=3)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_attach_takes_over_a_loader_run_at_its_step_with_its_schedule_and_it_ends_as_one_process(dynamic):
    """3 steps of a shuffled loader epoch; attach(take_over=True, loader=a new loader) in the same mode, at
    step 3, at the schedule's value; the epoch's 3 other steps from loader.epoch(0, 3): one process's
    losses and parameters. The driver taken over is refused from then on, and its shutdown leaves the ranks."""
    rows = Pairs(48)
    name = f"detached-loader-{'dynamic' if dynamic else 'static'}"
    first = loader(rows)
    dm = raydist.to_static(build("dp"), first, paddle.nn.MSELoss(), scheduled_sgd("step"), num_workers=2,
                           name=name, detached=True, dynamic=dynamic)  # fmt: skip
    again = None
    try:
        epoch = first.epoch(0)
        before = []
        for _ in range(3):
            before.append(float(dm(*next(epoch))))
            dm.lr_scheduler.step()  # the third change is not sent before the takeover: it is caught up
        pids = [s.pid for s in raydist.status() if s.group == name]
        assert len(pids) == 2 and all(s.detached for s in raydist.status() if s.group == name)

        second = loader(rows)
        again = raydist.attach(name, loader=second, take_over=True)
        assert (again.mode, again.num_workers, again.step) == ("train", 2, 3)
        assert again.lr_scheduler.last_lr == dm.lr_scheduler.last_lr == 0.05
        assert sorted(s.pid for s in raydist.status() if s.group == name) == sorted(pids)
        with pytest.raises(raydist.GroupShutdownError, match="taken over by the driver with pid"):
            dm(*next(epoch))
        dm.shutdown()  # it only lets go: the ranks are the new holder's
        after = []
        for batch in second.epoch(0, 3):
            after.append(float(again(*batch)))
            again.lr_scheduler.step()

        ref, expected = Reference(scheduled_sgd("step")), []
        for x, y in zip(*global_batches(rows, 8, 2, 0, shuffle=True, seed=3)):
            expected.append(ref.train(x, y))
            ref.opt._learning_rate.step()
        assert_close(before + after, expected)
        params = again.state_dict("param")
        assert_params_equal(params, ref.params())
    finally:
        (again or dm).shutdown()
    assert name not in raydist.driver.lifecycle.detached.models()
    assert not [s for s in raydist.status() if s.group == name]


def test_attach_is_refused_while_held_names_the_models_there_are_and_keeps_eval_mode():
    """A held model is refused, naming its holder; an unknown name lists the models; a name in use is refused.
    Let go of (as a driver that ended), it is attached without take_over, in eval mode with its specs:
    predict's outputs and eval's loss are one process's."""
    data = batches(4)
    dm = raydist.to_static(build("dp"), None, paddle.nn.MSELoss(), sgd(), num_workers=2, name="detached-eval",
                           detached=True)  # fmt: skip
    again = None
    try:
        losses = [float(dm(x, y)) for x, y in data[:3]]
        dm.eval()
        status = [s for s in raydist.status() if s.group == "detached-eval"]
        assert len(status) == 2 and all(s.detached and f"pid {__import__('os').getpid()}" in s.held_by
                                        for s in status)  # fmt: skip
        with pytest.raises(raydist.ModelHeldError, match=r"held by the driver with pid \d+ on .*take_over=True"):
            raydist.attach("detached-eval")
        with pytest.raises(LookupError, match="no detached model named 'nope'.*'detached-eval'"):
            raydist.attach("nope")
        with pytest.raises(ValueError, match="'detached-eval' exists already .*held by the driver"):
            raydist.to_static(build("dp"), None, paddle.nn.MSELoss(), sgd(), num_workers=2, name="detached-eval",
                              detached=True)  # fmt: skip
        testing.lifecycle(dm).hold.release()  # what a driver that ends does
        assert all(s.held_by is None for s in raydist.status() if s.group == "detached-eval")

        again = raydist.attach("detached-eval")
        assert (again.mode, again.step) == ("eval", 3)
        ref = Reference(sgd())
        expected = [ref.train(x, y) for x, y in data[:3]]
        assert_close(losses, expected)
        assert_close(float(again(*data[3])), ref.eval(*data[3]))
        again.predict()
        assert_close(again(data[3][0]), ref.predict(data[3][0]))
    finally:
        (again or dm).shutdown()
    assert "detached-eval" not in raydist.driver.lifecycle.detached.models()


def test_a_rank_lost_while_no_driver_held_the_model_starts_again_from_its_checkpoint(tmp_path):
    """A rank killed while nobody held the model: attach warns and starts new ranks from the last
    checkpoint, at its step; the steps after it are one process's from there."""
    data = batches(6)
    dm = raydist.to_static(build("dp"), None, paddle.nn.MSELoss(), sgd(), num_workers=2, name="detached-lost",
                           detached=True)  # fmt: skip
    again = None
    try:
        for x, y in data[:2]:
            dm(x, y)
        dm.save(str(tmp_path / "ck"))
        saved = dm.state_dict("param")
        dm(*data[2])  # lost with the rank
        testing.lifecycle(dm).hold.release()
        ray.kill(testing.actors(dm)[1], no_restart=True)

        again = raydist.attach("detached-lost")
        assert again.step == 2  # the checkpoint's step
        for name, value in again.state_dict("param").items():
            np.testing.assert_array_equal(value, saved[name])
        ref = Reference(sgd())
        ref.net.set_state_dict({k: paddle.to_tensor(v) for k, v in saved.items()})
        for x, y in data[2:]:
            assert_close(float(again(x, y)), ref.train(x, y))
    finally:
        (again or dm).shutdown()
