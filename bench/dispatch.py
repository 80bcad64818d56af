"""The driver's cost per step, in isolation, as the group grows.

Runs raydist's real driver path (``DistModel.__call__``: checks, split,
``ray.put`` per data-parallel shard, one actor call per rank, the window of
steps in flight, assembling the loss) against stand-in ranks that do no
Paddle work (`NullRank`), so 8 and 16 ranks fit on 2 cores. Reports the
driver's CPU time per step (the controller's own cost) and the wall time per
step (bounded here by the ranks' and Ray's per-call work on 2 shared cores).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import raydist
import raydist.group
from raydist.rank import RankActor
from raydist.topology import Layout, Mesh, ModePlan


class NullRank(RankActor):
    """A rank that answers like one and does no Paddle work: a pure data-parallel mesh."""

    def setup(self, env, use_gpu, paddle_logs=False):
        return []

    def build(self, payload):
        self._mesh = Mesh.of(list(range(self.world_size)), ["dp"])
        return {"meshes": [self._mesh]}

    def set_specs(self, inputs, labels):
        pass

    def set_mode(self, mode):
        plan = ModePlan([Layout(self._mesh, (), ((0, "avg"),))])
        self.collect = self.rank in plan.readers()
        return plan

    def run(self, message):
        self.stats.starts.append(time.monotonic())
        return [np.float32(1.0)] if self.collect else None


def per_step(ranks: int, steps: int, warmup: int, dispatch: str, batch: int = 64) -> dict:
    x = np.ones((batch, 16), np.float32)
    y = np.ones((batch, 4), np.float32)
    original = raydist.group._RemoteRank
    raydist.group._RemoteRank = raydist.group.ray.remote(concurrency_groups={"data": 1})(NullRank)
    try:
        with raydist.to_static(lambda: None, loss=lambda a, b: a, optimizer=lambda p: None, num_workers=ranks,
                               resources_per_rank={"CPU": 0.01}, dispatch=dispatch) as dm:  # fmt: skip
            for _ in range(warmup):
                dm(x, y)
            dm.wait()
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(steps):
                dm(x, y)
            dispatched = time.process_time() - cpu
            dm.wait()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        raydist.group._RemoteRank = original
    return {"cpu_us": 1e6 * cpu / steps, "dispatch_cpu_us": 1e6 * dispatched / steps, "wall_us": 1e6 * wall / steps}


def dispatch_table(sizes: list[int], steps: int, warmup: int) -> str:
    rows = []
    for dispatch in ("compiled", "calls"):
        for n in sizes:
            runs = [per_step(n, steps, warmup, dispatch) for _ in range(3)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append(f"| {dispatch} | {n} | {med['cpu_us']:.0f} | {med['cpu_us'] / n:.0f} | {med['wall_us']:.0f} |")
            print(rows[-1], flush=True)
    header = ("| dispatch | ranks (stand-ins, no Paddle) | driver CPU per step (µs) | per rank (µs) "
              "| wall per step (µs) |")  # fmt: skip
    return "\n".join([header, "|---|---:|---:|---:|---:|", *rows])
