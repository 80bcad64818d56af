"""The models and data every benchmark runner uses, identically.

Ranks import this module (and examples/quickstart.py) from the repository:
the runners put its root on the ranks' PYTHONPATH.
"""

from __future__ import annotations

import numpy as np

# name: (mesh process ids, mesh dim names, global batch, description)
MODELS = {
    "mlp-dp2xmp2": ([[0, 1], [2, 3]], ["dp", "mp"], 32, "quickstart MLP 16-64-4, dp=2 x mp=2, 4 ranks"),
    "mlp-mp2": ([[0, 1]], ["dp", "mp"], 32, "quickstart MLP 16-64-4, mp=2, 2 ranks"),
}


def world_size(name: str) -> int:
    return int(np.asarray(MODELS[name][0]).size)


def batch_size(name: str) -> int:
    return MODELS[name][2]


def mesh(name: str):
    import paddle.distributed as dist

    ids, dims = MODELS[name][:2]
    return dist.ProcessMesh(ids, dim_names=dims)


IN, OUT = 16, 4  # the quickstart MLP's, without importing Paddle where rows are made


def build_layer(name: str):
    """The quickstart MLP on the benchmark's mesh (runs on every rank)."""
    import examples.quickstart as qs

    assert (qs.IN, qs.OUT) == (IN, OUT)
    return qs.MLP(mesh(name))


def rows(ids: np.ndarray) -> dict[str, np.ndarray]:
    """Row ``i`` of the benchmark data, for every id: the same wherever it is made."""
    ids = np.asarray(ids, dtype=np.int64)
    x = np.sin(np.outer(ids + 1, np.arange(1, IN + 1))).astype("float32")
    y = np.cos(np.outer(ids + 1, np.arange(1, OUT + 1))).astype("float32")
    return {"x": x, "y": y}


def data(name: str, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` global batches, in order."""
    b = batch_size(name)
    return [(r["x"], r["y"]) for r in (rows(np.arange(k * b, (k + 1) * b)) for k in range(steps))]
