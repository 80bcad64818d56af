"""Helpers the test modules share: datasets, learning-rate schedules, waiting for processes.

Test modules import from here, from `models` (models and the one-process reference)
and from `faults` (faults injected into rank processes), never from each other.
"""

from __future__ import annotations

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
