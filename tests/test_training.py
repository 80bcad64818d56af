"""What a training run needs: learning-rate schedules that step, evaluation with metrics, Paddle's
callbacks in fit, Ray Tune. Every number is held to the same model in one plain process."""

import numpy as np
import paddle
import pytest

import raydist
from raydist import testing
from helpers import KillOnce, Pairs, scheduled_sgd, wait_gone
from models import Reference, assert_close, assert_params_equal, batches, build

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["step", "warmup-cosine", "plateau"])
def test_a_schedule_stepped_from_the_driver_equals_one_process(kind):
    data = batches(7, seed=4)
    ref = Reference(scheduled_sgd(kind))
    with raydist.to_static(build("dpmp"), loss=paddle.nn.MSELoss(), optimizer=scheduled_sgd(kind), num_workers=4,
                           max_in_flight=3) as dm:  # fmt: skip
        assert isinstance(dm.lr_scheduler, paddle.optimizer.lr.LRScheduler)
        losses, expected, rates = [], [], []
        for x, y in data:
            rates.append(dm.lr_scheduler.last_lr)
            loss = dm(x, y)  # in flight: the step below still applies from the next call on
            losses.append(loss)
            expected.append(ref.train(x, y))
            if kind == "plateau":
                dm.lr_scheduler.step(loss)  # waits for this loss: the metric
                ref.opt._learning_rate.step(expected[-1])
            else:
                dm.lr_scheduler.step()
                ref.opt._learning_rate.step()
            assert dm.lr_scheduler.last_lr == pytest.approx(ref.opt._learning_rate.last_lr)
        assert len(set(rates)) > 2, rates  # the schedule did move
        assert_close([float(v) for v in losses], expected)
        params = dm.state_dict("param")
    assert_params_equal(params, ref.params())


def test_a_float_learning_rate_has_no_scheduler():
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(),
                           optimizer=lambda p: paddle.optimizer.SGD(0.1, parameters=p), num_workers=2) as dm:  # fmt: skip
        assert dm.lr_scheduler is None


@pytest.mark.slow
def test_checkpoints_keep_the_schedules_position(tmp_path):
    data = batches(6, seed=5)
    ref = Reference(scheduled_sgd("step"))
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=scheduled_sgd("step"),
                           num_workers=2) as dm:  # fmt: skip
        for x, y in data[:3]:
            assert_close(dm(x, y), ref.train(x, y))
            dm.lr_scheduler.step()
            ref.opt._learning_rate.step()
        dm.save(str(tmp_path / "ckpt"))
    with raydist.to_static(build("mp"), loss=paddle.nn.MSELoss(), optimizer=scheduled_sgd("step"),
                           num_workers=2) as dm:  # fmt: skip
        assert dm.lr_scheduler.last_lr == 0.1
        dm.load(str(tmp_path / "ckpt"))
        assert dm.lr_scheduler.last_lr == ref.opt._learning_rate.last_lr == 0.05
        for x, y in data[3:]:
            assert_close(dm(x, y), ref.train(x, y))
            dm.lr_scheduler.step()
            ref.opt._learning_rate.step()


# -- evaluation with metrics ------------------------------------------------------------

CLASSES = 5


class Classifier(paddle.nn.Layer):
    """12 -> 24 -> CLASSES logits; column- then row-parallel on "mp" when given a mesh."""

    def __init__(self, mesh=None, classes=CLASSES, sigmoid=False):
        super().__init__()
        paddle.seed(11)
        self.fc1, self.fc2 = paddle.nn.Linear(12, 24), paddle.nn.Linear(24, classes)
        self.sigmoid = sigmoid
        if mesh is not None:
            import paddle.distributed as dist

            col = [dist.Replicate(), dist.Shard(1)]
            row = [dist.Replicate(), dist.Shard(0)]
            self.fc1.weight = dist.shard_tensor(self.fc1.weight, mesh, col)
            self.fc1.bias = dist.shard_tensor(self.fc1.bias, mesh, [dist.Replicate(), dist.Shard(0)])
            self.fc2.weight = dist.shard_tensor(self.fc2.weight, mesh, row)

    def forward(self, x):
        out = self.fc2(paddle.tanh(self.fc1(x)))
        return paddle.nn.functional.sigmoid(out) if self.sigmoid else out


