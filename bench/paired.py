"""Small steps, paired: native and raydist alive side by side, taking turns in short chunks.

    python -m bench paired [--models mlp-mp2,wide-mp2] [--rounds 10] [--seconds 1]

This machine's speed drifts by up to 2x over minutes, with little CPU stolen: the same native
step took 98 ms of CPU in one run and 215 ms in another. Runs minutes apart then compare spells,
not runners. Here every runner is started once and kept warm, and in each round each runner
takes one chunk of steps (about ``--seconds`` of native's) in turn, the order rotating:
- *native, ideal*, *native, DataLoader* and *native, batches held in memory* (what feeding a
  different batch each step costs by itself): bench/native.py's ranks (``--chunked``), which
  run N steps at each line "N" on their stdin and block on it in between;
- *raydist, loss read never / every 10 / every step*: ONE raydist model, its loader loop
  (``for batch in loader(): dm(x, y)``) going on chunk after chunk; a chunk ends with
  ``dm.wait()``;
- *Ray*: an actor call to each of 2 actors that do nothing; with "every step" read, also to 2
  actors that sleep for native's step (timed once at the start) and return: the floor of a
  read every step through actor calls, whose round trip grows when the call takes a while
  (the waiting threads, the driver's and Ray's, go to sleep and must be woken);
- with ``--dynamic``, *native eager* (bench/native.py ``--eager``: the same layer run eagerly,
  ``loss.backward()`` and ``optimizer.step()`` on ``shard_dataloader``'s dist tensors, the first
  batch fed again as *ideal* does) and *raydist dynamic* (``to_static(..., dynamic=True)``, the
  loss read every 10 steps): what running eagerly costs, natively and through raydist;
- with "every step" read, a second raydist model whose ranks run a program's ops on Paddle's
  pool of threads, as Paddle does by default (raydist's CPU ranks run them on the step's thread:
  `raydist.env.executor_flags`).
A runner's ratio is its chunk's step over the native ideal chunk's of the same round, and the
table reports the median over the rounds and their range; one warm-up round is left out. Rank
CPU per step is each rank process's (all its threads), read with psutil by this process.
Native's chunks run beside a live, idle Ray and raydist's idle ranks, as raydist's do beside
native's idle processes: on this machine an idle local Ray costs a native run about 2.5 %.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

from bench.common import machine_cpu
from raydist.worker.steplog import RECORD_ENV
from bench.small import EVERY, rotated


def _process_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread) of the processes ``pids``, their mean."""
    import psutil

    return statistics.fmean(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def _timed(pids: list[int], steps: int, run: Callable[[], None]) -> dict:
    """One chunk: ``run()`` (``steps`` steps) timed, with the CPU ``pids`` and the machine spent."""
    cpu, machine = _process_cpu(pids), machine_cpu()
    t = time.perf_counter()
    run()
    wall = time.perf_counter() - t
    after = machine_cpu()
    return {"step": wall / steps, "rank_cpu": (_process_cpu(pids) - cpu) / steps,
            "steal": (after[1] - machine[1]) / steps}  # fmt: skip


class Native:
    """bench/native.py's ranks, warm, running N steps whenever told."""

    def __init__(self, name: str, warmup: int, feed: str, eager: bool = False):
        from bench.common import start_native

        self._log = tempfile.TemporaryFile("w+")  # not a pipe: nobody reads it until a rank fails
        flags = ["--chunked"] + (["--eager"] if eager else [])
        self.procs = start_native(name, [str(warmup), "64", feed, *flags], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self._log, bufsize=1)  # fmt: skip
        self._expect("READY")

    def _expect(self, word: str) -> None:
        for p in self.procs:
            for line in p.stdout:
                if line.strip() == word:
                    break
            else:
                self._log.seek(0)
                raise RuntimeError(f"a native rank exited (code {p.wait()}):\n{self._log.read()[-3000:]}")

    def chunk(self, steps: int) -> dict:
        def run():
            for p in self.procs:
                p.stdin.write(f"{steps}\n")
                p.stdin.flush()
            self._expect("CHUNK")

        return _timed([p.pid for p in self.procs], steps, run)

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._log.close()


class Raydist:
    """One raydist model through its loader, the loop going on chunk after chunk."""

    def __init__(self, name: str, warmup: int, total_steps: int, env_vars: dict | None = None,
                 dynamic: bool = False):  # fmt: skip
        from bench.common import raydist_model, bench_loader, memory_dataset

        loader = bench_loader(name, memory_dataset(name, warmup + total_steps))
        self.dm = raydist_model(name, loader, env_vars=env_vars, dynamic=dynamic)
        self._batches = iter(loader())
        self.pids = [r.pid for r in self.dm.ranks]
        for _ in range(warmup):
            self.dm(*self._next())
        self.dm.wait()

    def _next(self):
        batch = next(self._batches)
        return batch["x"], batch["y"]

    def chunk(self, steps: int, every: int) -> dict:
        def run():
            for i in range(1, steps + 1):
                loss = self.dm(*self._next())
                if every and i % every == 0:
                    float(loss)
            self.dm.wait()

        return _timed(self.pids, steps, run)

    def close(self) -> None:
        self.dm.shutdown()


class RayFloor:
    """2 Ray actors that do nothing but wait ``hold_s``, an actor call to each per step."""

    def __init__(self, hold_s: float = 0.0):
        import ray

        @ray.remote(num_cpus=0)
        class Idle:
            def step(self, number: int, hold_s: float) -> float:
                if hold_s:
                    time.sleep(hold_s)
                return 0.0

            def pid(self) -> int:
                return os.getpid()

        self.hold_s = hold_s
        self.actors = [Idle.remote(), Idle.remote()]
        self.pids = ray.get([a.pid.remote() for a in self.actors])

    def chunk(self, steps: int) -> dict:
        import ray

        def run():
            for i in range(steps):
                ray.get([a.step.remote(i, self.hold_s) for a in self.actors])

        return _timed(self.pids, steps, run)

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)


