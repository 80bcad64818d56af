"""Benchmarks: raydist next to plain multi-process Paddle, in ONE invocation.

    python -m bench [--models mlp-dp2xmp2,mlp-mp2] [--steps 60] [--warmup 10] [--no-write]

For each model: *native* (N plain processes with paddle.distributed.launch's
environment, Paddle's own DistModel) and *raydist, driver batches* (numpy
batches passed to ``dm(x, y)``), the same model, data and ranks. Prints a
table and appends it to BENCHMARKS.md with the date, machine and versions.
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


def run_native(name: str, warmup: int, steps: int) -> dict:
    from raydist.env import RankPlace, paddle_env

    from bench.models import world_size

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
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True))  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"native run failed: return codes {[p.returncode for p in procs]}")
    result = json.loads(next(line for line in outs[0].splitlines() if line.startswith("RESULT "))[7:])
    return {"times": result["times"], "first_step_s": result["first_step_at"] - start}


def run_raydist(name: str, warmup: int, steps: int) -> dict:
    import paddle

    import raydist
    from bench.models import build_layer, data, world_size

    batches = data(name, warmup + steps)
    start = time.time()
    with raydist.to_static(
        lambda: build_layer(name),
        loss=paddle.nn.MSELoss(),
        optimizer=lambda p: paddle.optimizer.AdamW(1e-2, parameters=p),
        num_workers=world_size(name),
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    ) as dm:
        times, first = [], None
        for i, (x, y) in enumerate(batches):
            t = time.perf_counter()
            dm(x, y)
            first = first or time.time() - start
            if i >= warmup:
                times.append(time.perf_counter() - t)
    return {"times": times, "first_step_s": first}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import paddle
    import ray

    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, Paddle {paddle.__version__}, Ray {ray.__version__}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp-dp2xmp2,mlp-mp2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-write", action="store_true", help="do not append to BENCHMARKS.md")
    args = parser.parse_args(argv)

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for name in args.models.split(","):
            native = run_native(name, args.warmup, args.steps)
            rd = run_raydist(name, args.warmup, args.steps)
            base = statistics.median(native["times"])
            for runner, r in (("native", native), ("raydist, driver batches", rd)):
                med = statistics.median(r["times"])
                rows.append((name, runner, med * 1e3, 1 / med, med / base, r["first_step_s"]))
    finally:
        ray.shutdown()

    header = "| model | runner | median step (ms) | steps/s | x native | time to first step (s) |"
    lines = [header, "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {m} | {r} | {ms:.2f} | {sps:.1f} | {x:.2f} | {f:.1f} |" for m, r, ms, sps, x, f in rows]
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
