"""The models and data every benchmark runner uses, identically.

Ranks import this module (and examples/quickstart.py) from the repository:
the runners put its root on the ranks' PYTHONPATH.
"""

from __future__ import annotations

from typing import NamedTuple

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
# real model blocks at the size of a small step: what a model's shape costs per step (bench paired)
MODELS.update({
    "block-mp2": ("block", [[0, 1]], ["dp", "mp"], 32,
                  "transformer MLP block 64-256-64 (GELU, residual), mp=2, 2 ranks"),
    "gptblock-mp2": ("gptblock", [[0, 1]], ["dp", "mp"], 8,
                     "GPT 1 x (h64, 4 heads), seq 32, vocab 128, mp=2, 2 ranks"),
    "llama-dp2xmp2": ("llama", [[0, 1], [2, 3]], ["dp", "mp"], 4,
                      "tiny LLaMA 2 x (h8, 2 heads, SwiGLU 32, RoPE, RMSNorm), seq 16, vocab 320, "
                      "dp=2 x mp=2, 4 ranks"),
})  # fmt: skip
PIPELINE = {"gpt-pp2": {"enable": True, "schedule_mode": "1F1B", "accumulate_steps": 4}}

IN, OUT = 16, 4  # the quickstart MLP's, without importing Paddle where rows are made
WIDE, WIDE_BLOCKS = 768, 4
BLOCK, BLOCK_HIDDEN = 64, 256


class Shape(NamedTuple):
    """A token model's sizes."""

    vocab: int
    hidden: int
    heads: int
    layers: int
    seq: int
    inner: int = 0  # the MLP's width (LLaMA's intermediate size); 0: 4 x hidden


SHAPES = {
    "gpt": Shape(vocab=512, hidden=256, heads=8, layers=4, seq=64),
    "gptblock": Shape(vocab=128, hidden=64, heads=4, layers=1, seq=32),
    # the shape of the tiny LLaMA in Paddle's auto-parallel tests (semi_auto_parallel_llama_model.py)
    "llama": Shape(vocab=320, hidden=8, heads=2, layers=2, seq=16, inner=32),
}
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = SHAPES["gpt"][:5]


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
    return _BUILDERS[MODELS[name][0]](on)


def plain_layer(name: str):
    """The benchmark's model in one plain process, unsharded (bench/reference.py). The
    quickstart's MLP always shards: it goes on a one-process mesh; its parameters start as on
    any mesh, since the layers are made, then sharded."""
    import paddle.distributed as dist

    if MODELS[name][0] == "mlp":
        return build_layer(name, dist.ProcessMesh([[0]], dim_names=MODELS[name][2]))
    return _BUILDERS[MODELS[name][0]](None)


def loss(name: str):
    import paddle

    kind = MODELS[name][0]
    if kind not in SHAPES:
        return paddle.nn.MSELoss()
    vocab = SHAPES[kind].vocab
    return lambda logits, labels: paddle.nn.functional.cross_entropy(
        logits.reshape([-1, vocab]), labels.reshape([-1, 1])
    )


