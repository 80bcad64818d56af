"""Waiting for the cluster to place the ranks: what is missing, and whether it can ever come."""

from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from .state import autoscaler_node_types, available_per_node, draining_nodes, max_resources_from_cluster_config

log = logging.getLogger("raydist")

POLL_S = 2.0  # how often the wait checks the cluster
LOG_EVERY_S = 10.0


def wait_placed(pg: PlacementGroup, bundle: dict[str, float], count: int, timeout: float | None) -> None:
    """Wait until ``pg`` (``count`` x ``bundle``) is placed, logging what is missing.

    Raises `ValueError` at once when no node can hold a bundle and no autoscaler
    can add one, `TimeoutError` after ``timeout`` seconds (None: wait forever);
    either way the placement group is removed.
    """
    start = logged = time.monotonic()
    while True:
        # Checked every round: a fresh cluster publishes its autoscaler's
        # status a few seconds after it starts.
        if not _fits_a_node(bundle) and not _may_scale(bundle, count):
            remove_placement_group(pg)
            raise ValueError(
                f"no node of this cluster can hold one rank's {bundle} (nodes: {_node_resources()}), "
                "and no autoscaler can add one: ask for less with resources_per_rank"
            )
        waited = time.monotonic() - start
        left = 10.0 if timeout is None else timeout - waited
        try:
            ray.get(pg.ready(), timeout=max(0.5, min(POLL_S, left)))
            return
        except ray.exceptions.GetTimeoutError:
            waited = time.monotonic() - start
            msg = f"waiting for {count} x {bundle}: {_placeable(bundle)} placeable"
            if timeout is not None and waited >= timeout:
                remove_placement_group(pg)
                raise TimeoutError(
                    f"could not place the ranks in {waited:.0f} s ({msg}). Give the cluster more "
                    "resources, or ask less per rank with resources_per_rank."
                ) from None
            if time.monotonic() - logged >= LOG_EVERY_S:
                logged = time.monotonic()
                log.warning("%s (%.0f s)", msg, waited)


def _node_resources() -> list[dict[str, float]]:
    keep = ("CPU", "GPU", "memory")
    return [{k: v for k, v in n.get("Resources", {}).items() if k in keep} for n in ray.nodes() if n.get("Alive")]


def _fits_a_node(bundle: dict[str, float]) -> bool:
    return any(
        all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in bundle.items()) for n in ray.nodes() if n.get("Alive")
    )


def _may_scale(bundle: dict[str, float], count: int) -> bool:
    """Whether an autoscaler may still add nodes that hold ``count`` x ``bundle``.

    Ray Train asks ``get_max_resources_from_cluster_config()``, which an
    autoscaler that publishes its cluster config answers (then: do its largest
    totals hold the ranks?). A cluster from ``ray.init()`` or ``ray start``
    publishes none (measured: None), and Ray Train then cannot tell, so this
    falls back to the autoscaler's status: there, Ray's monitor runs a
    read-only provider whose node types are the nodes' own ids ("node_<id>"),
    while a cluster launcher or KubeRay names its types. When neither answers
    yet, assume it may scale: waiting, bounded by placement_timeout_s, is safer
    than refusing a cluster that could grow.
    """
    limits = max_resources_from_cluster_config()
    if limits:
        return all(limits.get(k, 0) >= v * count for k, v in bundle.items())
    types = autoscaler_node_types()
    if types is None:
        return True
    return not types or any(kind != f"node_{node}" for node, kind in types.items())


def placeable_now(bundle: dict[str, float]) -> int:
    """How many more bundles the alive nodes could place now, from what they have free (a
    draining node takes nothing new)."""
    usable = alive_nodes() - set(draining_nodes())
    return sum(_count(free, bundle) for node, free in available_per_node().items() if node in usable)


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _count(have: dict[str, float], bundle: dict[str, float]) -> int:
    return int(min((have.get(k, 0.0) // v if v else float("inf")) for k, v in bundle.items()))


def _placeable(bundle: dict[str, float]) -> int:
    """How many bundles the cluster's nodes could hold in total (ignoring what is in use)."""
    total = 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total += _count(node.get("Resources", {}), bundle)
    return total
