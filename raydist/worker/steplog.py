"""What a rank did, step by step: the run's timeline (`raydist.DistModel.timeline`) and its Ray metrics.

Each step the rank runs adds one record: its number, mode, and three readings of
``time.monotonic_ns``: when the step began waiting for its batch (a loader's; a
driver batch is there already), when it had it, and when the step (forward,
backward and update, as one program) ended. That is three clock reads and a
tuple appended to a bounded deque, a microsecond or two (BENCHMARKS.md, "The
step record's cost"). On CPU the collectives inside a step are raydist's own ops
(`raydist.compat.collectives`), which log their spans natively; a step's
collective time is read from there when it is asked for, not per step.

`Exporter` turns the records into Ray metrics every `EXPORT_S`, from a thread
of its own, off the step's path.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

KEEP_STEPS = 2048  # steps a rank keeps for the timeline
EXPORT_S = 5.0  # how often a rank exports its metrics
RECORD_ENV = "RAYDIST_RECORD"  # "0" in a rank's environment: no record, no metrics (to measure their cost)


class StepLog:
    """The last `KEEP_STEPS` steps of one rank, and running totals for the metrics."""

    def __init__(self, keep: int = KEEP_STEPS):
        self.steps: collections.deque = collections.deque(maxlen=keep)  # (number, mode, asked, fed, ended)
        self.count = 0  # steps ever added
        self.data_ns = 0  # waiting for batches, over them all
        self.step_ns = 0  # running steps, over them all

    def add(self, number: int, mode: str, asked: int, fed: int, ended: int) -> None:
        self.steps.append((number, mode, asked, fed, ended))
        self.count += 1
        self.data_ns += fed - asked
        self.step_ns += ended - fed

    def recent(self, steps: int | None = None) -> dict[str, Any]:
        """The last ``steps`` steps (all kept: None), the collectives that ran from the first of
        them on, and this rank's clock now (ns)."""
        from ..compat.collectives import COMM_KINDS, comm_records

        kept = list(self.steps)
        if steps is not None:
            kept = kept[-steps:] if steps > 0 else []
        comms, _ = comm_records()
        if kept:
            comms = comms[comms[:, 1] >= kept[0][2]]
        else:
            comms = comms[:0]
        return {"steps": kept, "comms": [(int(s), int(e), COMM_KINDS[int(k)], int(r)) for _, s, e, k, r, _ in comms],
                "now": time.monotonic_ns()}  # fmt: skip


class Unrecorded(StepLog):
    """A rank that keeps no record (`RECORD_ENV`): its timeline is empty."""

    def add(self, number: int, mode: str, asked: int, fed: int, ended: int) -> None:
        pass


class Exporter:
    """Every `EXPORT_S`, a rank's `StepLog` as Ray metrics, tagged with the model and rank:
    ``raydist_rank_steps`` (a counter), ``raydist_rank_seconds`` (a counter of seconds per
    part: data_wait, step, collectives) and ``raydist_rank_step_time_seconds`` (a gauge: the
    mean of each part over the last interval's steps)."""

    def __init__(self, log: StepLog, model: str, rank: int):
        self.log, self.tags = log, {"model": model, "rank": str(rank)}
        self.exported = 0  # intervals exported so far
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raydist-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ray.util import metrics

        from ..compat.collectives import comm_records

        steps = metrics.Counter("raydist_rank_steps", "Steps a rank ran", tag_keys=("model", "rank"))
        seconds = metrics.Counter("raydist_rank_seconds", "Seconds a rank spent, by part of its steps",
                                  tag_keys=("model", "rank", "part"))  # fmt: skip
        mean = metrics.Gauge("raydist_rank_step_time_seconds", "A rank's mean step time over the last interval, "
                             "by part", tag_keys=("model", "rank", "part"))  # fmt: skip
        count, data_ns, step_ns, comm_from = 0, 0, 0, comm_records()[1]
        while not self._stopped.wait(EXPORT_S):
            log = self.log
            new, data, step = log.count - count, log.data_ns - data_ns, log.step_ns - step_ns
            count, data_ns, step_ns = log.count, log.data_ns, log.step_ns
            comms, comm_from = comm_records(comm_from)
            comm = int((comms[:, 2] - comms[:, 1]).sum()) if len(comms) else 0
            if not new:
                continue
            steps.inc(new, tags=self.tags)
            for part, ns in (("data_wait", data), ("step", step), ("collectives", comm)):
                if ns > 0:  # a Counter refuses 0 (driver batches never wait for data)
                    seconds.inc(ns / 1e9, tags={**self.tags, "part": part})
                mean.set(ns / 1e9 / new, tags={**self.tags, "part": part})
            self.exported += 1

    def stop(self) -> None:
        self._stopped.set()
