"""The bench GPT on two pipeline stages (1F1B, 4 micro-batches) next to dp2 and mp2.

    python -m bench pipeline [--steps 40] [--warmup 10] [--repeat 3]

Every runner is raydist with driver batches, round-robin (dp2, mp2, pp2, dp2, ...),
medians over runs. The bubble is what each stage spends waiting for its
neighbours: the time its send/recv ops block (receives, and the end-of-step wait
for its sends), as a share of the timed steps' wall time.
"""

from __future__ import annotations

import statistics

import numpy as np

MODELS = ["gpt-dp2", "gpt-mp2", "gpt-pp2"]


def pipeline_table(steps: int, warmup: int, repeat: int) -> str:
    from bench.models import MODELS as ALL
    from bench.common import run_raydist_batches, run_reference

    runs: dict[str, list[dict]] = {name: [] for name in MODELS}
    for _ in range(repeat):
        for name in MODELS:
            runs[name].append(run_raydist_batches(name, warmup, steps, keep_stage_waits=True))
    rows, base = [], None
    for name in MODELS:
        med = statistics.median(statistics.median(r["times"]) for r in runs[name])
        base = base or med
        reference = run_reference(name, warmup + steps)
        same = "yes" if np.allclose(runs[name][0]["losses"], reference, rtol=1e-4) else "NO"
        if name == "gpt-pp2":
            shares = np.median([r["stage_wait_share"] for r in runs[name]], axis=0)
            bubble = ", ".join(f"stage {i}: {100 * s:.1f}" for i, s in enumerate(shares))
        else:
            bubble = "-"
        rows.append(f"| {name} | {ALL[name][4]} | {med * 1e3:.1f} | {med / base:.2f} | {bubble} | {same} |")
        print(rows[-1], flush=True)
    header = "| model | what | median step (ms) | x dp2 | bubble: waiting for neighbours (% of step) | same losses |"
    return "\n".join([header, "|---|---|---:|---:|---|---|", *rows])
