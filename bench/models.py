"""The models and data every benchmark runner uses, identically.

Ranks import this module (and examples/quickstart.py) from the repository:
the runners put its root on the ranks' PYTHONPATH.
"""

from __future__ import annotations

import numpy as np

# name: (kind, mesh process ids, mesh dim names, global batch, description)
MODELS = {
    "mlp-mp2": ("mlp", [[0, 1]], ["dp", "mp"], 32, "quickstart MLP 16-64-4, mp=2, 2 ranks"),
    "mlp-dp2xmp2": ("mlp", [[0, 1], [2, 3]], ["dp", "mp"], 32, "quickstart MLP 16-64-4, dp=2 x mp=2, 4 ranks"),
    # compute-bound: a step of about 90 ms on this machine's 2 cores
    "wide-mp2": ("wide", [[0, 1]], ["dp", "mp"], 128, "MLP 4 x (768-1536-768, residual), mp=2, 2 ranks"),
    "gpt-mp2": ("gpt", [[0, 1]], ["dp", "mp"], 8, "GPT 4 x (h256, 8 heads), seq 64, mp=2, 2 ranks"),
    "gpt-dp2xmp2": ("gpt", [[0, 1], [2, 3]], ["dp", "mp"], 8, "GPT 4 x (h256, 8 heads), seq 64, dp=2 x mp=2, 4 ranks"),
    "gpt-dp2": ("gpt", [[0], [1]], ["dp", "mp"], 8, "GPT 4 x (h256, 8 heads), seq 64, dp=2, 2 ranks"),
    # stages: blocks 0-1 (and the embeddings) on rank 0, blocks 2-3 (and the head) on rank 1
    "gpt-pp2": ("gpt", [[[0]], [[1]]], ["dp", "mp"], 8,
                "GPT 4 x (h256, 8 heads), seq 64, pp=2 (1F1B, 4 micro-batches), 2 ranks"),
}
PIPELINE = {"gpt-pp2": {"enable": True, "schedule_mode": "1F1B", "accumulate_steps": 4}}

IN, OUT = 16, 4  # the quickstart MLP's, without importing Paddle where rows are made
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 512, 256, 8, 4, 64
WIDE, WIDE_BLOCKS = 768, 4


def world_size(name: str) -> int:
    return int(np.asarray(MODELS[name][1]).size)


def batch_size(name: str) -> int:
    return MODELS[name][3]


def mesh(name: str):
    """The model's mesh; a pipeline's: one per stage."""
    import paddle.distributed as dist

    ids, dims = MODELS[name][1:3]
    if name in PIPELINE:
        return [dist.ProcessMesh(stage, dim_names=dims) for stage in ids]
    return dist.ProcessMesh(ids, dim_names=dims)


def strategy(name: str):
    """The model's Strategy (its pipeline section), or None."""
    import paddle.distributed as dist

    return dist.Strategy({"pipeline": PIPELINE[name]}) if name in PIPELINE else None


def build_layer(name: str, on=None):
    """The benchmark's model on its mesh, or the mesh ``on`` (runs on every rank)."""
    on = on if on is not None else mesh(name)
    if MODELS[name][0] == "mlp":
        import examples.quickstart as qs

        assert (qs.IN, qs.OUT) == (IN, OUT)
        return qs.MLP(on)
    if MODELS[name][0] == "wide":
        return Wide(on)
    return GPT(on)


def loss(name: str):
    import paddle

    if MODELS[name][0] in ("mlp", "wide"):
        return paddle.nn.MSELoss()
    return lambda logits, labels: paddle.nn.functional.cross_entropy(
        logits.reshape([-1, VOCAB]), labels.reshape([-1, 1])
    )


