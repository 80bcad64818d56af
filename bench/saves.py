"""What a checkpoint costs the training loop: synchronous saves against background ones.

    python -m bench saves [--models gpt-mp2] [--steps 40] [--every 8] [--repeat 3]

Each model trains ``--steps`` steps on driver batches and saves a checkpoint every
``--every`` steps to a fresh local directory, rounds alternating (sync, background,
sync, ...). Before each save the loop waits for its steps in flight (``dm.wait()``, as
``fit`` collects their losses first); that wait is reported apart. The *stall* is how
long ``dm.save`` then keeps the loop: for a synchronous save, the whole save; for a
background one (``background=True``, what ``fit`` does), the snapshot of every rank's
shards in host memory (and any wait for the save before it). Reports the median of
both per save, the loop's time per step over the run (saves included), the same loop
without saves (no waits either), and the checkpoint's size.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from raydist import testing


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _round(dm, batches, every: int, background: bool | None) -> dict:
    """One run over ``batches``; ``background`` None: no saves."""
    directory = tempfile.mkdtemp(prefix="rdsave")
    stalls, waits, size = [], [], 0
    start = time.perf_counter()
    for i, (x, y) in enumerate(batches, 1):
        dm(x, y)
        if background is not None and i % every == 0:
            began = time.perf_counter()
            dm.wait()
            waited = time.perf_counter()
            dm.save(f"{directory}/step-{i:08d}", background=background)
            stalls.append(time.perf_counter() - waited)
            waits.append(waited - began)
    dm.wait()
    testing.lifecycle(dm).state.wait_saved()  # the last background save's commit, inside the measured time
    per_step = (time.perf_counter() - start) / len(batches)
    if stalls:
        size = _size(f"{directory}/step-{every:08d}")
    shutil.rmtree(directory, ignore_errors=True)
    return {"stall": statistics.median(stalls) if stalls else 0.0, "wait": statistics.median(waits) if waits else 0.0,
            "per_step": per_step, "size": size}


def saves_table(names: list[str], steps: int, every: int, repeat: int) -> str:
    import paddle

    import raydist
    from bench import models
    from bench.common import RANK_ENV

    rows = []
    for name in names:
        batches = models.data(name, steps)
        kinds = {"none": None, "sync": False, "background": True}
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        with raydist.to_static(lambda: models.build_layer(name), loss=models.loss(name),
                               optimizer=lambda p: paddle.optimizer.AdamW(1e-3, parameters=p),
                               num_workers=models.world_size(name), runtime_env=RANK_ENV) as dm:  # fmt: skip
            _round(dm, batches[: every + 2], every, True)  # warm-up: builds, first save
            for _ in range(repeat):
                for kind, background in kinds.items():
                    runs[kind].append(_round(dm, batches, every, background))
        base = statistics.median(r["per_step"] for r in runs["none"])
        for kind in ("sync", "background"):
            done = runs[kind]
            per_step = statistics.median(r["per_step"] for r in done)
            rows.append(f"| {name} | {kind} | {statistics.median(r['wait'] for r in done) * 1e3:.0f} "
                        f"| {statistics.median(r['stall'] for r in done) * 1e3:.0f} "
                        f"| {per_step * 1e3:.1f} | {base * 1e3:.1f} | {per_step / base:.2f}x "
                        f"| {done[0]['size'] / 2**20:.1f} |")  # fmt: skip
            print(rows[-1], flush=True)
    header = ("| model | saves | steps in flight to finish first (ms) | the save's stall (ms) "
              f"| time per step with a save every {every} (ms) | without saves (ms) | ratio | checkpoint (MiB) |")
    return "\n".join([header, "|---|---|---:|---:|---:|---:|---:|---:|", *rows])
