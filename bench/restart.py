"""What a lost rank costs until training goes on, with and without spare ranks.

    python -m bench restart [--models mlp-dp2xmp2] [--repeat 3]

Each round trains a few steps with driver batches, SIGKILLs rank 1, and times,
from the kill: the failure reaching the driver (``RankError`` from the next
step), ``restart()`` (a new group, and the state the survivors held put back;
split into starting the group and the rest), and the next completed step. Rounds
alternate ``spare_ranks=0`` and ``spare_ranks=<ranks>`` (spares started after
the model, and given time to import Paddle before the kill, as they would have
in a run), so drifts in the machine's load hit both alike; medians.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

from raydist import testing
from raydist.driver.cluster import group as group_module

# Time for the spares (started after the model) to start and import Paddle before the kill.
SETTLE_S = 20.0


def restart_round(name: str, spares: int, steps: int = 4) -> dict:
    import raydist
    from bench import models
    from bench.common import raydist_model

    data = models.data(name, steps + 2)
    dm = raydist_model(name, spare_ranks=spares)
    try:
        for batch in data[:steps]:
            dm(*batch)
        dm.wait()
        time.sleep(SETTLE_S)
        marks = {}
        start_group = group_module.RankGroup._start

        def timed_start(self):
            marks["group"] = time.monotonic()
            start_group(self)
            marks["grouped"] = time.monotonic()

        os.kill(dm.ranks[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            float(dm(*data[steps]))
            raise AssertionError("the kill went unnoticed")
        except raydist.RankError:
            noticed = time.monotonic()
        group_module.RankGroup._start = timed_start
        try:
            dm.restart()
        finally:
            group_module.RankGroup._start = start_group
        restarted = time.monotonic()
        float(dm(*data[steps]))
        stepped = time.monotonic()
        adopted = len(testing.group(dm).adopted)
    finally:
        dm.shutdown()
    return {"noticed": noticed - killed, "group": marks["grouped"] - marks["group"],
            "restart": restarted - noticed, "step": stepped - restarted, "total": stepped - killed,
            "adopted": adopted}  # fmt: skip


def restart_table(names: list[str], repeat: int) -> str:
    from bench import models

    rows = []
    for name in names:
        n = models.world_size(name)
        runs: dict[int, list[dict]] = {0: [], n: []}
        for _ in range(repeat):
            for spares in runs:
                runs[spares].append(restart_round(name, spares))
                print(name, spares, runs[spares][-1], flush=True)
        base = statistics.median(r["total"] for r in runs[0])
        for spares, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in ("noticed", "group", "restart", "step", "total")}
            rows.append(f"| {name} | {spares} | {min(r['adopted'] for r in rs)} | {med['noticed']:.2f} "
                        f"| {med['group']:.2f} | {med['restart']:.2f} | {med['step']:.2f} | {med['total']:.2f} "
                        f"| {med['total'] / base:.2f} |")  # fmt: skip
    header = ("| model | spare_ranks | ranks adopted | kill to RankError (s) | new group started (s) "
              "| restart() in all (s) | next step (s) | kill to next step (s) | x no spares |")  # fmt: skip
    return "\n".join([header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows])
