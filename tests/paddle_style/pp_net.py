"""The models and data of the pipeline scripts here, written as Paddle's own auto-parallel tests write
them (a two-stage demo net with ``dist.reshard`` between its stages, a random dataset): the scripts
import it, and tests/test_launch_pipelines.py builds the same models through raydist's driver path
and in one plain process."""

import numpy as np
import paddle
import paddle.distributed as dist

IN, HIDDEN, OUT = 8, 16, 4
BATCH, STEPS = 8, 4


class RandomDataset(paddle.io.Dataset):
    def __init__(self, num_samples=BATCH * STEPS, seed=2024):
        rng = np.random.RandomState(seed)
        self.x = rng.rand(num_samples, IN).astype("float32")
        self.y = rng.rand(num_samples, OUT).astype("float32")

    def __getitem__(self, idx):
        return self.x[idx], self.y[idx]

    def __len__(self):
        return len(self.x)


def _init(layer, seed):
    rng = np.random.RandomState(seed)
    for p in layer.parameters():
        p.set_value((rng.randn(*p.shape) * 0.3).astype("float32"))


class PPDemoNet(paddle.nn.Layer):
    """linear0 -> relu on stage 0, linear1 on stage 1 (no meshes: one process)."""

    def __init__(self, mesh0=None, mesh1=None, seed=0):
        super().__init__()
        self.mesh1 = mesh1
        self.linear0 = paddle.nn.Linear(IN, HIDDEN)
        self.linear1 = paddle.nn.Linear(HIDDEN, OUT)
        _init(self, seed)
        if mesh0 is not None:
            for layer, mesh in ((self.linear0, mesh0), (self.linear1, mesh1)):
                placements = [dist.Replicate() for _ in mesh.dim_names]
                layer.weight = dist.shard_tensor(layer.weight, mesh, placements)
                layer.bias = dist.shard_tensor(layer.bias, mesh, placements)

    def forward(self, x):
        out = paddle.nn.functional.relu(self.linear0(x))
        if self.mesh1 is not None:
            out = dist.reshard(out, self.mesh1, [dist.Shard(0) if d == "dp" else dist.Replicate()
                                                 for d in self.mesh1.dim_names])
        return self.linear1(out)


def loader(shuffle=False):
    return paddle.io.DataLoader(RandomDataset(), batch_size=BATCH, shuffle=shuffle, drop_last=True)


class Block(paddle.nn.Layer):
    """Linear -> relu -> dropout: one segment of a VPP model (``vpp_seg_method="Block"``)."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.linear = paddle.nn.Linear(HIDDEN, HIDDEN)
        self.dropout = paddle.nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(paddle.nn.functional.relu(self.linear(x)))


class VPPDemoNet(paddle.nn.Layer):
    """An input Linear, four Blocks (block i on ``meshes[place[i]]``), then a LayerNorm and a last Linear
    on no mesh of their own, as Paddle's VPP tests build them."""

    def __init__(self, meshes=None, place=(0, 1, 0, 1), seed=0):
        super().__init__()
        self.meshes, self.place = meshes, place
        self.embed = paddle.nn.Linear(IN, HIDDEN)
        self.blocks = paddle.nn.LayerList([Block() for _ in place])
        self.norm = paddle.nn.LayerNorm(HIDDEN)
        self.head = paddle.nn.Linear(HIDDEN, OUT)
        _init(self, seed)
        if meshes is not None:
            for layer, mesh in [(self.embed, meshes[0])] + [(b.linear, meshes[p]) for b, p in zip(self.blocks, place)]:
                layer.weight = dist.shard_tensor(layer.weight, mesh, [dist.Replicate()])
                layer.bias = dist.shard_tensor(layer.bias, mesh, [dist.Replicate()])

    def forward(self, x):
        x = self.embed(x)
        for block, p in zip(self.blocks, self.place):
            if self.meshes is not None:
                x = dist.reshard(x, self.meshes[p], [dist.Replicate()])
            x = block(x)
        return self.head(self.norm(x))


def pipeline_strategy(schedule_mode, **extra):
    strategy = dist.Strategy()
    strategy.pipeline.enable = True
    strategy.pipeline.schedule_mode = schedule_mode
    strategy.pipeline.accumulate_steps = 2
    for key, value in extra.items():
        setattr(strategy.pipeline, key, value)
    return strategy


def train_and_print(model, opt, dist_loader, strategy, label, holders):
    """One epoch of ``dist.to_static(...)`` training; the ranks in ``holders`` (the last stage's, which
    hold the loss) print each step's loss, the mean of its micro-batches' losses."""
    dist_model = dist.to_static(model, dist_loader, paddle.nn.MSELoss(), opt, strategy=strategy)
    dist_model.train()
    losses = []
    for x, y in dist_loader():
        loss = dist_model(x, y)
        if dist.get_rank() in holders:
            losses.append(float(np.mean(loss)))  # one loss per micro-batch
    if losses:
        print(label, "losses", " ".join(f"{v:.7f}" for v in losses), flush=True)
    return losses