def dpmp_mesh():
    import paddle.distributed as dist

    return dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


def labelled(n, seed=0, binary=False):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, 12).astype("float32")
    if binary:
        return x, rng.randint(0, 2, size=(n, 1)).astype("float32")
    return x, rng.randint(0, CLASSES, size=(n, 1)).astype("int64")


def one_process(net, loss_fn, metrics, batches):
    """Loss over every row and the metrics, as one plain process computes them."""
    for m in metrics:
        m.reset()
    total, rows = 0.0, 0
    with paddle.no_grad():
        for x, y in batches:
            out = net(paddle.to_tensor(x))
            total += float(loss_fn(out, paddle.to_tensor(y))) * len(x)
            rows += len(x)
            for m in metrics:
                m.update(*[np.asarray(v) for v in _as_list(m.compute(out, paddle.to_tensor(y)))])
    result = {"loss": total / rows}
    for m in metrics:
        result.update(zip(_as_list(m.name()), map(float, _as_list(m.accumulate()))))
    return result


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


@pytest.mark.slow
def test_evaluate_reports_accuracy_top1_and_topk_as_one_process():
    x, y = labelled(48)
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 48, 8)]
    expected = one_process(Classifier(), paddle.nn.CrossEntropyLoss(), [paddle.metric.Accuracy(topk=(1, 2))], batches)
    with raydist.to_static(lambda: Classifier(dpmp_mesh()), loss=paddle.nn.CrossEntropyLoss(),
                           metrics=[paddle.metric.Accuracy(topk=(1, 2))], num_workers=4) as dm:  # fmt: skip
        result = dm.evaluate(batches)
        assert set(result) == {"loss", "acc_top1", "acc_top2"}
        for key, value in expected.items():
            assert result[key] == pytest.approx(value, rel=1e-5), key
        assert 0 < result["acc_top1"] < result["acc_top2"] < 1  # the metrics measure something
        assert dm.mode == "eval"
        assert dm.evaluate(batches) == pytest.approx(result)  # metrics are reset for each evaluation


@pytest.mark.slow
@pytest.mark.long
def test_evaluate_over_a_loader_and_precision_of_a_binary_classifier():
    import ray

    x, y = labelled(48, seed=3, binary=True)
    expected = one_process(Classifier(classes=1, sigmoid=True), paddle.nn.BCELoss(), [paddle.metric.Precision()],
                           [(x, y)])  # fmt: skip
    ds = ray.data.from_items([{"x": x[i], "y": y[i]} for i in range(48)])
    loader = raydist.shard_dataloader(ds, dpmp_mesh(), input_keys=["x", "y"], shard_dims="dp", batch_size=8)
    with raydist.DistModel(lambda: Classifier(dpmp_mesh(), classes=1, sigmoid=True), None, paddle.nn.BCELoss(),
                           None, None, [paddle.metric.Precision()], num_workers=4) as dm:  # fmt: skip
        result = dm.evaluate(loader)  # every row once, in the loader's order: the totals are the same
    assert set(result) == {"loss", "precision"}
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert result["precision"] == pytest.approx(expected["precision"], rel=1e-6)
    assert 0 < result["precision"] < 1


def test_metrics_must_be_paddle_metrics():
    with pytest.raises(TypeError, match="paddle.metric.Metric"):
        raydist.to_static(lambda: Classifier(), loss=paddle.nn.CrossEntropyLoss(), metrics=["acc"], num_workers=2)


# -- Paddle's callbacks in fit -------------------------------------------------------------


