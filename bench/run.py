"""Benchmarks: raydist next to plain multi-process Paddle, in ONE invocation.

    python -m bench [models] [--models mlp-mp2,...] [--runners native,loader,batches,compiled] [--steps 60]
                    [--warmup 10] [--repeat N] [--dispatch auto]
    python -m bench dispatch [--ranks 2,4,8,16,32,64] [--steps 300] [--paths calls,tree,...]
    python -m bench restart [--models mlp-dp2xmp2] [--repeat 3]
    python -m bench elastic [--models mlp-dp2xmp2,gpt-dp2xmp2] [--steps 24]
    python -m bench pipeline [--steps 40] [--repeat 3]
    python -m bench startup [--repeat 2] [--models mlp-mp2]
    python -m bench resume [--models gpt-mp2] [--steps 24] [--every 4] [--kill-after 10] [--repeat 3]
    python -m bench saves [--models gpt-mp2] [--steps 40] [--every 8] [--repeat 3]
    python -m bench attach [--models gpt-mp2] [--steps 12] [--before 6] [--repeat 3]
    python -m bench small [--models mlp-mp2,wide-mp2] [--steps 300] [--repeat 3] [--compiled]
    python -m bench paired [--models mlp-mp2,wide-mp2] [--rounds 10] [--seconds 1] [--record-off]
    python -m bench profile [--models mlp-mp2] [--seconds 20] [--every 0]
    python -m bench COMMAND --help      (each command's options and defaults; --no-write: no BENCHMARKS.md entry)

For each model, the same model, data and ranks under these runners, round-robin:
- *native*: N plain processes with paddle.distributed.launch's environment,
  Paddle's own DistModel over Paddle's own shard_dataloader;
- *raydist, loader*: raydist.to_static fed by raydist.shard_dataloader over a
  Ray Dataset (ranks read their own rows);
- *raydist, loader over a paddle.io.Dataset* (``loader-paddle``, not run by default):
  the same rows, read with Paddle's sampler instead of Ray Data;
- *raydist, driver batches*: numpy batches passed to ``dm(x, y)``;
- *raydist, driver batches, compiled graph* (``compiled``, not run by default):
  the same with ``dispatch="compiled"``, whose channels busy-wait.
Reports the mean step time (median of the runs; each run's over that median), steps/s, the ratio
to native, the CPU a rank's process spends per step (all its threads) and its share of the step,
time to first step, peak memory per rank, the share of time ranks wait for data, and
whether native and raydist's driver batches computed the losses of the same
model trained in ONE plain process (bench/reference.py). ``dispatch`` measures the
driver's own cost per step as the group grows (bench/dispatch.py); ``elastic``, what a
lost or joining node costs (bench/elastic.py); ``pipeline``, the bench GPT on two
pipeline stages next to dp2 and mp2, with each stage's bubble (bench/pipeline.py); ``startup``,
where a model's start goes (bench/startup.py); ``paired``, small steps with native and raydist
alive side by side taking turns in short chunks, ratios within one spell of the machine
(bench/paired.py); ``restart``, a killed rank's cost until the next
step, with and without spare ranks (bench/restart.py); ``resume``, a job killed and run
again, and ``attach``, a detached model attached by a new driver (bench/outlive.py); ``saves``, a checkpoint's stall of the loop (bench/saves.py). Tables are
printed and appended to BENCHMARKS.md with the date, machine and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
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


def _raydist(name: str, loader=None, max_in_flight: int = 2, dispatch: str | None = None,
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


def _timed_steps(dm, batches, warmup: int, start: float, call) -> dict:
    """Run ``call(dm, batch)`` for every batch, reading every loss at the end.

    The driver does not wait for each step, so step times are taken where the
    steps run: the intervals between rank 0's step starts.
    """
    import ray

    def take_stats():
        return ray.get([a.__ray_call__.remote(_rank_stats) for a in dm._client.group.actors])

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
    peak = max(s["peak_rss_mib"] for s in ray.get([a.status.remote() for a in dm._client.group.actors]))
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
    with _raydist(name, dispatch=dispatch) as dm:
        r = _timed_steps(dm, batches, warmup, start, lambda dm, b: dm(*b))
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
    return _through_loader(name, memory_dataset(name, warmup + steps), warmup)


def run_raydist_loader_paddle(name: str, warmup: int, steps: int) -> dict:
    """The loader over a ``paddle.io.Dataset`` (no Ray Data): what Ray Data's reading costs."""
    from bench.models import MODELS, batch_size
    from bench.rows import Rows

    return _through_loader(name, Rows(MODELS[name][0], (warmup + steps) * batch_size(name)), warmup)


