"""What Ray's control store (GCS) says of the cluster, read from wherever the driver stands.

A driver on the cluster (``ray.init()``, ``RAY_ADDRESS``, ``ray job submit``) reads
the GCS itself. A driver through Ray Client (``ray.init("ray://head:10001")``, a
notebook on a laptop) has no GCS connection of its own: Ray 2.60's client forwards
``ray.nodes()``, ``ray.available_resources()`` and named actors, but the reads here
(private Ray, each saying which public API is missing) raise ``RaySystemError: Ray
has not been started yet``. Such a driver asks a `Reader` of its own, a small actor
on the head node (no CPU), to read them on the cluster.

`Outage` is how a watch that reads these says it cannot, once, and that it can again.

Every use of Ray's private API in raydist is in this module, each in a function that says
which public API is missing (a unit test holds the package to it).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import ray

log = logging.getLogger("raydist")

READ_TIMEOUT_S = 30.0


# -- the reads, where the process has a GCS connection ------------------------------------------


def recorded_address() -> str | None:
    """The cluster Ray's address file names (``ray start`` writes it; ``ray.init()`` reads it), or None.

    Private Ray: Ray 2.60 has no public API that reads the address file (or tells whether
    ``ray.init()`` would connect to a cluster, short of calling it); this is the call that
    ``ray.init()`` makes itself."""
    from ray._private.utils import read_ray_address

    return read_ray_address()


def _draining_nodes() -> dict[str, int]:
    """Private Ray: Ray 2.60 has no public API for the draining nodes; Ray Train's preemption
    watcher (train/v2/_internal/execution/preemption.py) makes this same call."""
    from ray._private.state import state

    return dict(state.get_draining_nodes())


def _available_per_node() -> dict[str, dict[str, float]]:
    """Private Ray: Ray 2.60's public APIs give free resources for the whole cluster only
    (``ray.available_resources()``), and each node's totals (``ray.nodes()``,
    ``ray.util.state.list_nodes``, which also needs the dashboard), not each node's free share."""
    from ray._private.state import available_resources_per_node

    return available_resources_per_node()


def _ended_jobs() -> set[str]:
    """Private Ray: 2.60's public APIs that list jobs (``ray.util.state.list_jobs``, the job
    submission client) answer through the dashboard, which a cluster may run without; the GCS's
    job table is what they read."""
    from ray._private.state import jobs

    return {j["JobID"] for j in jobs() if j["IsDead"]}


def _max_resources_from_cluster_config() -> dict[str, float] | None:
    """Private Ray: no public API in Ray 2.60 gives the autoscaler's largest totals (Ray Train makes
    this same call)."""
    from ray._private.state import state

    totals = state.get_max_resources_from_cluster_config()
    return None if totals is None else {k: float(v) for k, v in totals.items()}


_READS: dict[str, Callable[[], Any]] = {
    "draining_nodes": _draining_nodes,
    "available_per_node": _available_per_node,
    "ended_jobs": _ended_jobs,
    "max_resources_from_cluster_config": _max_resources_from_cluster_config,
}


# -- what the driver calls ------------------------------------------------------------------


def draining_nodes() -> dict[str, int]:
    """The nodes Ray is draining: {node id (hex): deadline in ms since the epoch, 0 if none}."""
    return _read("draining_nodes")


def available_per_node() -> dict[str, dict[str, float]]:
    """What each node has free now: {node id (hex): {resource: amount}}."""
    return _read("available_per_node")


def ended_jobs() -> set[str]:
    """The ids (hex) of the Ray jobs (drivers) that ended."""
    return _read("ended_jobs")


def max_resources_from_cluster_config() -> dict[str, float] | None:
    """The largest totals the autoscaler's cluster config allows, if one was published."""
    return _read("max_resources_from_cluster_config")


def autoscaler_node_types() -> dict[str, str] | None:
    """The autoscaler's last status report's node types ({node id: type}); None if there is no report.

    Private Ray: no public API in Ray 2.60 reads the autoscaler's status (``ray status`` reads this
    same key from the GCS; ``ray.util.state`` needs the dashboard and has no autoscaler status). Ray
    Client forwards this read."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        status = json.loads(_internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS))
        return status["autoscaler_report"]["node_type_mapping"]
    except Exception:
        return None


def through_client() -> bool:
    """Whether this process reaches Ray through Ray Client (``ray://``): it has no GCS connection."""
    from ray.util.client import ray as client

    return client.is_connected()


def _read(what: str) -> Any:
    if not through_client():
        return _READS[what]()
    try:
        return _reader().read(what)
    except ray.exceptions.RayActorError:  # its node was lost, say: a new one reads
        _forget_reader()
        return _reader().read(what)


class Reader:
    """Reads the GCS for a driver that cannot (`through_client`)."""

    def read(self, what: str) -> Any:
        return _READS[what]()


class ReaderClient:
    """A `Reader` actor on the head node, for this driver's connection."""

    def __init__(self) -> None:
        self.actor = _reader_class().options(num_cpus=0, scheduling_strategy=on_the_head()).remote()

    def read(self, what: str) -> Any:
        """`_READS`'s ``what``, read on the cluster (within `READ_TIMEOUT_S`)."""
        return ray.get(self.actor.read.remote(what), timeout=READ_TIMEOUT_S)


_lock = threading.Lock()
_made: tuple[str, ReaderClient] | None = None  # (the client connection's job id, its reader)


def _reader() -> ReaderClient:
    global _made
    job = ray.get_runtime_context().get_job_id()  # a new connection is a new job
    with _lock:
        if _made is None or _made[0] != job:
            _made = (job, ReaderClient())
        return _made[1]


def _forget_reader() -> None:
    global _made
    with _lock:
        _made = None


def on_the_head() -> Any:
    """Scheduling on the head node, which outlives the others (any node if no head shows)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = next((n["NodeID"] for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n["Resources"]),
                None)  # fmt: skip
    return "DEFAULT" if head is None else NodeAffinitySchedulingStrategy(head, soft=True)


@functools.cache
def _reader_class():
    return ray.remote(Reader)


class Outage:
    """For a watch that reads the cluster: says once that it cannot and what is off meanwhile
    (``off``), and once that it can again (``on``); never goes quiet, never repeats itself."""

    def __init__(self, off: str, on: str):
        self.off, self.on = off, on
        self.out = False

    def failed(self, error: BaseException) -> None:
        if not self.out:
            self.out = True
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            log.warning("raydist: cannot read the cluster's state (%s: %s): %s until it can",
                        type(error).__name__, first, self.off)  # fmt: skip

    def read(self) -> None:
        if self.out:
            self.out = False
            log.warning("raydist: the cluster's state reads again: %s", self.on)