def dp_mesh():
    import paddle.distributed as dist

    return dist.ProcessMesh([0, 1], dim_names=["dp"])


class Recorder(paddle.callbacks.Callback):
    """Everything fit tells a callback."""

    def __init__(self):
        super().__init__()
        self.events, self.batches, self.evals = [], [], []

    def on_train_begin(self, logs=None):
        self.events.append("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(f"epoch_begin {epoch}")

    def on_train_batch_end(self, step, logs=None):
        self.batches.append((step, logs["loss"], logs["lr"]))

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(f"epoch_end {epoch}")

    def on_eval_end(self, logs=None):
        self.evals.append(dict(logs))

    def on_train_end(self, logs=None):
        self.events.append("train_end")


def pairs_loader(n=32, **kwargs):
    return raydist.shard_dataloader(Pairs(n), dp_mesh(), shard_dims="dp", batch_size=8, **kwargs)


def reference_run(optimizer, epochs, n=32, lrs=None):
    """One process on the loader's global batches (rows 8k..8k+7 of Pairs, in order); the losses.

    ``lrs``: a float learning rate per step to set before it (when a callback changed it)."""
    data, ref, losses = Pairs(n), Reference(optimizer), []
    for epoch in range(epochs):
        for k in range(n // 8):
            if lrs is not None:
                ref.opt.set_lr(lrs[len(losses)])
            losses.append(ref.train(data.x[8 * k : 8 * k + 8], data.y[8 * k : 8 * k + 8]))
            if lrs is None and isinstance(ref.opt._learning_rate, paddle.optimizer.lr.LRScheduler):
                ref.opt._learning_rate.step()
    return losses, ref


@pytest.mark.slow
def test_fit_steps_the_schedule_every_step_and_callbacks_see_each_loss_and_learning_rate():
    recorder = Recorder()
    with raydist.to_static(build("dp"), pairs_loader(), paddle.nn.MSELoss(), scheduled_sgd("step"),
                           num_workers=2, max_in_flight=3) as dm:  # fmt: skip
        history = dm.fit(pairs_loader(), epochs=2, progress=False, callbacks=[recorder])
        params = dm.state_dict("param")
    expected, ref = reference_run(scheduled_sgd("step"), epochs=2)
    assert_close(history, expected)
    assert_params_equal(params, ref.params())
    assert [b[1] for b in recorder.batches] == history and [b[0] for b in recorder.batches] == [0, 1, 2, 3] * 2
    assert [b[2] for b in recorder.batches] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025, 0.0125, 0.0125])
    assert recorder.events == ["train_begin", "epoch_begin 0", "epoch_end 0", "epoch_begin 1", "epoch_end 1",
                               "train_end"]  # fmt: skip


def test_fit_steps_the_schedule_by_epoch_when_paddles_lr_callback_says_so():
    recorder = Recorder()
    by_epoch = paddle.callbacks.LRScheduler(by_step=False, by_epoch=True)
    with raydist.to_static(build("dp"), pairs_loader(), paddle.nn.MSELoss(), scheduled_sgd("step"),
                           num_workers=2) as dm:  # fmt: skip
        history = dm.fit(pairs_loader(), epochs=3, progress=False, callbacks=[by_epoch, recorder])
    assert [b[2] for b in recorder.batches] == pytest.approx([0.1] * 8 + [0.05] * 4)
    data, ref, expected = Pairs(32), Reference(scheduled_sgd("step")), []
    for epoch in range(3):
        for k in range(4):
            expected.append(ref.train(data.x[8 * k : 8 * k + 8], data.y[8 * k : 8 * k + 8]))
        ref.opt._learning_rate.step()
    assert_close(history, expected)


