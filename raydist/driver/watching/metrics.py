"""A model's Ray metrics at the driver (``ray.util.metrics``), tagged with its name.

The ranks export their own step figures (`raydist.worker.steplog.Exporter`); the
driver exports what it knows: the pace, the loss and learning rate where it
reads them (``fit``), the group's size and bounds, the cost of its messages, and
counters of the lifecycle's events (`raydist.driver.watching.events`). Ray serves them to
Prometheus from each node's metrics agent, with a ``ray_`` prefix (README,
"Watching a run").

A driver through Ray Client has no metrics agent of its own: measured here, a
counter it incremented never reached the head's endpoint. Such a driver hands
its updates to a `Relay`, a small actor of its own on the head node (no CPU),
which records them there: one call per `EXPORT_S` at most.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import ray

from ..cluster.state import Outage, on_the_head, through_client

log = logging.getLogger("raydist")

EXPORT_S = 5.0

# name -> (kind, description)
METRICS = {
    "raydist_steps_per_second": ("gauge", "Steps a model completed per second, over the last interval"),
    "raydist_samples_per_second": ("gauge", "Rows of global batches a model trained on per second (fit)"),
    "raydist_loss": ("gauge", "The last loss the driver read (fit)"),
    "raydist_learning_rate": ("gauge", "The learning rate of the last step the driver read (fit)"),
    "raydist_ranks": ("gauge", "Ranks of the live group"),
    "raydist_size_min": ("gauge", "The smallest size the model accepts (elastic bounds)"),
    "raydist_size_max": ("gauge", "The largest size the model accepts (elastic bounds)"),
    "raydist_driver_messages": ("counter", "Messages of steps the driver sent"),
    "raydist_driver_message_seconds": ("counter", "Seconds the driver spent sending messages of steps"),
    "raydist_failures": ("counter", "Rank failures"),
    "raydist_restarts": ("counter", "Restarts of the ranks"),
    "raydist_resizes": ("counter", "Moves to another number of ranks (elastic)"),
    "raydist_preemption_notices": ("counter", "Preemption notices for nodes of the live group"),
    "raydist_checkpoints": ("counter", "Checkpoints saved"),
    "raydist_replica_mismatches": ("counter", "Replica checks that found replicas disagreeing"),
    "raydist_checkpoint_stall_seconds": ("counter", "Seconds the loop stood still for checkpoints"),
}
_COUNTED = {"failure": "raydist_failures", "restart": "raydist_restarts", "resize": "raydist_resizes",
            "drain": "raydist_preemption_notices", "checkpoint": "raydist_checkpoints",
            "replica_mismatch": "raydist_replica_mismatches"}  # fmt: skip


class Recorder:
    """Records updates ``[(name, value), ...]`` of `METRICS` with ``tags``, in this process."""

    def __init__(self) -> None:
        self._metrics: dict[str, Any] = {}

    def record(self, updates: list[tuple[str, float]], tags: dict[str, str]) -> None:
        from ray.util import metrics

        for name, value in updates:
            metric = self._metrics.get(name)
            if metric is None:
                kind, description = METRICS[name]
                cls = metrics.Counter if kind == "counter" else metrics.Gauge
                metric = self._metrics[name] = cls(name, description, tag_keys=tuple(sorted(tags)))
            if isinstance(metric, metrics.Counter):
                if value > 0:
                    metric.inc(value, tags=tags)
            else:
                metric.set(value, tags=tags)


class Relay(Recorder):
    """A `Recorder` on the cluster, for a driver through Ray Client."""


@functools.cache
def _relay_class():
    return ray.remote(Relay)


class RelayClient:
    """A `Relay` actor on the head node, called as a `Recorder` is (by a driver through Ray Client)."""

    def __init__(self) -> None:
        self.actor = _relay_class().options(num_cpus=0, scheduling_strategy=on_the_head()).remote()

    def record(self, updates: list[tuple[str, float]], tags: dict[str, str]) -> None:
        self.actor.record.remote(updates, tags)  # no wait: the call goes on


class RunMetrics:
    """The driver's metrics of one model. `tick` (cheap; from each call) exports the pace every
    `EXPORT_S`; events are counted as they come (`on_event`, an `Events` sink)."""

    def __init__(self, model: str):
        self.tags = {"model": model}
        self.batch_size: int | None = None  # rows per global batch, once known (fit)
        self._next = time.monotonic() + EXPORT_S
        self._last: tuple[float, int, int, int] | None = None  # (when, steps done, messages, send ns)
        self._lock = threading.Lock()
        self._recorder: Recorder | RelayClient | None = None
        self._pending: list[tuple[str, float]] = []  # the last loss read, for the next export
        self._outage = Outage("the driver's Ray metrics are not exported", "the driver's Ray metrics are exported")

    def tick(self, client: Any, sizes: Any) -> None:
        """From each call: every `EXPORT_S`, the pace of ``client``'s steps and the group's size
        (of the model's `raydist.driver.cluster.sizes.Sizes`)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + EXPORT_S
        window = client.window
        done, messages, send_ns = window.completed, window.messages, window.send_ns
        updates = [("raydist_ranks", client.size), ("raydist_size_min", sizes.min), ("raydist_size_max", sizes.max)]
        if self._last is not None:
            when, done0, messages0, send0 = self._last
            rate = (done - done0) / (now - when)
            updates += [("raydist_steps_per_second", rate), ("raydist_driver_messages", messages - messages0),
                        ("raydist_driver_message_seconds", (send_ns - send0) / 1e9)]  # fmt: skip
            if self.batch_size:
                updates.append(("raydist_samples_per_second", rate * self.batch_size))
        self._last = (now, done, messages, send_ns)
        self._record(updates)

    def read(self, loss: float, lr: float | None) -> None:
        """The loss (and learning rate) the driver just read; exported with the next tick's."""
        self._pending = [("raydist_loss", loss)] + ([("raydist_learning_rate", lr)] if lr is not None else [])

    def on_event(self, event: dict) -> None:
        updates: list[tuple[str, float]] = [(_COUNTED[event["kind"]], 1)] if event["kind"] in _COUNTED else []
        if event["kind"] == "checkpoint":
            updates.append(("raydist_checkpoint_stall_seconds", event.get("stall_s", 0.0)))
        if updates:
            self._record(updates)

    def _record(self, updates: list[tuple[str, float]]) -> None:
        updates, self._pending = updates + self._pending, []
        try:
            with self._lock:
                if self._recorder is None:
                    self._recorder = RelayClient() if through_client() else Recorder()
                recorder = self._recorder
            recorder.record(updates, self.tags)
            self._outage.read()
        except Exception as e:  # noqa: BLE001 - metrics never stop a run; said once
            if ray.is_initialized():
                self._outage.failed(e)
