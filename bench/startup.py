"""Where a model's start goes: a model (the quickstart MLP on mp2 unless ``--models``) fed by a
loader, phase by phase.

    python -m bench startup [--repeat 2] [--models gpt-mp2]

Times, from the loader's creation: the ranks' placement and start (``spawn``), the
rendezvous and Paddle's import and join (``join``), the layer and first program's
build (``build``), and the first step, its data included (``first step``). The first
model of a run starts on a Ray whose worker pool is cold; later ones show the steady
cost.
"""

from __future__ import annotations

import time

from raydist.driver.cluster import group as group_module


def startup_table(repeat: int, name: str = "mlp-mp2") -> str:
    import paddle
    import ray

    import raydist
    from bench import models
    from bench.common import RANK_ENV

    rows, kind, size = [], models.MODELS[name][0], models.batch_size(name)
    for run in range(repeat):
        ds = ray.data.range(70 * size).map_batches(lambda b: models.rows(kind, b["id"]),
                                                   runtime_env=RANK_ENV).materialize()  # fmt: skip
        marks = {}
        rendezvous = group_module.RankGroup._rendezvous

        def timed_rendezvous(self, port):
            marks["spawned"] = time.time()
            rendezvous(self, port)
            marks["joined"] = time.time()

        start = time.time()
        loader = raydist.shard_dataloader(ds, models.mesh(name), input_keys=["x", "y"], shard_dims="dp",
                                          batch_size=size)  # fmt: skip
        group_module.RankGroup._rendezvous = timed_rendezvous
        try:
            dm = raydist.to_static(lambda: models.build_layer(name), loader, models.loss(name),
                                   lambda p: paddle.optimizer.AdamW(1e-3, parameters=p),
                                   num_workers=models.world_size(name), strategy=models.strategy(name),
                                   runtime_env=RANK_ENV)  # fmt: skip
        finally:
            group_module.RankGroup._rendezvous = rendezvous
        built = time.time()
        batch = next(iter(loader()))
        float(dm(batch["x"], batch["y"]))
        first = time.time()
        dm.shutdown()
        rows.append(f"| {run + 1} | {marks['spawned'] - start:.2f} | {marks['joined'] - marks['spawned']:.2f} "
                    f"| {built - marks['joined']:.2f} | {first - built:.2f} | {first - start:.2f} |")  # fmt: skip
        print(rows[-1], flush=True)
    header = f"| {name}: model of the run | spawn (s) | join (s) | build (s) | first step (s) | to first step (s) |"
    return "\n".join([header, "|---:|---:|---:|---:|---:|---:|", *rows])