@pytest.mark.slow
def test_evaluation_in_the_middle_of_fit_leaves_training_unchanged():
    """Two runs, one evaluating after steps 3 and 6: the same losses and state bit for bit,
    both those of one process, and the evaluations those of one process at those steps."""
    recorder = Recorder()
    runs = {}
    for evaluating in (False, True):
        with raydist.to_static(build("dp"), pairs_loader(), paddle.nn.MSELoss(), scheduled_sgd("step"),
                               num_workers=2, metrics=None) as dm:  # fmt: skip
            extra = dict(eval_loader=pairs_loader(16), eval_every=3, callbacks=[recorder]) if evaluating else {}
            runs[evaluating] = dm.fit(pairs_loader(), epochs=2, progress=False, **extra), dm.state_dict("all")
            assert dm.mode == "train"
    assert runs[True][0] == runs[False][0]
    for name, value in runs[False][1].items():
        np.testing.assert_array_equal(runs[True][1][name], value, err_msg=name)
    data, held_out, ref = Pairs(32), Pairs(16), Reference(scheduled_sgd("step"))
    expected, evals = [], []
    for epoch in range(2):
        for k in range(4):  # the loader's global batches: rows 8k..8k+7
            expected.append(ref.train(data.x[8 * k : 8 * k + 8], data.y[8 * k : 8 * k + 8]))
            ref.opt._learning_rate.step()
            if len(expected) % 3 == 0:  # the evaluation loader's two batches of 8: the mean over its rows
                evals.append(ref.eval(held_out.x, held_out.y))
    assert_close(runs[False][0], expected)
    assert_params_equal(runs[False][1], ref.params())
    assert len(recorder.evals) == 2 and all(set(e) == {"loss"} for e in recorder.evals)  # after steps 3 and 6
    assert_close([e["loss"] for e in recorder.evals], evals)


@pytest.mark.slow
def test_early_stopping_ends_the_run():
    stop = paddle.callbacks.EarlyStopping(monitor="loss", mode="min", patience=0, baseline=0.0, save_best_model=False)
    with raydist.to_static(build("dp"), pairs_loader(), paddle.nn.MSELoss(), scheduled_sgd("step"),
                           num_workers=2) as dm:  # fmt: skip
        history = dm.fit(pairs_loader(), epochs=5, progress=False, eval_loader=pairs_loader(16), callbacks=[stop])
    assert len(history) == 4  # one epoch, then the first evaluation did not beat the baseline


def test_paddles_reduce_lr_on_plateau_callback_lowers_a_float_learning_rate_on_the_ranks():
    recorder = Recorder()
    plateau = paddle.callbacks.ReduceLROnPlateau(monitor="loss", mode="max", patience=0, factor=0.5, verbose=0)
    sgd = lambda p: paddle.optimizer.SGD(0.1, parameters=p)  # noqa: E731
    with raydist.to_static(build("dp"), pairs_loader(), paddle.nn.MSELoss(), sgd, num_workers=2) as dm:
        history = dm.fit(pairs_loader(), epochs=3, progress=False, eval_loader=pairs_loader(16),
                         callbacks=[plateau, recorder])  # fmt: skip
    lrs = [b[2] for b in recorder.batches]
    assert lrs[:4] == [0.1] * 4 and len(set(lrs)) >= 2, lrs  # "max" of a falling loss: no improvement, halved
    expected, _ = reference_run(sgd, epochs=3, lrs=lrs)
    assert_close(history, expected)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["checkpoint", "peer_memory"])
