"""``python -m bench [models]``: each bench model under each runner, round-robin (see bench/run.py)."""

from __future__ import annotations

import statistics

import numpy as np

from bench.common import run_native, run_raydist_batches, run_raydist_loader, run_raydist_loader_paddle, run_reference

RUNNERS = {  # name: (what the table calls it, runner)
    "native": ("native", run_native),
    "loader": ("raydist, loader", run_raydist_loader),
    "loader-paddle": ("raydist, loader over a paddle.io.Dataset", run_raydist_loader_paddle),
    "batches": ("raydist, driver batches", run_raydist_batches),
    # the compiled graph's channels busy-wait: on CPU ranks that need every core it costs steps
    "compiled": ("raydist, driver batches, compiled graph",
                 lambda name, warmup, steps: run_raydist_batches(name, warmup, steps, "compiled")),
}


def models_table(args) -> str:
    from bench.models import MODELS, batch_size

    rows = []
    for name in args.models.split(","):
        runners = args.runners.split(",")
        runs: dict[str, list[dict]] = {r: [] for r in runners}
        for _ in range(args.repeat):  # round-robin, so drifts in the machine's load hit every runner alike
            for runner in runners:
                runs[runner].append(RUNNERS[runner][1](name, args.warmup, args.steps))
        reference = run_reference(name, args.warmup + args.steps)
        base = None
        for runner in runners:
            label = RUNNERS[runner][0]
            first = runs[runner][0]
            # each run's mean step (its wall time over its steps: messages of several steps leave the
            # driver's cost between them, not inside), and the median of the runs
            med = statistics.median(statistics.fmean(r["times"]) for r in runs[runner])
            base = base or med
            # the loader's split orders rows its own way: its losses are not step-by-step comparable
            same = "n/a" if runner.startswith("loader") else (
                "yes" if np.allclose(first["losses"], reference, rtol=1e-4) else "NO")
            wait = f"{100 * max(r['wait_share'] for r in runs[runner]):.1f}" if "wait_share" in first else "-"
            first_step = statistics.median(r["first_step_s"] for r in runs[runner])
            peak = max(r["peak_mib"] for r in runs[runner])
            cpu = (f"{1e6 * statistics.median(r['driver_cpu_s'] for r in runs[runner]):.0f}"
                   if "driver_cpu_s" in first else "-")  # fmt: skip
            rank_cpu = statistics.median(r["rank_cpu_s"] for r in runs[runner])
            spread = sorted(statistics.fmean(r["times"]) / med for r in runs[runner])
            dp = len(MODELS[name][1])
            rows.append(f"| {name} | {label} | {med * 1e3:.2f} | {1 / med:.1f} | {med / base:.3f} "
                        f"| {spread[0]:.2f}-{spread[-1]:.2f} | {1e3 * rank_cpu:.1f} | {100 * rank_cpu / med:.0f} "
                        f"| {first_step:.1f} | {peak:.0f} | {wait} | {cpu} | {batch_size(name) / dp / med:.0f} "
                        f"| {same} |")  # fmt: skip
            print(rows[-1], flush=True)
    header = ("| model | runner | step (ms, mean of a run) | steps/s | x native | runs / median "
              "| rank CPU per step (ms) | rank busy (%) | time to first step (s) "
              "| peak memory per rank (MiB) | data wait (% of time) | driver CPU per step (µs) | rows/s per rank "
              "| same losses |")  # fmt: skip
    return "\n".join([header, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|", *rows])


