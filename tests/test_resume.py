"""A run broken off goes on from its checkpoint directory: fit(resume=True), and a user's own loop
with raydist.latest_checkpoint and loader.epoch(epoch, step). Each ends as the undisturbed run."""

import os
import shutil

import numpy as np
import paddle
import pytest

import raydist
from helpers import Pairs, one_process_losses, scheduled_sgd
from models import assert_close, assert_params_equal, build, build_chain

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300), pytest.mark.slow]

MESH = paddle.distributed.ProcessMesh([0, 1], dim_names=["dp"])


def loader(rows: int = 48, batch_size: int = 8, seed: int = 3):
    return raydist.shard_dataloader(Pairs(rows), MESH, shard_dims="dp", batch_size=batch_size, shuffle=True, seed=seed,
                                    prefetch=2)  # fmt: skip


class Broken(Exception):
    """The driver's end, as a test can have it in one process."""


class Steps(paddle.callbacks.Callback):
    """Counts the steps this driver ran; breaks off the run after ``break_at`` of them."""

    def __init__(self, break_at: int | None = None):
        self.break_at, self.seen = break_at, 0

    def on_train_batch_end(self, step, logs=None):
        self.seen += 1
        if self.seen == self.break_at:
            raise Broken


def stopper():
    # every evaluation after the first is "no better" (min_delta 100): with patience 2 the run
    # stops after epoch 2's evaluation, but only if the evaluations before a resume are remembered
    return paddle.callbacks.EarlyStopping(monitor="loss", mode="min", patience=2, min_delta=100, verbose=0,
                                          save_best_model=False)  # fmt: skip


def fit(directory, break_at=None, build_layer=None, data=None, **kwargs):
    """5 epochs of 6 steps (a step-decay schedule, shuffled) stopped early by EarlyStopping; the history,
    every tensor, and the train steps this driver ran."""
    data = data or loader()
    steps = Steps(break_at)
    callbacks = [stopper(), steps]
    with raydist.to_static(build_layer or build("dp"), data, paddle.nn.MSELoss(), scheduled_sgd("step"),
                           num_workers=2) as dm:  # fmt: skip
        history = dm.fit(data, epochs=5, checkpoint_every=4, checkpoint_dir=str(directory), progress=False,
                         eval_loader=loader(16, seed=1), callbacks=callbacks, **kwargs)  # fmt: skip
        return history, dm.state_dict("all"), steps.seen


@pytest.fixture(scope="module")
def calm(ray_session, tmp_path_factory):
    """The undisturbed run (resume=True on an empty directory starts it; keep_last=2)."""
    directory = tmp_path_factory.mktemp("calm") / "ck"
    history, state, _ = fit(directory, resume=True, keep_last=2)
    assert len(history) == 18, len(history)  # EarlyStopping ended it after 3 of 5 epochs
    names = sorted(os.listdir(directory))
    assert names == ["events.jsonl", "finished.json", "step-00000016", "step-00000018"], names
    found = raydist.latest_checkpoint(str(directory))
    assert found.finished and found.steps == 18 and found.path.endswith("step-00000018")
    assert_close(found.history, history, rtol=0, atol=0)
    expected, params = one_process_losses(epochs=3)  # held to one process, not only to itself
    assert_close(history, expected, what="losses")
    assert_params_equal(state, params)
    return history, state


@pytest.mark.long
def test_a_run_broken_off_goes_on_from_its_newest_checkpoint_and_ends_as_an_undisturbed_one(calm, tmp_path):
    calm_history, calm_state = calm
    directory = tmp_path / "ck"
    with pytest.raises(Broken):
        fit(directory, break_at=10)
    found = raydist.latest_checkpoint(str(directory))
    # the newest is after step 8: epoch 1 (6 steps each) goes on at its step 2
    assert not found.finished and found.steps == 8 and found.position == (1, 2), found
    assert_close(found.history, calm_history[:8], rtol=0, atol=0)
    history, state, sent = fit(directory, resume=True)
    assert sent == 18 - 8  # only the steps after the checkpoint ran
    assert_close(history, calm_history, rtol=0, atol=0, what="losses")  # EarlyStopping's waiting carried over
    for name, value in calm_state.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)

    before = {n: os.stat(directory / n).st_mtime_ns for n in os.listdir(directory)}
    history, state, sent = fit(directory, resume=True)  # finished: the history, the final state, nothing written
    assert sent == 0 and {n: os.stat(directory / n).st_mtime_ns for n in os.listdir(directory)} == before
    assert_close(history, calm_history, rtol=0, atol=0)
    for name, value in calm_state.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


@pytest.mark.long
def test_a_directory_of_another_run_is_refused_before_any_step_saying_how_it_differs(calm, tmp_path):
    directory = tmp_path / "ck"
    with pytest.raises(Broken):
        fit(directory, break_at=5)
    for what, kwargs in [("global batch size: 8 there, 16 here", dict(data=loader(batch_size=16))),
                         ("loader length (steps per epoch): 6 there, 8 here", dict(data=loader(64))),
                         ("loader seed: 3 there, 4 here", dict(data=loader(seed=4))),
                         ("parameters only here: blocks.0.fc.bias", dict(build_layer=build_chain([[0, 1]], 3)))]:
        with pytest.raises(ValueError, match="another model or loader") as info:
            fit(directory, resume=True, **kwargs)
        assert what in str(info.value), (what, info.value)
    with pytest.raises(ValueError, match="is not empty.*resume=True"):
        fit(directory)
    os.makedirs(tmp_path / "other")
    open(tmp_path / "other" / "notes.txt", "w").close()
    with pytest.raises(ValueError, match="no complete raydist checkpoint"):
        fit(tmp_path / "other", resume=True)


def test_a_users_own_loop_goes_on_from_latest_checkpoint_at_the_loaders_step(tmp_path):
    """dm.save(path, position, record) and raydist.latest_checkpoint + loader.epoch(epoch, step): the
    losses and parameters of the loop run through once (which test_data holds to one process)."""
    directory, data = str(tmp_path / "ck"), loader()
    losses, done = [], 0
    with raydist.to_static(build("dp"), data, paddle.nn.MSELoss(), scheduled_sgd("step"), num_workers=2) as dm:
        for epoch in range(2):
            for step, batch in enumerate(data.epoch(epoch)):
                losses.append(float(dm(*batch)))
                dm.lr_scheduler.step()
                done += 1
                if done % 4 == 0:
                    dm.save(f"{directory}/step-{done:08d}", position=(epoch, step + 1), record={"losses": losses})
        calm = dm.state_dict("param")

    with raydist.to_static(build("dp"), data, paddle.nn.MSELoss(), scheduled_sgd("step"), num_workers=2) as dm:
        found = raydist.latest_checkpoint(directory)
        assert found.position == (1, 6) and found.record["losses"] == losses[:12] and not found.finished, found
        # as if the loop had broken off after step 9: go on from the checkpoint after step 8
        shutil.rmtree(f"{directory}/step-00000012")
        found = raydist.latest_checkpoint(directory)
        assert found.position == (1, 2) and found.steps > 0, found
        dm.load(found.path)
        again = list(found.record["losses"])
        epoch, start = found.position
        for batch in data.epoch(epoch, start):
            again.append(float(dm(*batch)))
            dm.lr_scheduler.step()
        assert_close(again, losses, rtol=0, atol=0, what="losses")
        params = dm.state_dict("param")
    for name, value in calm.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