def test_steps_replayed_after_a_lost_rank_are_reported_again_with_the_losses_and_rates_of_one_process(tmp_path, source):
    """mp2 (no rank holds another's shard, so the run goes back to its last checkpoint), 2 epochs
    of 8 steps, checkpoints every 3; the rank reading row 41 (step 5's) is killed once, as step 4
    runs (prefetch=1: batch 5 is read as step 4 takes batch 4). The callbacks are told of steps
    0 to f-1, then, from the checkpoint of step 3, of steps 3 to 15: steps 3 to f-1 again, with
    the same losses and learning rates. Every report, the history and the parameters are those
    of one process. With peer memory every 3 steps (and no checkpoint directory) the same: the
    copy after step 3 is the newest every shard has."""
    import paddle.distributed as dist

    recorder = Recorder()
    disk = dict(checkpoint_every=3, checkpoint_dir=str(tmp_path / "ck")) if source == "checkpoint" else {}
    data = KillOnce(64, row=41, marker=str(tmp_path / "killed"))
    loader = raydist.shard_dataloader(data, dist.ProcessMesh([0, 1], dim_names=["mp"]), batch_size=8, prefetch=1)
    with raydist.to_static(build("mp"), loader, paddle.nn.MSELoss(), scheduled_sgd("step"), num_workers=2,
                           max_in_flight=1, steps_per_message=1,
                           peer_memory=3 if source == "peer_memory" else None) as dm:  # fmt: skip
        history = dm.fit(loader, epochs=2, max_failures=1, progress=False, callbacks=[recorder], **disk)
        params = dm.state_dict("param")
        [restart] = [e for e in dm.events() if e["kind"] == "restart"]
    assert (tmp_path / "killed").exists()  # a rank did die
    assert restart["source"] == source and restart["replayed"] >= 1, restart
    assert restart["behind"] == (None if source == "checkpoint" else restart["replayed"]), restart  # fit feeds them
    expected, ref = reference_run(scheduled_sgd("step"), epochs=2, n=64)
    assert_close(history, expected)
    assert_params_equal(params, ref.params())
    rates = [0.1 * 0.5 ** (g // 2) for g in range(16)]  # StepDecay(0.1, step_size=2, gamma=0.5), stepped per step
    reports = recorder.batches  # (step in its epoch, loss, learning rate), in the order fit told them
    failed_at = len(reports) - 16 + 3  # f: reported before the failure; from step 3 on, once more
    assert failed_at > 3, reports  # step 3 (at least) was reported, then replayed
    steps = list(range(failed_at)) + list(range(3, 16))
    assert [step for step, _, _ in reports] == [g % 8 for g in steps], reports
    assert_close([loss for _, loss, _ in reports], [expected[g] for g in steps])
    assert [lr for _, _, lr in reports] == pytest.approx([rates[g] for g in steps])
    assert reports[3:failed_at] == reports[failed_at : 2 * failed_at - 3]  # the same losses and rates, exactly


# -- Ray Tune ------------------------------------------------------------------------------


def tune_trainable(config):
    """A Tune function trainable that trains a raydist model: the ranks live in the trial's bundles."""
    import os
    import time

    from ray import tune
    from ray.util.placement_group import get_current_placement_group

    started = time.time()
    data = batches(4, seed=6)  # models travels by value (registered below): Tune's workers cannot import it
    with raydist.to_static(build("dp"), loss=paddle.nn.MSELoss(), num_workers=2,
                           optimizer=lambda p: paddle.optimizer.SGD(config["trial"]["lr"], parameters=p)) as dm:  # fmt: skip
        inside = testing.placement_group(dm) == get_current_placement_group()
        for epoch in range(4):
            if config["trial"]["slow"]:
                time.sleep(3)  # the other trial reaches each rung first: ASHA compares against it
            for x, y in data:
                loss = dm(x, y)
            tune.report({"loss": float(loss), "pids": [r.pid for r in dm.ranks], "inside": inside,
                         "driver": os.getpid(), "started": started, "at": time.time()})  # fmt: skip


@pytest.mark.slow
@pytest.mark.long
def test_two_ray_tune_trials_train_side_by_side_and_asha_stops_one_freeing_its_ranks(tmp_path):
    import sys

    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    import models

    for module in (sys.modules[__name__], models):  # Tune's workers cannot import tests/
        ray.cloudpickle.register_pickle_by_value(module)
    trainable = tune.with_resources(tune_trainable, tune.PlacementGroupFactory([{"CPU": 1}] + [{"CPU": 1}] * 2))
    tuner = tune.Tuner(
        trainable,
        param_space={"trial": tune.grid_search([{"lr": 0.05, "slow": False}, {"lr": 0.0, "slow": True}])},
        tune_config=tune.TuneConfig(metric="loss", mode="min", max_concurrent_trials=2,
                                    scheduler=ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2)),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="raydist"),
    )  # fmt: skip
    results = tuner.fit()
    assert not results.errors
    by_lr = {r.config["trial"]["lr"]: r for r in results}
    good, bad = by_lr[0.05], by_lr[0.0]
    assert good.metrics["training_iteration"] == 4 and bad.metrics["training_iteration"] < 4  # ASHA stopped it
    assert good.metrics["loss"] < bad.metrics["loss"]
    assert good.metrics["inside"] and bad.metrics["inside"]  # the ranks took the trial's own bundles
    runs = [r.metrics_dataframe for r in (good, bad)]
    assert max(df["started"].min() for df in runs) < min(df["at"].max() for df in runs)  # side by side
    wait_gone(good.metrics["pids"] + bad.metrics["pids"])  # both trials' ranks are gone, the stopped one's too