def rows(kind: str, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Rows ``ids`` of a kind's data: the same wherever they are made."""
    ids = np.asarray(ids, dtype=np.int64)
    if kind == "mlp":
        x = np.sin(np.outer(ids + 1, np.arange(1, IN + 1))).astype("float32")
        y = np.cos(np.outer(ids + 1, np.arange(1, OUT + 1))).astype("float32")
        return {"x": x, "y": y}
    if kind in ("wide", "block"):
        width = WIDE if kind == "wide" else BLOCK
        x = np.sin(np.outer(ids + 1, np.arange(1, width + 1)) / width).astype("float32")
        return {"x": x, "y": np.cos(x)}
    shape = SHAPES[kind]
    tokens = (np.outer(ids + 1, np.arange(1, shape.seq + 2)) * 7919) % shape.vocab
    return {"x": tokens[:, :-1].astype("int64"), "y": tokens[:, 1:].astype("int64")}


def data(name: str, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` global batches, in order."""
    b, kind = batch_size(name), MODELS[name][0]
    return [(r["x"], r["y"]) for r in (rows(kind, np.arange(k * b, (k + 1) * b)) for k in range(steps))]


def _shard(layer, mesh, weight, bias=None) -> None:
    """Shard ``layer``'s weight (and bias) along "mp" (``mesh`` None: one plain process, unsharded)."""
    import paddle.distributed as dist

    if mesh is None:
        return
    layer.weight = dist.shard_tensor(layer.weight, mesh, [dist.Replicate(), weight])
    if bias is not None:
        layer.bias = dist.shard_tensor(layer.bias, mesh, [dist.Replicate(), bias])


def _column(layer, mesh) -> None:
    import paddle.distributed as dist

    _shard(layer, mesh, dist.Shard(1), dist.Shard(0) if layer.bias is not None else None)


def _row(layer, mesh) -> None:
    import paddle.distributed as dist

    _shard(layer, mesh, dist.Shard(0))


def GPT(mesh, shape: Shape = SHAPES["gpt"]):
    """A GPT of ``shape``. ``mesh``: one mesh, or a list of stage meshes (the blocks split evenly
    over them; the embeddings on the first, the head on the last); None: one plain process."""
    import paddle
    import paddle.distributed as dist
    import paddle.nn.functional as F

    R = dist.Replicate()
    hidden, heads = shape.hidden, shape.heads

    class Block(paddle.nn.Layer):
        """Pre-LN attention + MLP; q, k, v and fc1 column-parallel, out and fc2 row-parallel on "mp"."""

        def __init__(self, mesh):
            super().__init__()
            self.ln1, self.ln2 = paddle.nn.LayerNorm(hidden), paddle.nn.LayerNorm(hidden)
            self.q, self.k, self.v = (paddle.nn.Linear(hidden, hidden) for _ in range(3))
            self.out = paddle.nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = paddle.nn.Linear(hidden, 4 * hidden), paddle.nn.Linear(4 * hidden, hidden)
            for layer in (self.q, self.k, self.v, self.fc1):
                _column(layer, mesh)
            for layer in (self.out, self.fc2):
                _row(layer, mesh)

        def forward(self, x, mask):
            head = hidden // heads

            def split(t):
                return t.reshape([0, 0, heads, head]).transpose([0, 2, 1, 3])

            y = self.ln1(x)
            q, k, v = split(self.q(y)), split(self.k(y)), split(self.v(y))
            att = F.softmax(paddle.matmul(q, k, transpose_y=True) / head**0.5 + mask, axis=-1)
            y = paddle.matmul(att, v).transpose([0, 2, 1, 3]).reshape([0, 0, hidden])
            x = x + self.out(y)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Model(paddle.nn.Layer):
        def __init__(self, mesh):
            super().__init__()
            paddle.seed(2024)
            self.stages = mesh if isinstance(mesh, list) else None
            layers = shape.layers
            stage = [mesh] * layers if self.stages is None else \
                [self.stages[i * len(self.stages) // layers] for i in range(layers)]
            self.embed = paddle.nn.Embedding(shape.vocab, hidden)
            self.pos = paddle.nn.Embedding(shape.seq, hidden)
            self.blocks = paddle.nn.LayerList([Block(stage[i]) for i in range(layers)])
            self.ln = paddle.nn.LayerNorm(hidden)
            self.head = paddle.nn.Linear(hidden, shape.vocab)
            self.where = stage
            if self.stages is not None:
                first, last = self.stages[0], self.stages[-1]
                for layer, on in ((self.embed, first), (self.pos, first), (self.ln, last), (self.head, last)):
                    for attr in ("weight", "bias"):
                        if getattr(layer, attr, None) is not None:
                            setattr(layer, attr, dist.shard_tensor(getattr(layer, attr), on, [R, R]))

        def forward(self, tokens):
            seq = shape.seq
            x = self.embed(tokens) + self.pos(paddle.arange(seq))
            mask = paddle.triu(paddle.full([seq, seq], -1e9, "float32"), 1)
            for i, block in enumerate(self.blocks):
                if self.stages is not None and (i == 0 or self.where[i] is not self.where[i - 1]):
                    x = dist.reshard(x, self.where[i], [R, R])
                    mask = dist.reshard(mask, self.where[i], [R, R]) if i else mask
                x = block(x, mask)
            if self.stages is not None:
                x = dist.reshard(x, self.stages[-1], [R, R])
            return self.head(self.ln(x))

    return Model(mesh)


def Wide(mesh):
    """``WIDE_BLOCKS`` residual blocks Linear(768, 1536) -> GELU -> Linear(1536, 768), the first
    column-parallel and the second row-parallel on "mp" (``mesh`` None: one plain process)."""
    import paddle

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = paddle.nn.Linear(WIDE, 2 * WIDE), paddle.nn.Linear(2 * WIDE, WIDE)
            _column(self.fc1, mesh)
            _row(self.fc2, mesh)

        def forward(self, x):
            return x + self.fc2(paddle.nn.functional.gelu(self.fc1(x)))

    paddle.seed(2024)
    return paddle.nn.Sequential(*[Block() for _ in range(WIDE_BLOCKS)])


def MLPBlock(mesh):
    """A transformer's MLP block: Linear(64, 256) column-parallel, GELU, Linear(256, 64)
    row-parallel, a residual add (``mesh`` None: one plain process)."""
    import paddle

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            paddle.seed(2024)
            self.fc1, self.fc2 = paddle.nn.Linear(BLOCK, BLOCK_HIDDEN), paddle.nn.Linear(BLOCK_HIDDEN, BLOCK)
            _column(self.fc1, mesh)
            _row(self.fc2, mesh)

        def forward(self, x):
            return x + self.fc2(paddle.nn.functional.gelu(self.fc1(x)))

    return Block()


def LLaMA(mesh, shape: Shape = SHAPES["llama"]):
    """A LLaMA of ``shape``, laid out as Paddle's auto-parallel LLaMA tests lay out theirs
    (``LlamaForCausalLMAuto``): the embedding split along hidden, q/k/v and gate/up
    column-parallel, o and down row-parallel, the head column-parallel (vocab) on "mp";
    RMSNorm, rotary position embeddings, a causal mask, SwiGLU; no biases."""
    import paddle
    import paddle.nn.functional as F

    hidden, heads, head = shape.hidden, shape.heads, shape.hidden // shape.heads

    def linear(n_in, n_out, split):
        layer = paddle.nn.Linear(n_in, n_out, bias_attr=False)
        split(layer, mesh)
        return layer

    class RMSNorm(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.weight = self.create_parameter([hidden], default_initializer=paddle.nn.initializer.Constant(1.0))

        def forward(self, x):
            return x * paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    def rotate(x, cos, sin):  # x: [batch, seq, heads, head]
        half = head // 2
        return x * cos + paddle.concat([-x[..., half:], x[..., :half]], axis=-1) * sin

    class Decoder(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = RMSNorm(), RMSNorm()
            self.q, self.k, self.v = (linear(hidden, hidden, _column) for _ in range(3))
            self.o = linear(hidden, hidden, _row)
            self.gate, self.up = linear(hidden, shape.inner, _column), linear(hidden, shape.inner, _column)
            self.down = linear(shape.inner, hidden, _row)

        def forward(self, x, cos, sin, mask):
            y = self.norm1(x)
            q, k, v = (t.reshape([0, 0, heads, head]) for t in (self.q(y), self.k(y), self.v(y)))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
            att = F.softmax(paddle.matmul(q, k, transpose_y=True) / head**0.5 + mask, axis=-1)
            x = x + self.o(paddle.matmul(att, v).transpose([0, 2, 1, 3]).reshape([0, 0, hidden]))
            y = self.norm2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Model(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            paddle.seed(2024)
            self.embed = paddle.nn.Embedding(shape.vocab, hidden)
            _shard(self.embed, mesh, paddle.distributed.Shard(1))
            self.layers = paddle.nn.LayerList([Decoder() for _ in range(shape.layers)])
            self.norm = RMSNorm()
            self.head = linear(hidden, shape.vocab, _column)

        def forward(self, tokens):
            seq = shape.seq
            inv = 1.0 / 10000 ** (paddle.arange(0, head, 2, dtype="float32") / head)
            angles = paddle.arange(seq, dtype="float32").unsqueeze(1) * inv.unsqueeze(0)
            angles = paddle.concat([angles, angles], axis=-1).reshape([1, seq, 1, head])
            cos, sin = angles.cos(), angles.sin()
            mask = paddle.triu(paddle.full([seq, seq], -1e9, "float32"), 1)
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x, cos, sin, mask)
            return self.head(self.norm(x))

    return Model()


_BUILDERS = {
    "wide": Wide,
    "block": MLPBlock,
    "gpt": GPT,
    "gptblock": lambda mesh: GPT(mesh, SHAPES["gptblock"]),
    "llama": LLaMA,
}
