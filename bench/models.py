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


def build_layer(name: str):
    """The quickstart MLP on the benchmark's mesh (runs on every rank)."""
    import paddle.distributed as dist

    from examples.quickstart import MLP

    ids, dims = MODELS[name][:2]
    return MLP(dist.ProcessMesh(ids, dim_names=dims))


def data(name: str, steps: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    from examples.quickstart import IN, OUT

    batch = MODELS[name][2]
    rng = np.random.RandomState(seed)
    return [(rng.randn(batch, IN).astype("float32"), rng.randn(batch, OUT).astype("float32")) for _ in range(steps)]
