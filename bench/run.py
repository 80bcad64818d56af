"""Benchmarks: raydist next to plain multi-process Paddle, in ONE invocation.

    python -m bench [--models mlp-dp2xmp2,mlp-mp2] [--steps 60] [--warmup 10] [--no-write]

For each model, the same model, data and ranks under three runners:
- *native*: N plain processes with paddle.distributed.launch's environment,
  Paddle's own DistModel over Paddle's own shard_dataloader;
- *raydist, loader*: raydist.to_static fed by raydist.shard_dataloader over a
  Ray Dataset (ranks read their own rows);
- *raydist, driver batches*: numpy batches passed to ``dm(x, y)``.
Prints a table and appends it to BENCHMARKS.md with the date, machine and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK_ENV = {"env_vars": {"PYTHONPATH": str(ROOT)}}


def run_native(name: str, warmup: int, steps: int) -> dict:
    from bench.models import world_size
    from raydist.env import RankPlace, paddle_env

    n = world_size(name)
    ports = [_free_port() for _ in range(n + 1)]
    places = [RankPlace("local", "127.0.0.1")] * n
    endpoints = [f"127.0.0.1:{p}" for p in ports[1:]]
    start = time.time()
    procs = []
    for rank in range(n):
        env = {**os.environ, **paddle_env(rank, places, endpoints, f"127.0.0.1:{ports[0]}", use_gpu=False),
               "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.native", name, str(warmup), str(steps)],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"native run failed: {[p.returncode for p in procs]}\n{outs[0][1][-3000:]}")
    result = json.loads(next(line for line in outs[0][0].splitlines() if line.startswith("RESULT "))[7:])
    return {"times": result["times"], "wait_share": sum(result["waits"]) / sum(result["times"]),
            "first_step_s": result["first_step_at"] - start}  # fmt: skip


def _raydist(name: str, loader=None):
    import paddle

    import raydist
    from bench.models import build_layer, world_size

    return raydist.to_static(
        lambda: build_layer(name), loader, paddle.nn.MSELoss(),
        lambda p: paddle.optimizer.AdamW(1e-2, parameters=p),
        num_workers=world_size(name), runtime_env=RANK_ENV,
    )  # fmt: skip


def run_raydist_batches(name: str, warmup: int, steps: int) -> dict:
    from bench.models import data

    batches = data(name, warmup + steps)
    start = time.time()
    with _raydist(name) as dm:
        times, first = [], None
        for i, (x, y) in enumerate(batches):
            t = time.perf_counter()
            dm(x, y)
            first = first or time.time() - start
            if i >= warmup:
                times.append(time.perf_counter() - t)
    return {"times": times, "first_step_s": first}


def run_raydist_loader(name: str, warmup: int, steps: int) -> dict:
    import ray

    import raydist
    from bench.models import batch_size, mesh, rows

    start = time.time()
    ds = ray.data.range((warmup + steps) * batch_size(name)).map_batches(
        lambda b: rows(b["id"]), runtime_env=RANK_ENV
    )
    loader = raydist.shard_dataloader(ds, mesh(name), input_keys=["x", "y"], shard_dims="dp",
                                      batch_size=batch_size(name))  # fmt: skip
    with _raydist(name, loader) as dm:
        times, first = [], None
        for i, batch in enumerate(loader()):
            if i == warmup:
                ray.get([a.take_data_stats.remote() for a in dm._group.actors])
                timed = time.perf_counter()
            t = time.perf_counter()
            dm(batch["x"], batch["y"])
            first = first or time.time() - start
            if i >= warmup:
                times.append(time.perf_counter() - t)
        wall = time.perf_counter() - timed
        stats = ray.get([a.take_data_stats.remote() for a in dm._group.actors])
    return {"times": times, "first_step_s": first, "wait_share": max(s["wait"] for s in stats) / wall}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


RUNNERS = {  # name: (what the table calls it, runner)
    "native": ("native", run_native),
    "loader": ("raydist, loader", run_raydist_loader),
    "batches": ("raydist, driver batches", run_raydist_batches),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp-dp2xmp2,mlp-mp2")
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-write", action="store_true", help="do not append to BENCHMARKS.md")
    args = parser.parse_args(argv)

    import ray

    from bench.models import MODELS, batch_size

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for name in args.models.split(","):
            base = None
            for runner in args.runners.split(","):
                label, run = RUNNERS[runner]
                r = run(name, args.warmup, args.steps)
                med = statistics.median(r["times"])
                base = base or med
                dp = len(MODELS[name][0])
                wait = f"{100 * r['wait_share']:.1f}" if "wait_share" in r else "-"
                rows.append((name, label, med * 1e3, 1 / med, med / base, r["first_step_s"], wait,
                             batch_size(name) / dp / med))  # fmt: skip
    finally:
        ray.shutdown()

    header = ("| model | runner | median step (ms) | steps/s | x native | time to first step (s) "
              "| data wait (% of time) | rows/s per rank |")  # fmt: skip
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {m} | {r} | {ms:.2f} | {sps:.1f} | {x:.2f} | {f:.1f} | {w} | {rps:.0f} |"
              for m, r, ms, sps, x, f, w, rps in rows]  # fmt: skip
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        cmd = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        with open(ROOT / "BENCHMARKS.md", "a") as f:
            f.write(f"\n### {stamp}: `{cmd.strip()}`\n\n{machine()}; {args.steps} timed steps after "
                    f"{args.warmup} warm-up steps.\n\n{table}\n")  # fmt: skip


if __name__ == "__main__":
    main()
