"""raydist quickstart: a small MLP on a 2 x 2 (data x tensor parallel) mesh, four Ray ranks.

    python examples/quickstart.py

Starts a local Ray, trains for 100 steps (one batch of 32 rows each; set
QUICKSTART_STEPS to change it) with a warm-up-and-cosine learning-rate schedule,
then evaluates and predicts.
"""

import os

import numpy as np
import paddle
import paddle.distributed as dist
from tqdm import tqdm

import raydist

IN, HIDDEN, OUT, BATCH = 16, 64, 4, 32


class MLP(paddle.nn.Layer):
    """Linear -> GELU -> Linear; the first column-parallel, the second row-parallel on "mp"."""

    def __init__(self, mesh):
        super().__init__()
        paddle.seed(2024)
        self.fc1 = paddle.nn.Linear(IN, HIDDEN)
        self.fc2 = paddle.nn.Linear(HIDDEN, OUT)
        R, S = dist.Replicate(), dist.Shard
        self.fc1.weight = dist.shard_tensor(self.fc1.weight, mesh, [R, S(1)])
        self.fc1.bias = dist.shard_tensor(self.fc1.bias, mesh, [R, S(0)])
        self.fc2.weight = dist.shard_tensor(self.fc2.weight, mesh, [R, S(0)])

    def forward(self, x):
        return self.fc2(paddle.nn.functional.gelu(self.fc1(x)))


def build_layer():
    """Runs on every rank, once the process group exists."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    return MLP(mesh)


def make_data(batches, seed):
    """A regression task: y = sin(x @ w), w fixed, x random."""
    w = np.random.RandomState(0).randn(IN, OUT).astype("float32") / 6
    xs = np.random.RandomState(seed).randn(batches, BATCH, IN).astype("float32")
    return [(x, np.sin(x @ w)) for x in xs]


def make_optimizer(params, steps):
    """Runs on every rank: AdamW, warming up for a tenth of the steps, then a cosine decay."""
    lr = paddle.optimizer.lr
    warmup = max(1, steps // 10)
    schedule = lr.LinearWarmup(lr.CosineAnnealingDecay(1e-2, T_max=steps - warmup), warmup, 0.0, 1e-2)
    return paddle.optimizer.AdamW(schedule, parameters=params)


def main(steps: int = int(os.environ.get("QUICKSTART_STEPS", 100))):
    train, test = make_data(steps, seed=1), make_data(1, seed=2)[0]
    with raydist.to_static(
        build_layer,
        loss=paddle.nn.MSELoss(),
        optimizer=lambda params: make_optimizer(params, steps),
        num_workers=4,  # one Ray actor per rank; batches are split along "dp"
    ) as dm:
        bar = tqdm(train, desc="train", unit="step")
        for x, y in bar:
            loss = dm(x, y)  # the global batch; each dp group gets its half
            dm.lr_scheduler.step()  # every rank's schedule, from the next step on
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{dm.lr_scheduler.last_lr:.2e}")

        dm.eval()
        print(f"eval loss on held-out data: {dm(*test):.4f} (variance of the targets: {test[1].var():.4f})")
        dm.predict()
        out = dm(test[0])
        print(f"predict: output {out.shape}, first row {np.round(out[0], 3)}, target {np.round(test[1][0], 3)}")


if __name__ == "__main__":
    main()
