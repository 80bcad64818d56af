"""Small models for the tests, and the single-process reference they are held to.

Every distributed run in the tests is compared with `reference`: the same
model trained in this one plain process (dygraph, no distribution) on the
same global batches.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import Replicate, Shard

IN, HIDDEN, OUT = 12, 24, 6


def init_values(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    shapes = {"fc1.weight": (IN, HIDDEN), "fc1.bias": (HIDDEN,), "fc2.weight": (HIDDEN, OUT), "fc2.bias": (OUT,)}
    return {k: (rng.randn(*s) * 0.3).astype("float32") for k, s in shapes.items()}


# placements per parameter, by mesh dim name: "col"/"row" tensor parallel on "mp"
def _placements(mesh_dims: list[str], name: str, tp: bool) -> list:
    out = []
    for d in mesh_dims:
        if d == "mp" and tp:
            out.append({"fc1.weight": Shard(1), "fc1.bias": Shard(0), "fc2.weight": Shard(0)}.get(name, Replicate()))
        else:
            out.append(Replicate())
    return out


class MLP(paddle.nn.Layer):
    """Linear(12, 24) -> tanh -> Linear(24, 6); column- then row-parallel on a "mp" mesh dim."""

    def __init__(self, mesh: dist.ProcessMesh | None = None, tp: bool = True, seed: int = 0, fail_on_rank=None):
        super().__init__()
        self.fc1 = paddle.nn.Linear(IN, HIDDEN)
        self.fc2 = paddle.nn.Linear(HIDDEN, OUT)
        self.fail_on_rank = fail_on_rank
        for name, value in init_values(seed).items():
            layer, attr = name.split(".")
            param = getattr(getattr(self, layer), attr)
            param.set_value(value)
            if mesh is not None:
                sharded = dist.shard_tensor(param, mesh, _placements(mesh.dim_names, name, tp))
                setattr(getattr(self, layer), attr, sharded)

    def forward(self, x):
        if self.fail_on_rank is not None and dist.get_rank() == self.fail_on_rank:
            raise RuntimeError(f"forward fails on rank {self.fail_on_rank} on purpose")
        return self.fc2(paddle.tanh(self.fc1(x)))


def build(kind: str, **kwargs):
    """A build_layer for raydist: "one" on 1 rank, "dp" and "mp" on 2, "dpmp" on 4; "elastic":
    dp x mp2 on any even number of ranks (the mesh made from the world size)."""

    def build_layer():
        if kind == "dp":
            return MLP(dist.ProcessMesh([0, 1], dim_names=["dp"]), **kwargs)
        if kind == "mp":
            return MLP(dist.ProcessMesh([0, 1], dim_names=["mp"]), **kwargs)
        if kind == "dpmp":
            return MLP(dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]), **kwargs)
        if kind == "one":
            return MLP(dist.ProcessMesh([0], dim_names=["mp"]), **kwargs)
        if kind == "elastic":  # dp x mp2 over whatever world the ranks find
            ranks = np.arange(dist.get_world_size()).reshape(-1, 2)
            return MLP(dist.ProcessMesh(ranks.tolist(), dim_names=["dp", "mp"]), **kwargs)
        raise ValueError(kind)

    return build_layer


def sgd(lr: float = 0.05):
    return lambda params: paddle.optimizer.SGD(lr, parameters=params)


def adamw(lr: float = 0.01):
    return lambda params: paddle.optimizer.AdamW(lr, parameters=params, weight_decay=0.01)


def batches(n: int, batch: int = 8, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.RandomState(seed)
    return [(rng.randn(batch, IN).astype("float32"), rng.randn(batch, OUT).astype("float32")) for _ in range(n)]


class Block(paddle.nn.Layer):
    """Linear -> tanh: one pipeline segment (``vpp_seg_method="Block"``)."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.fc = paddle.nn.Linear(width_in, width_out)

    def forward(self, x):
        return paddle.tanh(self.fc(x))


