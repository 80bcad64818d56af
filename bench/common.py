"""What every benchmark runner shares: starting native's ranks and raydist's model on a bench
model, feeding them, timing steps where they run, and the machine's CPU. `bench.run` parses the
commands; each command's module imports from here, never from `bench.run`."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RANK_ENV = {"env_vars": {"PYTHONPATH": str(ROOT)}}
RATE_NOTE = "100 samples per second, idle threads left out"
DISPATCH = ["auto"]  # raydist's dispatch for this run (--dispatch)


def start_native(name: str, args: list[str], **popen) -> list[subprocess.Popen]:
    """bench/native.py's ranks of ``name`` (``python -m bench.native name *args``), one process each,
    with paddle.distributed.launch's environment; ``popen``: subprocess.Popen's."""
    from bench.models import world_size
    from raydist.env import RankPlace, paddle_env
    from raydist.net import free_port

    n = world_size(name)
    ports = [free_port("127.0.0.1") for _ in range(n + 1)]
    places = [RankPlace("local", "127.0.0.1")] * n
    endpoints = [f"127.0.0.1:{p}" for p in ports[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2", **popen.pop("env", {})}
    return [subprocess.Popen([sys.executable, "-m", "bench.native", name, *args], cwd=ROOT, text=True,
                             env={**env, **paddle_env(rank, places, endpoints, f"127.0.0.1:{ports[0]}",
                                                      use_gpu=False)}, **popen)
            for rank in range(n)]  # fmt: skip


def run_native(name: str, warmup: int, steps: int, feed: str = "loader") -> dict:
    from bench.models import MODELS

    start = time.time()
    procs = start_native(name, [str(warmup), str(steps), feed], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"native run failed: {[p.returncode for p in procs]}\n{outs[0][1][-3000:]}")
    results = [json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:]) for out, _ in outs]
    r0 = results[0]
    # each rank's loss is its data-parallel group's: the batch's is their mean (as raydist returns)
    leaders = [row[0] for row in MODELS[name][1]]
    losses = np.mean([results[r]["losses"] for r in leaders], axis=0).tolist()
    return {"times": r0["times"], "wait_share": sum(r0["waits"]) / sum(r0["times"]), "losses": losses,
            "first_step_s": r0["first_step_at"] - start, "peak_mib": max(r["peak_mib"] for r in results),
            "rank_cpu_s": statistics.fmean(r["cpu_s"] for r in results) / steps,
            **per_step(r0["machine"][0], r0["machine"][1], steps)}  # fmt: skip


def raydist_model(name: str, loader=None, max_in_flight: int = 2, dispatch: str | None = None,
             env_vars: dict | None = None, **kwargs):  # fmt: skip
    import paddle

    import raydist
    from bench import models

    return raydist.to_static(
        lambda: models.build_layer(name), loader, models.loss(name),
        lambda p: paddle.optimizer.AdamW(1e-3, parameters=p), strategy=models.strategy(name),
        num_workers=models.world_size(name), runtime_env={"env_vars": {**RANK_ENV["env_vars"], **(env_vars or {})}},
        max_in_flight=max_in_flight,
        dispatch=dispatch or DISPATCH[0], **kwargs,
    )  # fmt: skip


def run_reference(name: str, steps: int) -> list[float]:
    """The losses of the same model and batches in one plain process (bench/reference.py)."""
    done = subprocess.run([sys.executable, "-m", "bench.reference", name, str(steps)], cwd=ROOT, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2"},
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"the one-process reference failed:\n{done.stderr[-3000:]}")
    return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])["losses"]


def _rank_stats(rank) -> dict:
    """Inside a rank actor (Ray's ``__ray_call__``): when its steps started and how long they waited for
    data since the last call, and for pipeline neighbours in all; the process's CPU seconds so far."""
    from raydist.compat.collectives import p2p_waited_s

    return {"starts": rank.model.take_starts(), "wait": rank.data.take_wait(), "stage_wait": p2p_waited_s(),
            "cpu": time.process_time()}


def machine_cpu() -> tuple[float, float]:
    """The machine's CPU seconds so far, all cores: busy (every process), and stolen (the host
    ran other guests while ours waited: on a shared host, the slow spells)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq, t.steal


def per_step(before: tuple[float, float], after: tuple[float, float], steps: int) -> dict:
    """`machine_cpu` over ``steps`` steps, as a runner's result keys."""
    return {"machine_cpu_s": (after[0] - before[0]) / steps, "steal_s": (after[1] - before[1]) / steps}


def timed_steps(dm, batches, warmup: int, start: float, call) -> dict:
    """Run ``call(dm, batch)`` for every batch, reading every loss at the end.

    The driver does not wait for each step, so step times are taken where the
    steps run: the intervals between rank 0's step starts.
    """

    from raydist.testing import on_ranks

    def take_stats():
        return on_ranks(dm, _rank_stats)

    losses, first = [], None
    for i, batch in enumerate(batches):
        if i == warmup:
            dm.wait()
            before = take_stats()
            timed, cpu, machine = time.perf_counter(), time.process_time(), machine_cpu()
        losses.append(call(dm, batch))
        if first is None:
            float(losses[0])
            first = time.time() - start
    dm.wait()
    wall, machine = time.perf_counter() - timed, per_step(machine, machine_cpu(), len(losses) - warmup)
    driver_cpu = (time.process_time() - cpu) / (len(losses) - warmup)
    stats = take_stats()
    times = list(np.diff(stats[0]["starts"]))
    times.append(wall - sum(times))  # the last step: to the end of the run
    peak = max(r.peak_rss_mib for r in dm.ranks)
    return {"times": times, "first_step_s": first, "losses": [float(x) for x in losses], "peak_mib": peak,
            "driver_cpu_s": driver_cpu, "wait_share": max(s["wait"] for s in stats) / wall,
            # every thread of a rank's process: its steps, its reader, Ray's own
            "rank_cpu_s": statistics.fmean(s["cpu"] - b["cpu"] for s, b in zip(stats, before)) / len(times),
            "stage_wait_share": [(s["stage_wait"] - b["stage_wait"]) / wall
                                 for s, b in zip(stats, before)], **machine}  # fmt: skip


def run_raydist_batches(name: str, warmup: int, steps: int, dispatch: str | None = None,
                        keep_stage_waits: bool = False) -> dict:  # fmt: skip
    from bench.models import data

    batches = data(name, warmup + steps)
    start = time.time()
    with raydist_model(name, dispatch=dispatch) as dm:
        r = timed_steps(dm, batches, warmup, start, lambda dm, b: dm(*b))
    r.pop("wait_share")
    if not keep_stage_waits:
        r.pop("stage_wait_share")
    return r


def memory_dataset(name: str, batches: int):
    """``batches`` batches of ``name``'s rows as a materialized Ray Dataset: made in memory, as
    native's paddle.io.TensorDataset is (the runners compare feeding, not making, data)."""
    import ray

    from bench.models import MODELS, batch_size, rows

    return ray.data.range(batches * batch_size(name)).map_batches(
        lambda b, kind=MODELS[name][0]: rows(kind, b["id"]), runtime_env=RANK_ENV
    ).materialize()


def bench_loader(name: str, dataset):
    """`raydist.shard_dataloader` over ``dataset``, as every raydist loader runner reads it."""
    import raydist
    from bench.models import batch_size, mesh

    return raydist.shard_dataloader(dataset, mesh(name), input_keys=["x", "y"], shard_dims="dp",
                                    batch_size=batch_size(name))  # fmt: skip


def run_raydist_loader(name: str, warmup: int, steps: int) -> dict:
    return through_loader(name, memory_dataset(name, warmup + steps), warmup)


def run_raydist_loader_paddle(name: str, warmup: int, steps: int) -> dict:
    """The loader over a ``paddle.io.Dataset`` (no Ray Data): what Ray Data's reading costs."""
    from bench.models import MODELS, batch_size
    from bench.rows import Rows

    return through_loader(name, Rows(MODELS[name][0], (warmup + steps) * batch_size(name)), warmup)


def through_loader(name: str, dataset, warmup: int) -> dict:
    """Timed steps fed by `raydist.shard_dataloader` over ``dataset`` (timed from the loader's creation)."""
    start = time.time()
    loader = bench_loader(name, dataset)
    with raydist_model(name, loader) as dm:
        return timed_steps(dm, loader(), warmup, start, lambda dm, b: dm(b["x"], b["y"]))


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import paddle
    import ray

    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, Paddle {paddle.__version__}, "
            f"Ray {ray.__version__}")  # fmt: skip


