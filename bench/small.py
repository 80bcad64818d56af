"""Small steps: raydist's loader loop next to native Paddle, by how often the loop reads a loss.

    python -m bench small [--models mlp-mp2,wide-mp2] [--steps 300] [--repeat 3]

Runners, round-robin, each round starting one runner later (the machine's drifts hit every
runner alike, and no runner always follows the same one):
- *native, ideal*: plain multi-process Paddle (bench/native.py), its DistModel fed the
  same batch at every step: no data cost at all;
- *native, DataLoader*: the same, fed by Paddle's ``shard_dataloader`` over a
  ``paddle.io.DataLoader`` of the same rows in memory, as a native user runs it;
- *raydist, loss read never / every 10 / every step*: ``for batch in loader(): loss =
  dm(x, y)`` over a ``raydist.shard_dataloader`` of a Ray Dataset, reading ``float(loss)``
  that often (never: one wait at the end); with ``--compiled``, each also over Ray's compiled
  graph (``dispatch="compiled"``: shared-memory channels instead of actor calls);
- *Ray*: a round trip of one actor call to each of 2 actors doing nothing: the least a loss
  read every step costs through actor calls ("rank CPU" is then an actor's).

Native reads every loss (its static DistModel returns it, the step done). Reports the mean
step (median of the runs), its ratio to both native baselines, the CPU a rank's process
spends per step (all its threads) and the driver's, and the whole machine's: busy (every
process, Ray's own included) and stolen (the host running other guests: the slow spells).
"""

from __future__ import annotations

import statistics

from bench.common import raydist_model, timed_steps, bench_loader, machine_cpu, memory_dataset, per_step, run_native

EVERY = {"never": 0, "every 10": 10, "every step": 1}


def runraydist_model(name: str, warmup: int, steps: int, every: int, dispatch: str | None = None) -> dict:
    loader = bench_loader(name, memory_dataset(name, warmup + steps))
    count = iter(range(1, 1 << 62))

    def call(dm, batch):
        loss = dm(batch["x"], batch["y"])
        if every and next(count) % every == 0:
            float(loss)
        return loss

    import time

    with raydist_model(name, loader, dispatch=dispatch) as dm:
        return timed_steps(dm, loader(), warmup, time.time(), call)


def run_ray_floor(steps: int) -> dict:
    """Ray's own cost of a loss read every step: a round trip of one actor call to each of 2
    actors that do nothing (the least a step message each way costs through actor calls)."""
    import time

    import ray

    @ray.remote(num_cpus=0)
    class Idle:
        def step(self, number: int) -> float:
            return 0.0

        def cpu(self) -> float:
            return time.process_time()

    actors = [Idle.remote(), Idle.remote()]
    try:
        ray.get([a.step.remote(0) for a in actors])
        before = ray.get([a.cpu.remote() for a in actors])
        times, cpu, machine = [], time.process_time(), machine_cpu()
        for i in range(steps):
            t = time.perf_counter()
            ray.get([a.step.remote(i) for a in actors])
            times.append(time.perf_counter() - t)
        driver, machine = (time.process_time() - cpu) / steps, per_step(machine, machine_cpu(), steps)
        after = ray.get([a.cpu.remote() for a in actors])
    finally:
        for a in actors:
            ray.kill(a)
    return {"times": times, "rank_cpu_s": statistics.fmean(b - a for a, b in zip(before, after)) / steps,
            "driver_cpu_s": driver, **machine}


def rotated(order: list[str], round_: int) -> list[str]:
    """``order`` starting ``round_`` places later: no runner always follows the same one."""
    k = round_ % len(order)
    return order[k:] + order[:k]


def small_table(names: list[str], steps: int, warmup: int, repeat: int, reads: list[str],
                compiled: bool = False) -> str:  # fmt: skip
    runners = {"native, ideal": lambda n: run_native(n, warmup, steps, "ideal"),
               "native, DataLoader": lambda n: run_native(n, warmup, steps, "loader")}  # fmt: skip
    for read in reads:
        runners[f"raydist, loss read {read}"] = lambda n, every=EVERY[read]: runraydist_model(n, warmup, steps, every)
        if compiled:
            runners[f"raydist, loss read {read}, compiled graph"] = (
                lambda n, every=EVERY[read]: runraydist_model(n, warmup, steps, every, "compiled"))
    runners["Ray: an actor call to each of 2 actors that do nothing"] = lambda n: run_ray_floor(steps)
    rows = []
    for name in names:
        runs: dict[str, list[dict]] = {r: [] for r in runners}
        for round_ in range(repeat):
            for label in rotated(list(runners), round_):
                runs[label].append(runners[label](name))
        med = {label: statistics.median(statistics.fmean(r["times"]) for r in rs) for label, rs in runs.items()}
        ideal, loader = med["native, ideal"], med["native, DataLoader"]
        for label, rs in runs.items():
            spread = sorted(statistics.fmean(r["times"]) / med[label] for r in rs)
            rank_cpu = statistics.median(r["rank_cpu_s"] for r in rs)
            busy, steal = (statistics.median(r[k] for r in rs) for k in ("machine_cpu_s", "steal_s"))
            driver = (f"{1e6 * statistics.median(r['driver_cpu_s'] for r in rs):.0f}"
                      if "driver_cpu_s" in rs[0] else "-")  # fmt: skip
            rows.append(f"| {name} | {label} | {1e3 * med[label]:.2f} | {med[label] / ideal:.2f} "
                        f"| {med[label] / loader:.2f} | {spread[0]:.2f}-{spread[-1]:.2f} | {1e3 * rank_cpu:.2f} "
                        f"| {driver} | {1e3 * busy:.2f} | {1e3 * steal:.2f} |")  # fmt: skip
            print(rows[-1], flush=True)
    header = ("| model | runner | step (ms) | x native ideal | x native DataLoader | runs / median "
              "| rank CPU per step (ms) | driver CPU per step (µs) | machine CPU per step (ms) "
              "| stolen per step (ms) |")  # fmt: skip
    return "\n".join([header, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows])
