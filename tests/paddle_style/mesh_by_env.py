"""A data x tensor parallel MLP configured as Paddle's own auto-parallel tests are: by the
environment its launcher passes (Paddle's semi_auto_llama.py reads dp, mp, acc_step so).
dp x mp ranks, dynamic semi-auto parallel; rank 0 prints the configuration it runs and each
step's loss. The model and the data are those of tests/models.py (MLP, batches), rebuilt here
so that the script stands alone."""

import os

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import Replicate, Shard

DP, MP, STEPS = int(os.getenv("dp", "2")), int(os.getenv("mp", "1")), int(os.getenv("steps", "3"))
IN, HIDDEN, OUT = 12, 24, 6


class MLP(paddle.nn.Layer):
    def __init__(self, mesh):
        super().__init__()
        self.fc1, self.fc2 = paddle.nn.Linear(IN, HIDDEN), paddle.nn.Linear(HIDDEN, OUT)
        rng = np.random.RandomState(0)
        split = {"fc1.weight": Shard(1), "fc1.bias": Shard(0), "fc2.weight": Shard(0)}  # column, then row parallel
        for name, shape in (("fc1.weight", (IN, HIDDEN)), ("fc1.bias", (HIDDEN,)), ("fc2.weight", (HIDDEN, OUT)),
                            ("fc2.bias", (OUT,))):  # fmt: skip
            layer, attr = name.split(".")
            param = getattr(getattr(self, layer), attr)
            param.set_value((rng.randn(*shape) * 0.3).astype("float32"))
            setattr(getattr(self, layer), attr, dist.shard_tensor(param, mesh, [Replicate(), split.get(name, Replicate())]))

    def forward(self, x):
        return self.fc2(paddle.tanh(self.fc1(x)))


def main():
    dist.init_parallel_env()
    assert dist.get_world_size() == DP * MP, f"dp {DP} x mp {MP} needs {DP * MP} ranks, not {dist.get_world_size()}"
    mesh = dist.ProcessMesh(np.arange(DP * MP).reshape(DP, MP).tolist(), dim_names=["dp", "mp"])
    model = MLP(mesh)
    opt = paddle.optimizer.SGD(0.05, parameters=model.parameters())
    rng = np.random.RandomState(1)
    if dist.get_rank() == 0:
        print(f"config dp {DP} mp {MP} on {dist.get_world_size()} ranks", flush=True)
    for step in range(STEPS):
        x, y = rng.randn(8, IN).astype("float32"), rng.randn(8, OUT).astype("float32")
        x = dist.shard_tensor(paddle.to_tensor(x), mesh, [Shard(0), Replicate()])
        y = dist.shard_tensor(paddle.to_tensor(y), mesh, [Shard(0), Replicate()])
        loss = paddle.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        value = float(dist.reshard(loss, mesh, [Replicate(), Replicate()]).numpy())
        if dist.get_rank() == 0:
            print(f"loss {step} {value:.8f}", flush=True)


if __name__ == "__main__":
    main()