class Chain(paddle.nn.Layer):
    """Blocks from IN to OUT features; block i on ``stages[i % len(stages)]`` (pipeline stages:
    activations cross with ``dist.reshard``, as Paddle's docs build them; more blocks than
    stages: VPP's chunks). Parameters are replicated on each stage's mesh, activations split
    along its "dp" dim if it has one."""

    def __init__(self, stages: list | None = None, blocks: int = 2, seed: int = 0):
        super().__init__()
        widths = [IN] + [HIDDEN] * (blocks - 1) + [OUT]
        self.blocks = paddle.nn.LayerList([Block(a, b) for a, b in zip(widths, widths[1:])])
        self.stages = stages
        rng = np.random.RandomState(seed)
        for i, block in enumerate(self.blocks):
            for attr in ("weight", "bias"):
                param = getattr(block.fc, attr)
                param.set_value((rng.randn(*param.shape) * 0.3).astype("float32"))
                if stages:  # column-parallel along a stage's "mp" dim
                    mesh = stages[i % len(stages)]
                    split = Shard(1 if attr == "weight" else 0)
                    placements = [split if d == "mp" else Replicate() for d in mesh.dim_names]
                    setattr(block.fc, attr, dist.shard_tensor(param, mesh, placements))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if self.stages:  # rows stay split over a stage's "dp" ranks, whole on its "mp" ranks
                mesh = self.stages[i % len(self.stages)]
                x = dist.reshard(x, mesh, [Shard(0) if d == "dp" else Replicate() for d in mesh.dim_names])
            x = block(x)
        return x


def build_chain(stages: list[list], blocks: int | None = None, dim: str = "dp"):
    """A build_layer for raydist: `Chain` on stages of the given ranks (each a list; a stage of
    several ranks splits along ``dim``: "dp" or "mp")."""

    def build_layer():
        meshes = [dist.ProcessMesh(ranks, dim_names=[dim if len(ranks) > 1 else "pp"]) for ranks in stages]
        return Chain(meshes, blocks or len(stages))

    return build_layer


class Reference:
    """The same model in this one plain process: the numbers raydist must match."""

    def __init__(self, optimizer=None, seed: int = 0, net: paddle.nn.Layer | None = None):
        self.net = net if net is not None else MLP(seed=seed)
        self.opt = optimizer(self.net.parameters()) if optimizer else None
        self.loss_fn = paddle.nn.MSELoss()

    def train(self, x, y) -> float:
        loss = self.loss_fn(self.net(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        self.opt.step()
        self.opt.clear_grad()
        return float(loss)

    def eval(self, x, y) -> float:
        with paddle.no_grad():
            return float(self.loss_fn(self.net(paddle.to_tensor(x)), paddle.to_tensor(y)))

    def predict(self, x) -> np.ndarray:
        with paddle.no_grad():
            return self.net(paddle.to_tensor(x)).numpy()

    def params(self) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in self.net.state_dict().items()}


def assert_close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6, what: str = "") -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol, err_msg=what)

def assert_params_equal(params, expected: dict, **tolerance) -> None:
    """Every parameter of ``expected`` (a reference's ``params()``: one plain process) in ``params``
    (a model's ``state_dict("param")``, or any mapping of arrays), within float32 rounding."""
    for name, value in expected.items():
        assert_close(params[name], value, what=name, **tolerance)


class Rows(paddle.io.Dataset):
    """``n`` rows {"x", "y"} of the MLP's shapes, the same in every process."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.RandomState(seed)
        self.x, self.y = rng.randn(n, IN).astype("float32"), rng.randn(n, OUT).astype("float32")

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}

    def __len__(self) -> int:
        return len(self.x)


def global_batches(dataset: Rows, batch_size: int, shards: int, epoch: int, shuffle: bool = False,
                   seed: int | None = None):  # fmt: skip
    """The global batches of one epoch as raydist's loader reads a paddle dataset in ``shards``
    data shards (Paddle's DistributedBatchSampler, one per shard): shard by shard, in order. With a
    ``seed``, epoch ``epoch`` is shuffled by its own stream of numpy's SeedSequence([seed, epoch]), as
    raydist documents its loader's shuffle (written here, not taken from raydist)."""
    from paddle.io import DistributedBatchSampler

    order = epoch if seed is None else int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])
    per_shard = []
    for s in range(shards):
        sampler = DistributedBatchSampler(dataset, batch_size=batch_size // shards, num_replicas=shards, rank=s,
                                          shuffle=shuffle, drop_last=True)  # fmt: skip
        sampler.set_epoch(order)
        per_shard.append(list(sampler))
    return [np.concatenate([dataset.x[ids] for ids in step]) for step in zip(*per_shard)], \
        [np.concatenate([dataset.y[ids] for ids in step]) for step in zip(*per_shard)]


def assert_fit_like_one_process(losses, params, dataset: Rows, batch_size: int, shards: int, epochs: int,
                                optimizer, shuffle: bool = False, seed: int | None = None) -> None:  # fmt: skip
    """``fit``'s losses and final parameters equal one plain process over the loader's global batches."""
    ref, expected = Reference(optimizer), []
    for epoch in range(epochs):
        for x, y in zip(*global_batches(dataset, batch_size, shards, epoch, shuffle, seed)):
            expected.append(ref.train(x, y))
    assert_close(losses, expected)
    assert_params_equal(params, ref.params())
