"""What the parts of `raydist.driver.lifecycle.lifecycle.Lifecycle` share.

`Lifecycle` is one object made of parts, each a module of its own: its restart
(`raydist.driver.lifecycle.restart.Restarting`), its moves and resizes
(`raydist.driver.lifecycle.moves.Moves`) and a detached model's adoption
(`raydist.driver.lifecycle.adopt.Adoption`). `LifeParts` declares, once, the state and the
calls of `Lifecycle` that those parts use, so that each part reads (and type-checks) on its
own; `Lifecycle` defines every one of them.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from ..dispatch.client import live

if TYPE_CHECKING:
    from ...handover import StateMap
    from ..cluster.config import GroupConfig
    from ..cluster.group import RankGroup
    from ..cluster.sizes import Sizes
    from ..dispatch.client import RankClient
    from ..model.modes import Modes
    from ..model.rates import LearningRate
    from ..model.state import ModelState
    from ..watching.events import Events
    from .detached import Hold
    from .peers import PeerMemory
    from .recovery import Recovery
    from .replicas import ReplicaCheck


class LifeParts:
    """The state and calls of `Lifecycle` its parts use (see the module)."""

    config: GroupConfig
    sizes: Sizes
    modes: Modes
    rates: LearningRate
    state: ModelState
    recovery: Recovery
    peers: PeerMemory | None
    replicas: ReplicaCheck | None
    events: Events
    client: RankClient | None
    hold: Hold | None
    _finalizer: weakref.finalize | None

    def start(self, first_step: int = 0, size: int | None = None, freed: int = 0,
              placement_timeout_s: float | None = None, base: int = 0, mirror: bool = True) -> None:  # fmt: skip
        raise NotImplementedError

    def step(self) -> int:
        raise NotImplementedError

    def sent(self, number: int, train: bool, rate: Any, message: Any = None) -> None:
        raise NotImplementedError

    def _took(self, group: RankGroup, first_step: int, base: int = 0) -> RankClient:
        raise NotImplementedError

    def _mirror(self, base: int, forget: bool = True) -> None:
        raise NotImplementedError

    def _watching(self) -> None:
        raise NotImplementedError

    def _put_back(self, state: StateMap, rate: Any) -> None:
        raise NotImplementedError

    def _stop_watching_room(self) -> None:
        raise NotImplementedError

    def live(self) -> RankClient:
        """The live group's client (`raydist.driver.dispatch.client.live`)."""
        return live(self.client)
