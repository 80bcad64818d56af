"""Elastic size: the group sizes a model accepts, and which of them the cluster holds now.

``num_workers=(min, max)`` makes a model elastic, as Ray Train's
``ScalingConfig(num_workers=(min, max))``. Its layer builder makes the mesh from
the world it finds (``dist.get_world_size()``). A size is accepted when the
loader's data still splits evenly: the loader is made with the mesh at ``max``,
whose data-parallel groups are the loader's shards, and every smaller size must
give each of its groups a whole number of shards (with the same ranks per group),
so that global batch k holds the same rows, in the same order, at every size.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from .placement import placeable_now

log = logging.getLogger("raydist")

# How long a just-freed group's resources may take to show as available again.
RELEASE_WAIT_S = 5.0
LOOK_S = 2.0  # otherwise, how long to look for room for a larger size


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The accepted group sizes, ascending; one size: a fixed-size model."""

    accepted: tuple[int, ...]

    @property
    def min(self) -> int:
        return self.accepted[0]

    @property
    def max(self) -> int:
        return self.accepted[-1]

    @property
    def elastic(self) -> bool:
        return len(self.accepted) > 1

    def fitting(self, free: int) -> int:
        """The largest accepted size within ``free`` ranks' room; ``min`` when none fits (then wait)."""
        return max((n for n in self.accepted if n <= free), default=self.min)

    def larger(self, size: int, free: int) -> int | None:
        """A larger accepted size than ``size`` that fits when ``free`` more ranks' room is free, if any."""
        best = self.fitting(size + free)
        return best if best > size else None


def sizes_of(num_workers: Any, loader: Any = None) -> Sizes:
    """The sizes ``num_workers`` (an int, or ``(min, max)``) allows with ``loader``. Raises on a bad one."""
    if isinstance(num_workers, (tuple, list)):
        if len(num_workers) != 2 or not all(_positive(n) for n in num_workers):
            raise ValueError(f"num_workers=(min, max) takes two positive ints, got {num_workers!r}")
        low, high = num_workers
        if low > high:
            raise ValueError(f"num_workers=(min, max) has min {low} > max {high}")
    elif _positive(num_workers):
        low = high = num_workers
    else:
        raise ValueError(f"num_workers must be a positive int or (min, max), got {num_workers!r}")
    if low == high:
        return Sizes((low,))
    if loader is None:
        return Sizes(tuple(range(low, high + 1)))
    ranks = len(loader.meshes[0].process_ids)
    if ranks != high:
        raise ValueError(
            f"an elastic model's loader is made with the mesh of its largest size: the loader's mesh has "
            f"{ranks} ranks, num_workers' max is {high}"
        )
    per_group = ranks // loader.dp  # ranks per data-parallel group
    # max itself is always accepted (every group of the loader's mesh reads its own shard)
    accepted = tuple(n for n in range(low, high + 1) if n % per_group == 0 and loader.dp % (n // per_group) == 0)
    return Sizes(accepted)


def size_now(sizes: Sizes, bundle: dict[str, float], freed: int = 0, held: int = 0) -> int:
    """The size to start at: the largest accepted that the cluster can place now.

    ``freed``: ranks' bundles a group just released; their room may take a moment
    to show as free, so wait a little for it. ``held``: ranks started already
    (spares), which need no room.
    """
    if not sizes.elastic:
        return sizes.min
    # Room shows up late when a group just let go of it, and comes and goes with short
    # tasks (a loader's Ray Data tasks reading its schema): look for a moment.
    deadline = time.monotonic() + (RELEASE_WAIT_S if freed else LOOK_S)
    enough = freed if freed else sizes.max - held  # the room released, or room for the largest size
    free = placeable_now(bundle)
    while free < enough and time.monotonic() < deadline:
        time.sleep(0.2)
        free = max(free, placeable_now(bundle))
    free += held
    size = sizes.fitting(free)
    if size > free:
        log.warning("raydist: room for %d of %s now; starting at %d and waiting for it", free, bundle, size)
    return size


def _positive(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1