def _through_loader(name: str, dataset, warmup: int) -> dict:
    """Timed steps fed by `raydist.shard_dataloader` over ``dataset`` (timed from the loader's creation)."""
    start = time.time()
    loader = bench_loader(name, dataset)
    with _raydist(name, loader) as dm:
        return _timed_steps(dm, loader(), warmup, start, lambda dm, b: dm(b["x"], b["y"]))


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


COMMANDS = ("models", "dispatch", "restart", "elastic", "pipeline", "startup", "resume", "attach", "saves", "small",
            "paired", "profile", "timeline")


def _names(known: list[str]) -> Callable[[str], str]:
    """An argparse type: a comma-separated list of names among ``known``, kept as the string."""

    def check(text: str) -> str:
        unknown = [n for n in text.split(",") if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown: {', '.join(unknown)} (known: {', '.join(known)})")
        return text

    return check


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ints: {text!r}") from None
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"group sizes must be positive: {text!r}")
    return sizes


def parser() -> argparse.ArgumentParser:
    """``python -m bench [COMMAND] [options]``: one subcommand per table; ``models`` when none is named."""
    top = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter,
                                  epilog="Without a COMMAND, the options are models': python -m bench --repeat 3 is "
                                         "python -m bench models --repeat 3. python -m bench COMMAND --help: "
                                         "its options and defaults.")  # fmt: skip
    commands = top.add_subparsers(dest="what", metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text,
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
        sub.add_argument("--no-write", action="store_true", help="do not append to BENCHMARKS.md")
        return sub

    def dispatch_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--dispatch", default="auto", choices=["auto", "compiled", "calls", "tree"],
                         help="raydist's dispatch")  # fmt: skip

    sub = command("models", "raydist next to native Paddle: each model under each runner (the default command)")
    sub.add_argument("--models", default="mlp-mp2,mlp-dp2xmp2,gpt-mp2,gpt-dp2xmp2", help="bench/models.py's, comma-separated")
    sub.add_argument("--runners", default="native,loader,batches", type=_names(list(RUNNERS)), help="comma-separated")
    sub.add_argument("--steps", type=int, default=60, help="timed steps")
    sub.add_argument("--warmup", type=int, default=10, help="steps before the timed ones")
    sub.add_argument("--repeat", type=int, default=1, help="runs of each runner, round-robin (medians)")
    dispatch_option(sub)
    sub = command("dispatch", "the driver's cost per step as the group grows, next to Ray's own (bench/dispatch.py)")
    sub.add_argument("--ranks", default="2,4,8,16,32,64", type=_sizes, help="group sizes, comma-separated")
    sub.add_argument("--steps", type=int, default=300, help="timed steps")
    sub.add_argument("--warmup", type=int, default=10, help="steps before the timed ones")
    sub.add_argument("--repeat", type=int, default=3, help="rounds (medians)")
    sub.add_argument("--paths", default="ray-calls,calls,tree,ray-compiled,compiled",
                     help="the paths to measure, comma-separated (bench/dispatch.py's PATHS)")  # fmt: skip
    sub = command("restart", "a killed rank's cost until the next step, with and without spare ranks (bench/restart.py)")
    sub.add_argument("--models", default="mlp-dp2xmp2", help="comma-separated")
    sub.add_argument("--repeat", type=int, default=3, help="kills of each kind (medians)")
    dispatch_option(sub)
    sub = command("elastic", "what a lost or joining node costs, on clusters of its own (bench/elastic.py)")
    sub.add_argument("--models", default="mlp-dp2xmp2,gpt-dp2xmp2", help="comma-separated")
    sub.add_argument("--steps", type=int, default=24, help="steps per run")
    sub.add_argument("--repeat", type=int, default=1, help="runs of each kind (medians)")
    sub = command("pipeline", "the bench GPT on two pipeline stages next to dp2 and mp2 (bench/pipeline.py)")
    sub.add_argument("--steps", type=int, default=40, help="timed steps")
    sub.add_argument("--warmup", type=int, default=10, help="steps before the timed ones")
    sub.add_argument("--repeat", type=int, default=1, help="runs of each (medians)")
    dispatch_option(sub)
    sub = command("resume", "a job killed and run again: time to its first step, steps computed twice (bench/outlive.py)")
    sub.add_argument("--models", default="gpt-mp2", help="comma-separated")
    sub.add_argument("--steps", type=int, default=24, help="steps per run")
    sub.add_argument("--every", type=int, default=4, help="checkpoint_every")
    sub.add_argument("--kill-after", type=int, default=10, help="steps completed when the driver is killed")
    sub.add_argument("--repeat", type=int, default=3, help="runs of each kind, round-robin (medians)")
    sub = command("attach", "a new driver attached to a detached model after a SIGKILL: time to its first step "
                            "(bench/outlive.py)")  # fmt: skip
    sub.add_argument("--models", default="gpt-mp2", help="comma-separated")
    sub.add_argument("--steps", type=int, default=12, help="steps per run")
    sub.add_argument("--before", type=int, default=6, help="steps the detached model's first driver runs")
    sub.add_argument("--repeat", type=int, default=3, help="runs of each kind, round-robin (medians)")
    sub = command("saves", "a checkpoint's stall of the loop, synchronous and in the background (bench/saves.py)")
    sub.add_argument("--models", default="gpt-mp2", help="comma-separated")
    sub.add_argument("--steps", type=int, default=40, help="steps per run")
    sub.add_argument("--every", type=int, default=8, help="a save every this many steps")
    sub.add_argument("--repeat", type=int, default=3, help="runs of each kind, round-robin (medians)")
    def small_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--models", default="mlp-mp2,wide-mp2", help="comma-separated")
        sub.add_argument("--warmup", type=int, default=20, help="steps before the timed ones")
        sub.add_argument("--reads", default="never,every 10,every step", help="how often the loop reads a loss, "
                         "comma-separated among: never, every 10, every step")  # fmt: skip

    sub = command("small", "small steps: the loader loop by how often it reads a loss, next to native (bench/small.py)")
    small_options(sub)
    sub.add_argument("--steps", type=int, default=300, help="timed steps")
    sub.add_argument("--repeat", type=int, default=3, help="rounds, each runner once per round (medians)")
    sub.add_argument("--compiled", action="store_true", help="each read also over a compiled graph")
    sub = command("paired", "small steps with native and raydist alive side by side, taking turns in short "
                            "chunks: ratios within one spell of the machine (bench/paired.py)")  # fmt: skip
    small_options(sub)
    sub.add_argument("--rounds", type=int, default=10, help="rounds, each runner one chunk per round (medians)")
    sub.add_argument("--seconds", type=float, default=1.0, help="about how long native's chunk of steps takes")
    sub.add_argument("--record-off", action="store_true",
                     help="also a raydist model whose ranks keep no step record and export no metrics")  # fmt: skip
    sub = command("profile", "where rank 0's time goes in a loop of small steps, next to native (bench/profile.py)")
    sub.add_argument("--models", default="mlp-mp2", help="comma-separated")
    sub.add_argument("--seconds", type=int, default=20, help="how long py-spy samples each loop")
    sub.add_argument("--every", type=int, default=0, help="read a loss every this many steps (0: never)")
    sub = command("timeline", "a run's timeline drawn, a slow rank in it (bench/timeline.py)")
    sub.add_argument("--models", default="gpt-dp2xmp2", help="one model")
    sub.add_argument("--steps", type=int, default=30, help="steps on the picture")
    sub.add_argument("--warmup", type=int, default=40, help="steps before them")
    sub.add_argument("--slow-rank", type=int, default=1, help="the rank slowed (-1: none)")
    sub.add_argument("--slow-ms", type=float, default=20.0, help="how much slower each of its steps is")
    sub.add_argument("--out", default="docs/timeline.png", help="the picture (its trace beside it, .json)")
    sub = command("startup", "where a model's start goes (bench/startup.py)")
    sub.add_argument("--models", default="mlp-mp2", help="comma-separated")
    sub.add_argument("--repeat", type=int, default=2, help="models started one after another")
    return top