def test_paddles_visualdl_callback_writes_what_visualdl_reads_back(tmp_path):
    import glob

    from visualdl import LogReader

    log_dir = tmp_path / "vdl"
    with raydist.to_static(build("dp"), pairs_loader(), paddle.nn.MSELoss(), scheduled_sgd("step"),
                           num_workers=2) as dm:  # fmt: skip
        history = dm.fit(pairs_loader(), epochs=2, progress=False, eval_loader=pairs_loader(16),
                         callbacks=[paddle.callbacks.VisualDL(log_dir=str(log_dir))])  # fmt: skip
    (path,) = glob.glob(str(log_dir / "vdlrecords.*.log"))
    reader = LogReader(file_path=path)
    train = reader.get_data("scalar", "train/loss")
    assert [r.id for r in train] == list(range(1, 9))
    assert_close([r.value for r in train], history)
    assert len(reader.get_data("scalar", "eval/loss")) == 2  # an evaluation per epoch


def test_paddles_progbar_logger_prints_the_steps(capsys):
    with raydist.to_static(build("dp"), pairs_loader(), paddle.nn.MSELoss(), scheduled_sgd("step"),
                           num_workers=2) as dm:  # fmt: skip
        history = dm.fit(pairs_loader(), epochs=1, progress=False,
                         callbacks=[paddle.callbacks.ProgBarLogger(log_freq=1, verbose=2)])  # fmt: skip
    out = capsys.readouterr().out
    assert "Epoch 1/1" in out and "step 4/4" in out
    assert f"loss: {history[-1]:.4f}" in out  # Paddle's own format: its last step's loss


@pytest.mark.slow
def test_paddles_wandb_callback_logs_offline(tmp_path, monkeypatch):
    """A real offline wandb run; what the callback hands it is recorded on the way."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    callback = paddle.callbacks.WandbCallback(project="raydist", dir=str(tmp_path), mode="offline")
    logged = []
    log = callback.run.log
    monkeypatch.setattr(callback.run, "log", lambda data, *a, **k: (logged.append(dict(data)), log(data, *a, **k)))
    with raydist.to_static(build("dp"), pairs_loader(), paddle.nn.MSELoss(), scheduled_sgd("step"),
                           num_workers=2) as dm:  # fmt: skip
        history = dm.fit(pairs_loader(), epochs=2, progress=False, eval_loader=pairs_loader(16),
                         callbacks=[callback])  # fmt: skip
    train = [d for d in logged if "train/loss" in d]
    assert [d["train/step"] for d in train] == list(range(1, 9))
    assert_close([d["train/loss"] for d in train], history)
    assert [d["epoch"] for d in logged if "eval/loss" in d] == [0, 1]  # an evaluation per epoch
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # and wandb wrote its run
