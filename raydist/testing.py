"""A white-box view of a `DistModel`'s parts, for tests and benchmarks that check how raydist does
what it does (its placement group, the dispatch tree, the rank actors), not only what it does.

Not part of the API: these names follow raydist's internals and change with them. What a user
needs is public on the model (``dm.ranks``, ``dm.dispatch``, ``dm.step``, ``dm.events()``); this
module is the one place outside raydist that knows how a model is built, so a change inside
touches it instead of every test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

    from .driver.api.model import DistModel
    from .driver.cluster.group import RankGroup
    from .driver.dispatch.window import Window
    from .driver.lifecycle.lifecycle import Lifecycle


def group(dm: DistModel) -> RankGroup:
    """The model's live group: its actors, placement group, environments, adopted spares."""
    return dm._client.group


def actors(dm: DistModel) -> list[ActorHandle]:
    """The rank actors' handles, in rank order."""
    return list(group(dm).actors)


def placement_group(dm: DistModel) -> PlacementGroup | None:
    """The group's placement group (None once removed, or for a group placed by a caller's)."""
    return group(dm)._pg


def on_ranks(dm: DistModel, fn: Callable[[Any], Any], ranks: Sequence[int] | None = None) -> list:
    """``fn(rank_actor)`` run inside each rank actor (or ``ranks``), for a check of a rank's own
    state (a Paddle flag, a counter). Ray's ``__ray_call__`` runs a function inside a live actor;
    the ranks have no such endpoint of their own on purpose."""
    handles = actors(dm)
    return ray.get([handles[r].__ray_call__.remote(fn) for r in (range(len(handles)) if ranks is None else ranks)])


def call(dm: DistModel, method: Callable[..., Any], *args: Any, ranks: Sequence[int] | None = None) -> list:
    """A `raydist.worker` rank method's results from every rank (or ``ranks``), once every step in
    flight is done."""
    return dm._client.call(method, *args, ranks=ranks)


def transport(dm: DistModel) -> str | None:
    """The transport steps go by: None until the first step opened it, then what ``dm.dispatch``
    says."""
    return dm._client.transport


def tree(dm: DistModel) -> dict[int, list[int]]:
    """Under ``dispatch="tree"``, the ranks each rank relays a step to."""
    from .driver.dispatch.transport import TreeTransport

    transport = dm._client._transport
    if not isinstance(transport, TreeTransport):
        raise ValueError(f"the model's steps go by {dm.dispatch!r}, not by a relay tree")
    return transport.tree


def window(dm: DistModel) -> Window:
    """The window of steps in flight (its message size, messages sent)."""
    return dm._client.window


def lifecycle(dm: DistModel) -> Lifecycle:
    """The model's lifecycle: its spare pool, the room it looks for to grow, the preemption notices it
    saw."""
    return dm._life


def last_restart_source(dm: DistModel) -> str | None:
    """Where the model's last restart took its state from ("replicas", "peer_memory", "checkpoint",
    "start"), from its events; None if it never restarted."""
    restarts = [e for e in dm.events() if e["kind"] == "restart"]
    return restarts[-1]["source"] if restarts else None
