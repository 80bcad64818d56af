"""Where a rank's time goes in a loop of small steps: py-spy samples of rank 0, grouped.

    python -m bench profile [--models mlp-mp2] [--seconds 20] [--every 0]

Runs raydist's loader loop (``for batch in loader(): dm(x, y)``, a loss read every
``--every`` steps, 0: never) and, beside it, native Paddle fed one batch (bench/native.py,
"ideal"), one after the other. Samples every thread of rank 0's process with py-spy for
``--seconds`` (100 per second, idle threads left out), and reports each part's thread time per
step: its samples over the rate, over the steps the loop made meanwhile. The parts are told
apart by the functions on each sampled stack (`part`). py-spy counts a thread that waits for a
core as busy, so over the same seconds it also reads each thread's CPU time from
``/proc/<pid>/task`` (what the thread ran), grouped by thread (`THREADS`, named from one
``py-spy dump``). Needs ``py-spy`` (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import collections
import json
import subprocess
import tempfile
import threading
import time

RATE = 100  # samples per second

# (part, any of these on the stack), first match wins: from the innermost kinds outward
PARTS = [
    ("Paddle: feeding a step's batch (checks, set_feed_variable)", ("_pir_feed_data",)),
    ("Paddle: fetched values to numpy", ("as_numpy",)),
    ("Paddle: the interpreter's run (C++, the step's compute and collectives)", ("_StandaloneExecutor.run", "Prepared.__call__")),
    ("Paddle: Executor.run's bookkeeping (cache key, checks, flags)", ("Executor.run", "Executor._run_pir_impl")),
    ("Paddle: DistModel.__call__ and the engine around the run (native)", ("DistModel.__call__", "Engine.run")),
    ("raydist: the reader's ray.put of a chunk", ("Worker.put_object",)),
    ("raydist: the reader's hand-out calls to its group", ("ActorMethod.remote",)),
    ("raydist: staging batches as DenseTensors", ("Staging.put",)),
    ("Ray Data: reading the split (iterator, format conversion)", ("ray/data/",)),
    ("raydist: the rank's step loop (batch take, schedule, results)", ("ModelService.run", "RankActor.run")),
    ("Ray: receiving and running actor tasks (arguments, results)", ("Worker.main_loop", "actor_method_executor",
                                                                      "deserialize_objects", "serialize")),
]  # fmt: skip
OTHER = "other (Python threads waiting on locks, and the rest)"


def part(stack: str) -> str:
    for name, markers in PARTS:
        if any(m in stack for m in markers):
            return name
    return OTHER


# (kind of thread, any of these in its name and stack at the dump), first match wins
THREADS = [
    ("the thread that runs the steps", ("RankActor.run", "bench/native.py")),
    ("raydist's reader", ("raydist-reader",)),
    ("Ray Data's iterator thread", ("iter_threaded",)),
    ("Ray's other Python threads (its main loop, other calls: data hand-outs, pings)",
     ("Dummy-", "ThreadPoolExecutor", "Worker.main_loop")),
    ("threads without Python: Paddle's executor pool, gloo, Ray's C++", ("(no Python)",)),
]  # fmt: skip
OTHER_THREADS = "other threads"


def thread_kinds(pid: int, dumps: int = 20) -> dict[int, str]:
    """Each thread of ``pid`` (os thread id): its kind in `THREADS`, from ``py-spy dump``s.

    A thread takes the first kind any dump shows it as. Dumps go on until one shows the thread
    that runs the steps inside a step (at most ``dumps``): between two messages it waits in
    Ray's code, and one dump would file it with Ray's threads.
    """
    kind_of: dict[int, int] = {}  # thread -> index in THREADS (len: none)
    for _ in range(dumps):
        for tid, label in _dump(pid).items():
            found = next((i for i, (_, marks) in enumerate(THREADS) if any(m in label for m in marks)), len(THREADS))
            kind_of[tid] = min(found, kind_of.get(tid, len(THREADS)))
        if 0 in kind_of.values():
            break
    named = {tid: THREADS[i][0] if i < len(THREADS) else OTHER_THREADS for tid, i in kind_of.items()}
    return {tid: named.get(tid, THREADS[-1][0]) for tid in thread_cpu(pid)}


def _dump(pid: int) -> dict[int, str]:
    """One ``py-spy dump`` of ``pid``: each thread's name and stack, as one line."""
    for attempt in range(5):  # --nonblocking reads a running process: a read can catch it mid-change and fail
        dump = subprocess.run(["py-spy", "dump", "--pid", str(pid), "--json", "--nonblocking"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        if dump.returncode == 0:
            break
    else:
        raise RuntimeError(f"py-spy dump of {pid} failed 5 times: {dump.stderr[-2000:]}")
    return {int(t["os_thread_id"]): f"{t.get('thread_name') or ''}: " + ";".join(
        f"{f['name']} ({f['filename']})" for f in t.get("frames") or []) for t in json.loads(dump.stdout)}


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) each thread of ``pid`` has run so far (``/proc/<pid>/task``, via psutil)."""
    import psutil

    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def measured(pid: int, seconds: float) -> tuple[collections.Counter, collections.Counter]:
    """py-spy's thread-seconds by part (`record`) and, over the same seconds, CPU seconds by kind of thread."""
    kinds = thread_kinds(pid)
    before = thread_cpu(pid)
    counts = record(pid, seconds)
    cpu: collections.Counter = collections.Counter()
    for tid, total in thread_cpu(pid).items():
        cpu[kinds.get(tid, OTHER_THREADS)] += total - before.get(tid, 0.0)
    return counts, cpu


def record(pid: int, seconds: float) -> collections.Counter:
    """Thread-seconds by part of ``pid``'s threads over ``seconds``."""
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        subprocess.run(["py-spy", "record", "-p", str(pid), "-d", str(round(seconds)), "-r", str(RATE), "-f", "raw",
                        "-o", out.name, "--nonblocking"], check=True, capture_output=True, timeout=seconds + 60)  # fmt: skip
        counts: collections.Counter = collections.Counter()
        for line in open(out.name):
            stack, n = line.rstrip().rsplit(" ", 1)
            counts[part(stack)] += int(n) / RATE
    return counts


def raydist_loop(name: str, seconds: float, every: int) -> tuple[collections.Counter, collections.Counter, int]:

    from bench.common import bench_loader, memory_dataset, raydist_model
    from raydist.testing import on_ranks

    loader = bench_loader(name, memory_dataset(name, 20_000))
    done, stop = [0], threading.Event()
    with raydist_model(name, loader) as dm:
        def loop():
            for i, batch in enumerate(loader()):
                loss = dm(batch["x"], batch["y"])
                if every and (i + 1) % every == 0:
                    float(loss)
                done[0] = i + 1
                if stop.is_set():
                    break
            dm.wait()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        while done[0] < 200:  # built and warm
            time.sleep(0.1)
        pid = dm.ranks[0].pid
        on_ranks(dm, lambda rank: rank.model.take_starts(), [0])
        counts, cpu = measured(pid, seconds)
        made = len(on_ranks(dm, lambda rank: rank.model.take_starts(), [0])[0])  # steps started
        stop.set()
        thread.join()
    return counts, cpu, made


def native_loop(name: str, seconds: float) -> tuple[collections.Counter, collections.Counter, int]:
    """Native, ideal feed: enough steps to outlast the recording; rank 0 recorded."""
    from bench.common import start_native

    steps = int(seconds * 2000)  # more than it makes in twice the recording, at 1 ms a step
    procs = start_native(name, ["200", str(steps), "ideal"], env={"RAYDIST_BENCH_PROGRESS": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        # bench.native prints "STEP n time" every 100 steps with RAYDIST_BENCH_PROGRESS
        for line in procs[0].stdout:
            if line.startswith("STEP ") and int(line.split()[1]) >= 200:
                break
        start = time.time()
        counts, cpu = measured(procs[0].pid, seconds)
        end = time.time()
        marks = []
        for line in procs[0].stdout:  # the steps' times from the recording's start to its end
            if line.startswith("STEP "):
                n, t = line.split()[1:3]
                marks.append((float(t), int(n)))
                if float(t) >= end:
                    break
        inside = [(t, n) for t, n in marks if start <= t <= end]
        (t0, n0), (t1, n1) = inside[0], inside[-1]
        return counts, cpu, round((n1 - n0) / (t1 - t0) * seconds)  # its pace inside the recording, over it
    finally:
        for p in procs:
            p.kill()
            p.wait()


def profile_table(names: list[str], seconds: float, every: int) -> str:
    rows, cpu_rows = [], []
    for name in names:
        native, native_cpu, native_steps = native_loop(name, seconds)
        ours, our_cpu, our_steps = raydist_loop(name, seconds, every)
        for label in [k for k, _ in THREADS] + [OTHER_THREADS, None]:
            a, b = ((sum(c.values()) if label is None else c[label]) for c in (native_cpu, our_cpu))
            a, b = 1e3 * a / max(native_steps, 1), 1e3 * b / max(our_steps, 1)
            if a or b:
                kind = "**all of rank 0's threads**" if label is None else label
                cpu_rows.append(f"| {name} | {kind} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
        for label in [p for p, _ in PARTS] + [OTHER]:
            a = 1e3 * native[label] / max(native_steps, 1)
            b = 1e3 * ours[label] / max(our_steps, 1)
            if a or b:
                rows.append(f"| {name} | {label} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
        a, b = 1e3 * sum(native.values()) / native_steps, 1e3 * sum(ours.values()) / our_steps
        rows.append(f"| {name} | **all of rank 0's threads** | **{a:.2f}** | **{b:.2f}** | **{b - a:+.2f}** |")
        rows.append(f"| {name} | wall time per step (ms) | {1e3 * seconds / native_steps:.2f} "
                    f"| {1e3 * seconds / our_steps:.2f} | |")  # fmt: skip
        print("\n".join(rows[-3:]), flush=True)
    loop = f"raydist loader, loss read {'never' if not every else f'every {every}'}"
    header = (f"| model | part of rank 0's process | native, ideal feed (thread ms per step) | {loop} (thread ms per "
              "step) | difference |")  # fmt: skip
    cpu_header = (f"| model | rank 0's threads, by kind | native, ideal feed (CPU ms per step) | {loop} (CPU ms per "
                  "step) | difference |")  # fmt: skip
    return "\n".join([header, "|---|---|---:|---:|---:|", *rows, "", "CPU time, from /proc, over the same seconds:", "",
                      cpu_header, "|---|---|---:|---:|---:|", *cpu_rows])  # fmt: skip