def rows(kind: str, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Rows ``ids`` of a kind's data: the same wherever they are made."""
    ids = np.asarray(ids, dtype=np.int64)
    if kind == "mlp":
        x = np.sin(np.outer(ids + 1, np.arange(1, IN + 1))).astype("float32")
        y = np.cos(np.outer(ids + 1, np.arange(1, OUT + 1))).astype("float32")
        return {"x": x, "y": y}
    if kind == "wide":
        x = np.sin(np.outer(ids + 1, np.arange(1, WIDE + 1)) / WIDE).astype("float32")
        return {"x": x, "y": np.cos(x)}
    tokens = (np.outer(ids + 1, np.arange(1, SEQ + 2)) * 7919) % VOCAB
    return {"x": tokens[:, :-1].astype("int64"), "y": tokens[:, 1:].astype("int64")}


def data(name: str, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` global batches, in order."""
    b, kind = batch_size(name), MODELS[name][0]
    return [(r["x"], r["y"]) for r in (rows(kind, np.arange(k * b, (k + 1) * b)) for k in range(steps))]


def _gpt_classes():
    import paddle
    import paddle.distributed as dist
    import paddle.nn.functional as F

    R, S = dist.Replicate(), dist.Shard

    def shard(layer, mesh, weight, bias=None):
        if mesh is None:  # one plain process: bench/reference.py
            return
        layer.weight = dist.shard_tensor(layer.weight, mesh, [R, weight])
        if bias is not None:
            layer.bias = dist.shard_tensor(layer.bias, mesh, [R, bias])

    class Block(paddle.nn.Layer):
        """Pre-LN attention + MLP; q, k, v and fc1 column-parallel, out and fc2 row-parallel on "mp"."""

        def __init__(self, mesh):
            super().__init__()
            self.ln1, self.ln2 = paddle.nn.LayerNorm(HIDDEN), paddle.nn.LayerNorm(HIDDEN)
            self.q, self.k, self.v = (paddle.nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
            self.out = paddle.nn.Linear(HIDDEN, HIDDEN)
            self.fc1, self.fc2 = paddle.nn.Linear(HIDDEN, 4 * HIDDEN), paddle.nn.Linear(4 * HIDDEN, HIDDEN)
            for layer in (self.q, self.k, self.v, self.fc1):
                shard(layer, mesh, S(1), S(0))
            for layer in (self.out, self.fc2):
                shard(layer, mesh, S(0))

        def forward(self, x, mask):
            head = HIDDEN // HEADS

            def heads(t):
                return t.reshape([0, 0, HEADS, head]).transpose([0, 2, 1, 3])

            y = self.ln1(x)
            q, k, v = heads(self.q(y)), heads(self.k(y)), heads(self.v(y))
            att = F.softmax(paddle.matmul(q, k, transpose_y=True) / head**0.5 + mask, axis=-1)
            y = paddle.matmul(att, v).transpose([0, 2, 1, 3]).reshape([0, 0, HIDDEN])
            x = x + self.out(y)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(paddle.nn.Layer):
        """``mesh``: one mesh, or a list of stage meshes (the blocks split evenly over them;
        the embeddings on the first, the head on the last)."""

        def __init__(self, mesh):
            super().__init__()
            paddle.seed(2024)
            self.stages = mesh if isinstance(mesh, list) else None
            stage = [mesh] * LAYERS if self.stages is None else \
                [self.stages[i * len(self.stages) // LAYERS] for i in range(LAYERS)]
            self.embed = paddle.nn.Embedding(VOCAB, HIDDEN)
            self.pos = paddle.nn.Embedding(SEQ, HIDDEN)
            self.blocks = paddle.nn.LayerList([Block(stage[i]) for i in range(LAYERS)])
            self.ln = paddle.nn.LayerNorm(HIDDEN)
            self.head = paddle.nn.Linear(HIDDEN, VOCAB)
            self.where = stage
            if self.stages is not None:
                first, last = self.stages[0], self.stages[-1]
                for layer, on in ((self.embed, first), (self.pos, first), (self.ln, last), (self.head, last)):
                    for attr in ("weight", "bias"):
                        if getattr(layer, attr, None) is not None:
                            setattr(layer, attr, dist.shard_tensor(getattr(layer, attr), on, [R, R]))

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos(paddle.arange(SEQ))
            mask = paddle.triu(paddle.full([SEQ, SEQ], -1e9, "float32"), 1)
            for i, block in enumerate(self.blocks):
                if self.stages is not None and (i == 0 or self.where[i] is not self.where[i - 1]):
                    x = dist.reshard(x, self.where[i], [R, R])
                    mask = dist.reshard(mask, self.where[i], [R, R]) if i else mask
                x = block(x, mask)
            if self.stages is not None:
                x = dist.reshard(x, self.stages[-1], [R, R])
            return self.head(self.ln(x))

    return GPT


def Wide(mesh):
    """``WIDE_BLOCKS`` residual blocks Linear(768, 1536) -> GELU -> Linear(1536, 768), the first
    column-parallel and the second row-parallel on "mp" (``mesh`` None: one plain process)."""
    import paddle
    import paddle.distributed as dist

    R, S = dist.Replicate(), dist.Shard

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = paddle.nn.Linear(WIDE, 2 * WIDE), paddle.nn.Linear(2 * WIDE, WIDE)
            if mesh is not None:
                self.fc1.weight = dist.shard_tensor(self.fc1.weight, mesh, [R, S(1)])
                self.fc1.bias = dist.shard_tensor(self.fc1.bias, mesh, [R, S(0)])
                self.fc2.weight = dist.shard_tensor(self.fc2.weight, mesh, [R, S(0)])

        def forward(self, x):
            return x + self.fc2(paddle.nn.functional.gelu(self.fc1(x)))

    paddle.seed(2024)
    return paddle.nn.Sequential(*[Block() for _ in range(WIDE_BLOCKS)])


def GPT(mesh):
    return _gpt_classes()(mesh)
