"""Helpers the test modules share: datasets, learning-rate schedules, waiting for processes.

Test modules import from here, from `models` (models and the one-process reference)
and from `faults` (faults injected into rank processes), never from each other.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import paddle
import paddle.distributed as dist
import ray

from models import IN, OUT

# -- rank processes ------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids, timeout: float = 20.0) -> None:
    """Wait until every process of ``pids`` has exited; AssertionError naming those still alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return
        time.sleep(0.2)
    raise AssertionError(f"rank processes still alive: {left}")


# -- data ---------------------------------------------------------------------------------

N = 70  # rows of `dataset`: 35 per dp group of `DPMP_MESH`, 8 steps of 4 per group, 3 rows of each dropped
DPMP_MESH = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


def wait_blocked(pid: int, timeout: float = 30.0, quiet_s: float = 0.1) -> None:
    """Until the main thread of process ``pid`` is asleep in the kernel and has used no CPU for
    ``quiet_s`` (a rank waiting in a collective or a pipeline receive), from /proc."""
    stat = f"/proc/{pid}/task/{pid}/stat"
    deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < deadline:
        fields = open(stat).read().rsplit(")", 1)[1].split()
        state, cpu = fields[0], int(fields[11]) + int(fields[12])  # state; utime + stime
        now = time.monotonic()
        if state != "S" or cpu != last:
            last, since = cpu, now
        elif now - since >= quiet_s:
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not block within {timeout} s")