FLOOR = "Ray: an actor call to each of 2 actors that do nothing"
FLOOR_HELD = "Ray: an actor call to each of 2 actors that sleep for a native step ({ms:.2f} ms) and return"
POOL = "raydist, loss read every step, ops on Paddle's pool of threads (FLAGS_new_executor_serial_run=0)"
NATIVE_EAGER = "native eager (dygraph auto-parallel), ideal"
DYNAMIC = "raydist dynamic (dynamic=True), loss read every 10"
UNRECORDED = "raydist, loss read never, no step record and no metrics (RAYDIST_RECORD=0)"


def chunk_steps(seconds: float, step: float, every: list[int]) -> int:
    """Steps per chunk: about ``seconds`` of ``step``, a multiple of 10 and of every read interval."""
    unit = max([10, *every])
    return max(unit, int(round(seconds / step / unit)) * unit)


def paired_rows(name: str, rounds: int, seconds: float, warmup: int, reads: list[str],
                record_off: bool = False, dynamic: bool = False) -> list[str]:  # fmt: skip
    ideal = Native(name, warmup, "ideal")
    opened = [ideal]
    try:
        ideal.chunk(10)
        steps = chunk_steps(seconds, ideal.chunk(10)["step"], [EVERY[r] for r in reads])
        print(f"{name}: {steps} steps per chunk", flush=True)
        loader = Native(name, warmup, "loader")
        opened.append(loader)
        held = Native(name, warmup, "batches")
        opened.append(held)
        ours = Raydist(name, warmup, (rounds + 1) * len(reads) * steps)
        opened.append(ours)
        floor = RayFloor()
        opened.append(floor)
        runners = {"native, ideal": lambda: ideal.chunk(steps),
                   "native, DataLoader": lambda: loader.chunk(steps),
                   "native, batches held in memory, a different one each step": lambda: held.chunk(steps)}  # fmt: skip
        for read in reads:
            runners[f"raydist, loss read {read}"] = lambda every=EVERY[read]: ours.chunk(steps, every)
        if record_off:  # what the step record and the metrics cost (raydist.worker.steplog)
            unrecorded = Raydist(name, warmup, (rounds + 1) * steps, {RECORD_ENV: "0"})
            opened.append(unrecorded)
            runners[UNRECORDED] = lambda: unrecorded.chunk(steps, 0)
        if "every step" in reads:  # what running a program's ops on the step's thread saves (raydist.env)
            pool = Raydist(name, warmup, (rounds + 1) * steps, {"FLAGS_new_executor_serial_run": "0"})
            opened.append(pool)
            runners[POOL] = lambda: pool.chunk(steps, 1)
        if dynamic:  # eager steps, natively and through raydist (raydist.worker.eager)
            eager = Native(name, warmup, "ideal", eager=True)
            opened.append(eager)
            runners[NATIVE_EAGER] = lambda: eager.chunk(steps)
            ours_eager = Raydist(name, warmup, (rounds + 1) * steps, dynamic=True)
            opened.append(ours_eager)
            runners[DYNAMIC] = lambda: ours_eager.chunk(steps, 10)
        runners[FLOOR] = lambda: floor.chunk(steps)
        if "every step" in reads:  # a call that takes a step's time: Ray's threads sleep while they wait
            held_floor = RayFloor(native_step := ideal.chunk(steps)["step"])
            opened.append(held_floor)
            runners[FLOOR_HELD.format(ms=1e3 * native_step)] = lambda: held_floor.chunk(steps)
        chunks: dict[str, list[dict]] = {label: [] for label in runners}
        for round_ in range(rounds + 1):
            got = {label: runners[label]() for label in rotated(list(runners), round_)}
            if round_:  # round 0 warms every runner's chunk path
                for label, c in got.items():
                    chunks[label].append(c)
    finally:
        for runner in reversed(opened):
            runner.close()
    return table_rows(name, chunks)


def table_rows(name: str, chunks: dict[str, list[dict]]) -> list[str]:
    """One row per runner: medians over the rounds, ratios taken round by round."""
    med = statistics.median
    rows = []
    for label, cs in chunks.items():
        ratio = sorted(c["step"] / i["step"] for c, i in zip(cs, chunks["native, ideal"]))
        by_loader = med(c["step"] / n["step"] for c, n in zip(cs, chunks["native, DataLoader"]))
        cpu = med(c["rank_cpu"] / i["rank_cpu"] for c, i in zip(cs, chunks["native, ideal"]))
        rows.append(f"| {name} | {label} | {1e3 * med(c['step'] for c in cs):.2f} | {med(ratio):.2f} "
                    f"| {ratio[0]:.2f}-{ratio[-1]:.2f} | {by_loader:.2f} | {1e3 * med(c['rank_cpu'] for c in cs):.2f} "
                    f"| {cpu:.2f} | {1e3 * med(c['steal'] for c in cs):.2f} |")  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def paired_table(names: list[str], rounds: int, seconds: float, warmup: int, reads: list[str],
                 record_off: bool = False, dynamic: bool = False) -> str:  # fmt: skip
    rows = [row for name in names for row in paired_rows(name, rounds, seconds, warmup, reads, record_off, dynamic)]
    header = ("| model | runner | step (ms) | x native ideal, same round | rounds' range | x native DataLoader "
              "| rank CPU per step (ms) | x native ideal's rank CPU | stolen per step (ms) |")  # fmt: skip
    return "\n".join([header, "|---|---|---:|---:|---:|---:|---:|---:|---:|", *rows])
