"""Preemption notices: the nodes Ray is draining, and their deadlines.

Before a node is taken away (a spot preemption, the autoscaler's scale-down), Ray
is told so with a deadline (GCS DrainNode; ``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`` sends the same). Ray
then places nothing new on the node, but what runs there runs on until the node is
gone. `DrainWatch` polls the draining nodes every `DRAIN_POLL_S`, as Ray Train's
preemption watcher does, so that the model's `Lifecycle` can act at the next step
boundary: an elastic model moves off the node with its live state, a fixed-size one
saves a checkpoint (in `fit`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable

import ray

from ..cluster.state import Outage, draining_nodes

DRAIN_POLL_S = 1.0


@dataclasses.dataclass(frozen=True)
class Notice:
    """Nodes of the live group that Ray is draining; ``deadline``: the earliest, in ``time.time()`` seconds."""

    nodes: frozenset[str]
    deadline: float | None

    def __str__(self) -> str:
        nodes = ", ".join(sorted(n[:12] for n in self.nodes))
        if self.deadline is None:
            return f"node {nodes} is draining (no deadline)"
        when = time.strftime("%H:%M:%S", time.localtime(self.deadline))
        return f"node {nodes} is draining, deadline {when} (in {self.deadline - time.time():.0f} s)"


class DrainWatch:
    """A thread that keeps `draining` ({node id: deadline in s, or None}) up to date; `notice`
    tells about the draining nodes among a group's once each. ``read``: what reads Ray's draining
    nodes ({node id: deadline in ms, 0 for none}); while it cannot, the watch says so once."""

    def __init__(self, read: Callable[[], dict[str, int]] = draining_nodes) -> None:
        self._read = read
        self.draining: dict[str, float | None] = {}
        self._told: set[str] = set()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raydist-drains", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        outage = Outage("preemption notices (Ray draining a node) are not acted on",
                        "preemption notices are acted on")  # fmt: skip
        while not self._stopped.is_set():
            try:
                self.draining = {node: (ms / 1000 if ms else None) for node, ms in self._read().items()}
                outage.read()
            except Exception as e:  # noqa: BLE001 - said once; looked at again
                if self._stopped.is_set() or not ray.is_initialized():  # Ray shuts down
                    return
                outage.failed(e)
            self._stopped.wait(DRAIN_POLL_S)

    def notice(self, nodes: Iterable[str]) -> Notice | None:
        """A `Notice` if a node among ``nodes`` started draining since the last notice; else None."""
        draining = self.draining
        if not draining:  # the common case, once per train call: nothing to build
            return None
        hit = {n: draining[n] for n in set(nodes) if n in draining}
        if not set(hit) - self._told:
            return None
        self._told |= set(hit)
        deadlines = [d for d in hit.values() if d is not None]
        return Notice(frozenset(hit), min(deadlines) if deadlines else None)

    def stop(self) -> None:
        self._stopped.set()