def rows(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows (x, y) of the MLP's shapes, the same in every process."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(n, IN).astype("float32"), rng.randn(n, OUT).astype("float32")
    return x, y


def dataset(n: int = N, blocks: int = 5) -> ray.data.Dataset:
    """`rows` as a Ray Dataset of dict rows {"id", "x", "y", "tag"} ("tag" = id + [0, .25, .5, .75])."""
    x, y = rows(n)
    items = [{"id": i, "x": x[i], "y": y[i], "tag": i + np.arange(4, dtype="float32") / 4} for i in range(n)]
    return ray.data.from_items(items, override_num_blocks=blocks)


class Pairs(paddle.io.Dataset):
    """Tuple rows (x, y) of `rows`, as paddle.io.Dataset users write them."""

    def __init__(self, n):
        self.x, self.y = rows(n)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


class Poisoned(Pairs):
    """Reading row 30 raises."""

    def __getitem__(self, i):
        if i == 30:
            raise ValueError("row 30 is poisoned on purpose")
        return super().__getitem__(i)


class KillOnce(Pairs):
    """Kills the process that reads row ``row``, the first time only (a marker file remembers)."""

    def __init__(self, n, row, marker):
        super().__init__(n)
        self.row, self.marker = row, marker

    def __getitem__(self, i):
        if i == self.row and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


# -- learning-rate schedules ------------------------------------------------------------


def schedule(kind: str):
    """A fresh scheduler of ``kind`` (each optimizer gets its own, as each rank does)."""
    lr = paddle.optimizer.lr
    if kind == "step":
        return lr.StepDecay(0.1, step_size=2, gamma=0.5)
    if kind == "warmup-cosine":
        return lr.LinearWarmup(lr.CosineAnnealingDecay(0.1, T_max=6), warmup_steps=3, start_lr=0.0, end_lr=0.1)
    if kind == "plateau":
        return lr.ReduceOnPlateau(0.1, patience=0, factor=0.5)
    raise ValueError(kind)


def scheduled_sgd(kind: str):
    return lambda params: paddle.optimizer.SGD(learning_rate=schedule(kind), parameters=params)


def one_process_losses(epochs: int, rows: int = 48, batch_size: int = 8, shards: int = 2, seed: int = 3):
    """The losses and final parameters of one plain process trained as the resumable runs train
    (tests/resumable.py, tests/test_resume.py): `Pairs` shuffled with ``seed`` in ``shards`` data
    shards, SGD with a step-decay schedule stepped every step."""
    from models import Reference, global_batches

    ref, expected = Reference(scheduled_sgd("step")), []
    for epoch in range(epochs):
        for x, y in zip(*global_batches(Pairs(rows), batch_size, shards, epoch, shuffle=True, seed=seed)):
            expected.append(ref.train(x, y))
            ref.opt._learning_rate.step()
    return expected, ref.params()


# -- driver processes -----------------------------------------------------------------------


def said(process, word: str) -> str:
    """The rest of the next line ``process`` (a Popen with text stdout) prints that starts with
    ``word``; an AssertionError with all it printed if it ends first. Every line it read is kept
    in ``process.printed``."""
    if not hasattr(process, "printed"):
        process.printed = []
    for line in process.stdout:
        process.printed.append(line)
        if line.startswith(word + " ") or line.rstrip() == word:
            return line[len(word) :].strip()
    raise AssertionError(f"the process ended without saying {word!r}:\n{''.join(process.printed)[-4000:]}")


def said_all(process, words: list[str]) -> None:
    """Wait until ``process`` has said each of ``words`` (`said`), in any order."""
    if not hasattr(process, "printed"):
        process.printed = []
    left = set(words)
    for line in process.stdout:
        process.printed.append(line)
        left = {w for w in left if not line.startswith(w)}
        if not left:
            return
    raise AssertionError(f"the process ended without saying {left}:\n{''.join(process.printed)[-4000:]}")


def tell(process, line: str = "go") -> None:
    """Write ``line`` to ``process``'s stdin."""
    process.stdin.write(line + "\n")
    process.stdin.flush()


def detached_driver(env: dict, phase: str, out=None):
    """tests/detached.py in a process of its own, at ``phase``, on the cluster ``env`` names."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    return subprocess.Popen([sys.executable, str(here / "detached.py"), phase], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "PYTHONPATH": str(here), "NAME": "outlives", "OUT": str(out or "")})  # fmt: skip


def detached_story(env: dict, tmp_path) -> dict:
    """A detached model's driver SIGKILLed after 5 steps; a new process attaches: the same rank processes,
    in train mode at step 5 with the schedule's value; 5 more steps: the 10 of one process. While it
    holds the model, another is refused (naming it) and an unknown name lists the models; a third takes
    it over: the holder's next call is refused and its shutdown leaves the ranks; the third's shutdown
    ends them. ``env``: the drivers' environment (``RAY_ADDRESS`` names the cluster, or ``ray://``).
    What the attaching driver found (``stands``) and the take-over's event (``took``)."""
    from models import Reference, assert_close, assert_params_equal, batches

    start = detached_driver(env, "start")
    before = json.loads(said(start, "losses"))
    pids = json.loads(said(start, "ranks"))
    start.kill()
    start.wait()

    holder = detached_driver(env, "attach", tmp_path / "after.npz")
    stands = json.loads(said(holder, "stands"))
    assert stands == {"mode": "train", "workers": 2, "step": 5, "lr": 0.025, "ranks": pids, "events": ["attach"]}, \
        stands  # fmt: skip
    said(holder, "holding")
    ref = Reference(scheduled_sgd("step"))
    expected = []
    for x, y in batches(11)[:10]:
        expected.append(ref.train(x, y))
        ref.opt._learning_rate.step()
    after = np.load(tmp_path / "after.npz")
    assert_close(before + list(after["losses"]), expected, what="losses")
    assert_params_equal(after, ref.params())

    probe = detached_driver(env, "probe")
    assert f"is held by the driver with pid {holder.pid} " in said(probe, "held")
    assert "there are: 'outlives'" in said(probe, "lookup")
    assert probe.wait(timeout=120) == 0

    taker = detached_driver(env, "take")
    assert said(taker, "took") == "10"
    (took,) = json.loads(said(taker, "events"))
    assert took["kind"] == "take_over" and took["step"] == 10 and took["model"] == "outlives", took
    assert f"pid {holder.pid} " in took["from"] and f"pid {taker.pid} " in took["holder"], took
    tell(holder)
    assert f"taken over by the driver with pid {taker.pid} " in said(holder, "refused")
    said(holder, "let go")
    assert holder.wait(timeout=120) == 0
    assert all(alive(p) for p in pids)  # the holder's shutdown let go of them: the taker's step runs on them
    tell(taker)
    assert said(taker, "ended") == "[]"
    assert taker.wait(timeout=120) == 0
    wait_gone(pids)
    return {"stands": stands, "took": took}


def seen_env(out: str, ranks: int = 2) -> list[dict]:
    """What each rank of a launch of tests/shows_env.py saw (``out``: the launch's output)."""
    seen = [json.loads(line.split(" env ", 1)[1]) for r in range(ranks) for line in out.splitlines()
            if line.startswith(f"[rank {r}] env ")]  # fmt: skip
    assert len(seen) == ranks, out
    return seen
