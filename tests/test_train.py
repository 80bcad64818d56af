"""raydist.train.PaddleConfig: a Paddle loop under Ray Train, held to one process; Ray Train's restart and checkpoints."""

import os
import sys

import numpy as np
import pytest
import ray
import ray.train

from raydist.train import PaddleConfig

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray Train's workers cannot import tests/
pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(400)]

ROWS, EPOCHS, LR = 40, 6, 0.1


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(ROWS, 4).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.1).astype("float32")


def loop(config):
    """Full-batch gradient descent, data parallel: each rank's gradient over its shard, summed."""
    import tempfile

    import paddle
    import paddle.distributed as dist

    rank = ray.train.get_context().get_world_rank()
    rows = list(ray.train.get_dataset_shard("train").iter_rows())
    x = paddle.to_tensor(np.array([r["x"] for r in rows], "float32").reshape(-1, 4))
    y = paddle.to_tensor(np.array([r["y"] for r in rows], "float32").reshape(-1, 1))
    w = paddle.create_parameter([4, 1], "float32", default_initializer=paddle.nn.initializer.Constant(0.0))
    opt = paddle.optimizer.SGD(LR, parameters=[w])
    start = 0
    if (checkpoint := ray.train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            w.set_value(np.load(os.path.join(d, "w.npy")))
            start = int(open(os.path.join(d, "epoch")).read()) + 1
    for epoch in range(start, EPOCHS):
        if epoch == 3 and rank == 1 and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()
            raise RuntimeError("rank 1 fails once, on purpose")
        loss = ((paddle.matmul(x, w) - y) ** 2).sum() / ROWS
        loss.backward()
        dist.all_reduce(w.grad)  # the process group PaddleConfig set up
        opt.step()
        opt.clear_grad()
        total = loss.detach()
        dist.all_reduce(total)
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                np.save(os.path.join(d, "w.npy"), w.numpy())
                open(os.path.join(d, "epoch"), "w").write(str(epoch))
            ckpt = ray.train.Checkpoint.from_directory(d) if rank == 0 else None
            ray.train.report({"loss": float(total), "epoch": epoch, "world": dist.get_world_size()}, checkpoint=ckpt)


def _trainer_class():
    from ray.train.v2._internal.constants import is_v2_enabled

    if is_v2_enabled():
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    else:  # pragma: no cover - Ray Train V1
        from ray.train.data_parallel_trainer import DataParallelTrainer
    return DataParallelTrainer


@pytest.mark.slow
@pytest.mark.long
def test_a_paddle_loop_under_ray_train_survives_a_failure_and_equals_one_process(tmp_path):
    x, y = _data()
    trainer = _trainer_class()(
        loop,
        train_loop_config={"marker": str(tmp_path / "failed-once")},
        backend_config=PaddleConfig(),
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(name="paddle", storage_path=str(tmp_path / "runs"),
                                       failure_config=ray.train.FailureConfig(max_failures=1)),  # fmt: skip
        datasets={"train": ray.data.from_items([{"x": a, "y": b} for a, b in zip(x, y)])},
    )
    result = trainer.fit()
    assert (tmp_path / "failed-once").exists()  # a worker did fail, and Ray Train restarted the group
    assert result.metrics["epoch"] == EPOCHS - 1 and result.metrics["world"] == 2
    w = np.zeros([4, 1], "float32")
    for _ in range(EPOCHS):  # one process, all rows
        loss = float(((x @ w - y) ** 2).sum() / ROWS)
        w -= LR * (2 * x.T @ (x @ w - y) / ROWS)
    with result.checkpoint.as_directory() as d:
        np.testing.assert_allclose(np.load(os.path.join(d, "w.npy")), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.metrics["loss"], loss, rtol=1e-5)
