"""The driver's cost per step, in isolation, as the group grows, next to Ray's own floor.

Runs raydist's real driver path (``DistModel.__call__``: checks, the step
message, the transport, the window of steps in flight, assembling the loss)
against stand-in ranks that do no Paddle work (`NullRank`), so 8 and 16
ranks fit on 2 cores; and, in the same rounds, Ray alone (`BareRank`: the
same message to every actor, two steps in flight, no raydist), by actor
calls and by a compiled graph. Reports the driver's CPU time per step (the
controller's own cost), the same less what the driver process spends idle
over the step's wall time (Ray's own threads: measured with the group up and
no step running; it grows per step as the steps slow down, which here is when
many stand-ins share 2 cores), the CPU of the driver's main thread alone (where
the driver's Python runs and Ray's calls are made: Ray's own threads, which
send, receive and poll, are left out), the Python and C functions that thread
calls per step (its work, counted in a further pass of as many steps: the
same count costs more CPU on 2 cores shared with many processes), and the
wall time per step (bounded here by the
ranks' and Ray's per-call work on 2 shared cores).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import numpy as np
import ray

import raydist
from raydist.driver.api import model as driver_model
from raydist.driver.cluster.config import GroupConfig
from raydist.messages import BuildReport, StepResults
from raydist.protocol import RankActor
from raydist.topology import Layout, Mesh, ModePlan


class NullRank(RankActor):
    """A rank that answers like one and does no Paddle work: a pure data-parallel mesh."""

    def warm_up(self, quiet, modules=()):
        pass

    def setup(self, env, use_gpu, step_timeout_s=None, group=None):
        self.starts = []
        return []

    def build(self, payload):
        self._mesh = Mesh.of(list(range(self.world_size)), ["dp"])
        return BuildReport([self._mesh], None)

    def set_specs(self, inputs, labels):
        pass

    def state_meta(self, mode="all"):
        return {}

    def set_mode(self, mode):
        plan = ModePlan([Layout(self._mesh, (), ((0, "avg"),))])
        self.collect = self.rank in plan.readers()
        return plan

    def run(self, parcel):
        self.starts.append(time.monotonic())
        return StepResults.of([[np.array(1.0, np.float32)] for _ in parcel.steps]) if self.collect else None


def per_step(ranks: int, steps: int, warmup: int, dispatch: str, batch: int = 64, read: bool = False) -> dict:
    """``read``: read each step's loss before the next (one step per message), as a loop that
    prints or checks it does; else leave the steps in flight."""
    x = np.ones((batch, 16), np.float32)
    y = np.ones((batch, 4), np.float32)
    driver_model.GroupConfig = functools.partial(GroupConfig, actor_class=NullRank)
    try:
        with raydist.to_static(lambda: None, loss=lambda a, b: a, optimizer=lambda p: None, num_workers=ranks,
                               resources_per_rank={"CPU": 0.01}, dispatch=dispatch) as dm:  # fmt: skip
            def step():
                return float(dm(x, y)) if read else dm(x, y)

            for _ in range(warmup):
                step()
            dm.wait()
            idle = idle_cpu_per_s()
            cpu, wall, main = time.process_time(), time.perf_counter(), time.thread_time()
            for _ in range(steps):
                step()
            dispatched = time.process_time() - cpu
            dm.wait()
            cpu, wall, main = time.process_time() - cpu, time.perf_counter() - wall, time.thread_time() - main

            def steps_again():
                for _ in range(steps):
                    step()
                dm.wait()

            calls = python_calls(steps_again) / steps
    finally:
        driver_model.GroupConfig = GroupConfig
    return {"cpu_us": 1e6 * cpu / steps, "dispatch_cpu_us": 1e6 * dispatched / steps, "wall_us": 1e6 * wall / steps,
            "idle_us": 1e6 * idle * wall / steps, "main_us": 1e6 * main / steps, "calls": calls}


def python_calls(run) -> int:
    """The Python and C functions the driver's main thread calls during ``run()``: its work, counted
    the same however busy the machine is (which CPU seconds are not: on 2 cores shared with 64
    processes the same calls take longer)."""
    count = 0

    def counter(frame, event, arg):
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(counter)
    try:
        run()
    finally:
        sys.setprofile(None)
    return count


def idle_cpu_per_s(seconds: float = 1.0) -> float:
    """The driver process's CPU seconds per second while it waits for nothing (Ray's threads)."""
    cpu = time.process_time()
    time.sleep(seconds)
    return (time.process_time() - cpu) / seconds


@ray.remote
class BareRank:
    """Ray alone: an actor that answers a step message and does nothing else."""

    def run(self, message):
        return np.float32(1.0)


def bare_per_step(ranks: int, steps: int, warmup: int, dispatch: str, batch: int = 64,
                  in_flight: int = 2) -> dict:  # fmt: skip
    """Ray's own floor for the same pattern: one message to every actor, ``in_flight`` steps outstanding."""
    message = (np.ones((batch, 16), np.float32), np.ones((batch, 4), np.float32))
    actors = [BareRank.options(num_cpus=0.01).remote() for _ in range(ranks)]
    graph = None
    if dispatch == "compiled":
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:
            graph = MultiOutputNode([a.run.bind(inp) for a in actors]).experimental_compile(
                _max_inflight_executions=in_flight)  # fmt: skip

    def send():
        return graph.execute(message) if graph else [a.run.remote(message) for a in actors]

    def receive(refs):
        return [ray.get(r) for r in refs] if graph else ray.get(refs)

    def run(n):
        pending = []
        for _ in range(n):
            if len(pending) >= in_flight:
                receive(pending.pop(0))
            pending.append(send())
        for refs in pending:
            receive(refs)

    try:
        run(warmup)
        idle = idle_cpu_per_s()
        cpu, wall, main = time.process_time(), time.perf_counter(), time.thread_time()
        run(steps)
        cpu, wall, main = time.process_time() - cpu, time.perf_counter() - wall, time.thread_time() - main
        calls = python_calls(lambda: run(steps)) / steps
    finally:
        if graph is not None:
            graph.teardown()
        for a in actors:
            ray.kill(a)
    return {"cpu_us": 1e6 * cpu / steps, "wall_us": 1e6 * wall / steps, "idle_us": 1e6 * idle * wall / steps,
            "main_us": 1e6 * main / steps, "calls": calls}


