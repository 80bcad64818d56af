"""Connecting the driver to Ray: the cluster it was pointed at, or a fresh local one."""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Mapping
from typing import Any

import ray

from .state import recorded_address

log = logging.getLogger("raydist")

DATA_CPUS = 2  # logical CPUs a local Ray gets beyond the ranks', for Ray Data's tasks


def init_ray(num_workers: int, resources_per_rank: Mapping[str, float] | None, use_gpu: bool) -> bool:
    """Connect to Ray unless connected; returns whether this call did (so it may disconnect).

    - ``RAY_ADDRESS`` set (as under ``ray job submit``): that cluster.
    - Ray's address file names a live cluster (``ray start`` on this machine): that cluster,
      as a plain ``ray.init()`` would.
    - Otherwise a new local Ray with enough logical CPUs for the ranks, and
      `DATA_CPUS` more for a loader's Ray Data tasks. An address
      file that names a cluster that is gone (stopped without ``ray stop``, killed)
      is ignored, with a warning: Ray itself would fail with "When connecting to an
      existing cluster, num_cpus and num_gpus must not be provided".
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        init(os.environ["RAY_ADDRESS"])
        return True
    recorded = recorded_address()
    if recorded is not None:
        if _reachable(recorded):
            log.info("raydist: connecting to the Ray cluster at %s (Ray's address file)", recorded)
            ray.init()
            return True
        log.warning(
            "raydist: Ray's address file names the cluster %s, which does not answer (stopped without "
            "`ray stop`, or killed); starting a new local Ray instead", recorded
        )
    num_cpus = local_num_cpus(num_workers, (resources_per_rank or {}).get("CPU", 0 if use_gpu else 1))
    log.info("raydist: starting a local Ray instance with %d CPUs", num_cpus)
    ray.init(address="local", num_cpus=num_cpus)
    global _started
    _started = ray.get_runtime_context().get_session_name()
    return True


def local_num_cpus(num_workers: int, cpus_per_rank: float) -> int:
    """The logical CPUs of the local Ray `init_ray` starts: the machine's, or the ranks' and
    `DATA_CPUS` more if that is larger (a loader's Ray Data tasks need CPUs beside the ranks).
    No more than that: Ray Data starts up to one worker process per free logical CPU, and each
    idle one keeps polling."""
    return max(os.cpu_count() or 1, int(math.ceil(num_workers * cpus_per_rank)) + DATA_CPUS)


_started: str | None = None  # the session of the local Ray init_ray started, if it did


def ray_started_here() -> bool:
    """Whether the Ray this process is connected to is one `init_ray` started (it ends with the process)."""
    return ray.is_initialized() and _started == ray.get_runtime_context().get_session_name()


def connect_to_cluster(why: str, address: str | None = None, **options: Any) -> None:
    """Connect to the running Ray cluster unless connected: ``address`` (``host:port``, or
    ``ray://host:port`` for Ray Client), else ``RAY_ADDRESS``, else the one Ray's address file
    names (``ray start`` on this machine). A LookupError, at once, if there is none or it does
    not answer (a new local Ray would hold nothing to ``why``). ``options``: more of ``ray.init``'s
    arguments."""
    if ray.is_initialized():
        return
    recorded = recorded_address()
    address = address or os.environ.get("RAY_ADDRESS") or (recorded if recorded and _reachable(recorded) else None)
    if not address:
        raise LookupError(f"no running Ray cluster to {why} (no --address, RAY_ADDRESS is not set, and no "
                          "`ray start` cluster runs on this machine)")  # fmt: skip
    if address != "auto" and not _reachable(address.removeprefix("ray://")):
        raise LookupError(f"no Ray cluster answers at {address} (to {why})")
    init(address, **options)


CLIENT_TRIES = 3


def init(address: str, **options: Any) -> None:
    """``ray.init(address, **options)``; through Ray Client, tried again when the client server's
    process for this connection dies as it starts ("Starting Ray client server failed"): a Ray
    defect (ray-project/ray#63202, its fork races gRPC's threads), seen here in 3 of about 40
    connections."""
    for attempt in range(CLIENT_TRIES if address.startswith("ray://") else 1):
        try:
            ray.init(address=address, **options)
            return
        except ConnectionAbortedError as e:
            if attempt == CLIENT_TRIES - 1:
                raise
            log.warning("raydist: Ray Client's server failed to start for this connection (%s); trying again",
                        str(e).strip().splitlines()[-1][:200])  # fmt: skip


def _reachable(address: str, timeout: float = 2.0) -> bool:
    """Whether the GCS at ``host:port`` accepts connections."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False