def parse(argv) -> argparse.Namespace:
    """The options of ``python -m bench`` + ``argv``; no COMMAND (options only, or none) is ``models``."""
    argv = list(argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["models", *argv]
    return parser().parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    DISPATCH[0] = getattr(args, "dispatch", "auto")

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.what == "resume":  # a head of its own
        from bench.outlive import resume_table

        table = resume_table(args.models.split(","), args.steps, args.every, args.kill_after, args.repeat)
        _write(args, argv, table)
        return
    if args.what == "attach":  # a head of its own
        from bench.outlive import attach_table

        table = attach_table(args.models.split(","), args.steps, args.before, args.repeat)
        _write(args, argv, table)
        return
    if args.what == "elastic":  # clusters of its own
        from bench.elastic import elastic_table

        table = elastic_table(args.models.split(","), args.steps, args.repeat)
        _write(args, argv, table)
        return
    ray.init(num_cpus=_ray_cpus(args), include_dashboard=False, log_to_driver=False)
    try:
        if args.what == "dispatch":
            from bench.dispatch import dispatch_table

            table = dispatch_table(args.ranks, args.steps, args.warmup, args.repeat, args.paths.split(","))
        elif args.what == "restart":
            from bench.restart import restart_table

            table = restart_table(args.models.split(","), args.repeat)
        elif args.what == "startup":
            from bench.startup import startup_table

            table = "\n\n".join(startup_table(args.repeat, n) for n in args.models.split(","))
        elif args.what == "saves":
            from bench.saves import saves_table

            table = saves_table(args.models.split(","), args.steps, args.every, args.repeat)
        elif args.what == "small":
            from bench.small import small_table

            table = small_table(args.models.split(","), args.steps, args.warmup, args.repeat, args.reads.split(","),
                                args.compiled)  # fmt: skip
        elif args.what == "paired":
            from bench.paired import paired_table

            table = paired_table(args.models.split(","), args.rounds, args.seconds, args.warmup,
                                 args.reads.split(","), args.record_off)  # fmt: skip
        elif args.what == "profile":
            from bench.profile import profile_table

            table = profile_table(args.models.split(","), args.seconds, args.every)
        elif args.what == "timeline":
            from bench.timeline import timeline_table

            table = timeline_table(args.models, args.steps, args.warmup, None if args.slow_rank < 0 else args.slow_rank,
                                   args.slow_ms, args.out)  # fmt: skip
        elif args.what == "pipeline":
            from bench.pipeline import pipeline_table

            table = pipeline_table(args.steps, args.warmup, args.repeat)
        else:
            table = models_table(args)
    finally:
        ray.shutdown()
    _write(args, argv, table)


def _ray_cpus(args) -> int:
    """Logical CPUs of the bench's local Ray. ``small``, ``paired`` and ``profile`` get what raydist would
    start for their largest model (what a user gets), times the models ``paired`` keeps alive: more would let Ray Data start a worker process per
    logical CPU, whose idle polling takes CPU from every runner alike. The other commands start
    groups of many light ranks, so 32."""
    if args.what in ("small", "paired", "profile"):
        from bench.models import world_size
        from raydist.driver.connect import local_num_cpus

        alive = 1  # raydist models alive at once: paired keeps one more with each extra runner
        if args.what == "paired":
            alive += args.record_off + ("every step" in args.reads.split(","))
        return local_num_cpus(alive * max(world_size(n) for n in args.models.split(",")), 1)
    return max(32, os.cpu_count() or 1)


def _write(args, argv, table: str) -> None:
    print(table)
    if not args.no_write:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        with open(ROOT / "BENCHMARKS.md", "a") as f:
            steps = (f"py-spy on rank 0 for {args.seconds:g} s of each loop, {RATE_NOTE}" if args.what == "profile"
                     else f"{args.steps} steps per run, {args.repeat} run(s) of each kind, medians"
                     if args.what in ("elastic", "resume", "saves", "attach")
                     else "models started one after another" if args.what == "startup"
                     else "kill to next step, medians" if args.what == "restart"
                     else f"{args.rounds} rounds of chunks of about {args.seconds:g} s, medians"
                     if args.what == "paired"
                     else f"{args.steps} timed steps after {args.warmup} warm-up steps"
                     + (f", {args.repeat} interleaved rounds, medians" if args.what == "small" else ""))
            dispatch = f"; dispatch {args.dispatch}" if hasattr(args, "dispatch") else ""
            f.write(f"\n### {stamp}: `python -m bench {shlex.join(argv)}`\n\n{machine()}; {steps}{dispatch}."
                    f"\n\n{table}\n")  # fmt: skip


if __name__ == "__main__":
    main()