PATHS = {  # --paths key: name in the table, per-step function, dispatch
    "ray-calls": ("Ray alone, calls", bare_per_step, "calls"),
    "calls": ("raydist, calls", per_step, "calls"),
    "tree": ("raydist, tree (relayed by the ranks)", per_step, "tree"),
    "tree-read": ("raydist, tree, each loss read", functools.partial(per_step, read=True), "tree"),
    "ray-compiled": ("Ray alone, compiled graph", bare_per_step, "compiled"),
    "compiled": ("raydist, compiled graph", per_step, "compiled"),
}


def dispatch_table(sizes: list[int], steps: int, warmup: int, repeat: int = 3, paths: list[str] | None = None) -> str:
    paths = list(PATHS) if paths is None else paths
    rows = []
    for n in sizes:
        runs: dict[str, list[dict]] = {path: [] for path in paths}
        for _ in range(repeat):  # round-robin, so drifts in the machine's load hit every path alike
            for path in paths:
                _, measure, dispatch = PATHS[path]
                runs[path].append(measure(n, steps, warmup, dispatch))
        for path in paths:
            cpu = statistics.median(r["cpu_us"] for r in runs[path])
            wall = statistics.median(r["wall_us"] for r in runs[path])
            net = statistics.median(r["cpu_us"] - r["idle_us"] for r in runs[path])
            main = statistics.median(r["main_us"] for r in runs[path])
            calls = statistics.median(r["calls"] for r in runs[path])
            rows.append(f"| {PATHS[path][0]} | {n} | {cpu:.0f} | {net:.0f} | {main:.0f} | {calls:.0f} | {cpu / n:.0f} "
                        f"| {wall:.0f} |")  # fmt: skip
            print(rows[-1], flush=True)
    header = ("| path | ranks (stand-ins, no Paddle) | driver CPU per step (µs) | less idle (µs) "
              "| its main thread (µs) | Python calls per step | per rank (µs) | wall per step (µs) |")  # fmt: skip
    return "\n".join([header, "|---|---:|---:|---:|---:|---:|---:|---:|", *rows])
