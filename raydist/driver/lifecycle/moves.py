"""Moves of a live group between two steps: growing into room that showed, and moving off a draining node.

An elastic model's room to grow is watched by a thread of its own (`RoomWatch`), so a
step boundary learns of a joined node by reading a flag, without asking the cluster.
A preemption notice (`raydist.driver.lifecycle.preemption`) for a node of the live group
moves the model off it, from its live state, at the largest accepted size the other nodes
hold (a fixed-size model's only one); when they cannot hold it, ``fit`` saves instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from ..cluster.placement import placeable_now
from ..cluster.sizes import Sizes
from ..cluster.state import Outage
from .parts import LifeParts
from .recovery import live_state

if TYPE_CHECKING:
    from ..dispatch.client import RankClient
    from .preemption import DrainWatch, Notice

log = logging.getLogger("raydist")

GROW_PLACEMENT_S = 30.0  # how long growing waits for the room it saw before settling for what fits
HAND_OVER_WAIT_S = 60.0  # how long a move waits for the live ranks to hand over their state
ROOM_POLL_S = 1.0  # how often an elastic model below its largest size looks for room to grow


class Moves(LifeParts):
    """`raydist.driver.lifecycle.lifecycle.Lifecycle`'s moves between steps (a part of it)."""

    client: RankClient | None
    sizes: Sizes
    _room: RoomWatch | None
    _drains: DrainWatch | None
    notice: Notice | None

    def can_grow(self, look: bool = False) -> int | None:
        """A larger accepted size the cluster had room for when last looked at (every `ROOM_POLL_S`), if any;
        ``look``: look now (a few calls to Ray's GCS), e.g. after the loop stood still for a save."""
        if self._room is None:
            return None
        if look and self._room.size is None:
            self._room.look()
        return self._room.size

    def at_boundary(self, look: bool = False, before: Callable[[], Any] | None = None,
                    grow: bool = True) -> str | None:  # fmt: skip
        """Between two steps: act on a preemption notice for a node of the live group, else grow if
        there is room (``look``: look now, see `can_grow`). What was done: ``"moved"`` (the model left
        the draining node, from its live state, at an accepted size the other nodes hold: a fixed-size
        model's only one), ``"noticed"`` (it could not: `notice` is
        set, for `fit` to checkpoint), ``"grew"``, or None. ``before`` runs before any of these;
        ``grow=False``: act on notices only."""
        if self.client is None or not self.live().alive:
            return None
        notice = self._drains.notice(self.live().group.nodes) if self._drains is not None else None
        size = None if notice is not None or not grow else self.can_grow(look)
        if (notice is not None or size is not None) and before is not None:
            before()
        if notice is not None:
            on = [r for r, node in enumerate(self.live().group.nodes) if node in notice.nodes]
            log.warning("raydist: preemption notice: %s; it holds ranks %s", notice, on)
            size = self._size_off()  # a fixed-size model moves too, when its size fits elsewhere
            self.events.emit("drain", self.step(), nodes=sorted(notice.nodes), deadline=notice.deadline, ranks=on,
                             action="move" if size is not None else "checkpoint")  # fmt: skip
            if size is not None:
                log.warning("raydist: moving off it, from %d to %d ranks on other nodes, with the live state (no "
                            "checkpoint)", self.live().size, size)  # fmt: skip
                self.resize(size, why="drain")
                return "moved"
            self.notice = notice
            return "noticed"
        if size is not None:
            log.warning("raydist: room for %d ranks; growing from %d", size, self.live().size)
            self.resize(size, why="grow")
            return "grew"
        return None

    def _size_off(self) -> int | None:
        """The largest accepted size that fits on nodes that are not draining, if any."""
        room = placeable_now(self.config.bundle()) + self.live().group.live_bundles()
        size = self.sizes.fitting(room)
        return size if size <= room else None

    def resize(self, size: int, why: str = "grow") -> None:
        """Move to a group of ``size`` ranks, the state handed over from the live ranks (through Ray's
        object store, rank to rank: `raydist.handover`; no checkpoint is written); at a step boundary
        only. ``why``: "grow" or "drain"."""
        self.state.wait_saved()
        # each piece stays on its rank's node, owned by the driver, until the new ranks fetch it
        found = live_state(self.live().group.actors, set(self.state.meta("all" if self.modes.built("train")
                                                                          else "param")), HAND_OVER_WAIT_S)  # fmt: skip
        if isinstance(found, str):  # at a step boundary every rank answers: a rank died meanwhile
            raise RuntimeError(f"raydist: the ranks could not hand over their state for the move: {found}")
        state = found[1]
        rate = self.rates.position()
        first_step = self.live().window.submitted
        base = self.recovery.base + self.recovery.trained  # at a boundary: every step sent completed
        freed, before = self.live().group.live_bundles(), self.live().size
        self._stop_watching_room()
        if self._finalizer is not None:
            self._finalizer.detach()
        self.live().close(drain=True)
        try:  # the room seen a moment ago may be gone (taken by another job, a node lost again)
            self.start(first_step, size=size, freed=freed, placement_timeout_s=GROW_PLACEMENT_S, base=base,
                       mirror=False)  # fmt: skip
        except TimeoutError:
            log.warning("raydist: no room for %d ranks after all; going on at the size that fits", size)
            self.start(first_step, base=base, mirror=False)
        self._put_back(state, rate)
        self._mirror(base, forget=False)
        self.events.emit("resize", first_step, to=self.live().size, why=why, **{"from": before})

    def _watch_room(self) -> None:
        if self.sizes.elastic and self.live().size < self.sizes.max:
            self._room = RoomWatch(self.sizes, self.live().size, self.config.bundle())

    def _stop_watching_room(self) -> None:
        room, self._room = self._room, None
        if room is not None:
            room.stop()


class RoomWatch:
    """A thread that looks, every `ROOM_POLL_S`, whether the cluster has room for a larger accepted
    size than ``size``; `size` is that size once it has (None before). `look` looks at once."""

    def __init__(self, sizes: Sizes, size: int, bundle: dict[str, float]):
        self.size: int | None = None
        self._sizes, self._from, self._bundle = sizes, size, bundle
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raydist-room", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        outage = Outage(f"the model does not grow past {self._from} ranks", "the model grows when room shows")
        while not self._stopped.wait(ROOM_POLL_S) and self.size is None:
            try:
                self.look()
                outage.read()
            except Exception as e:  # noqa: BLE001 - said once; looked at again
                if self._stopped.is_set() or not ray.is_initialized():  # Ray shuts down
                    return
                outage.failed(e)

    def look(self) -> None:
        """Look now (from any thread): `size` is set once a larger size fits."""
        larger = self._sizes.larger(self._from, placeable_now(self._bundle))
        if larger is not None:
            self.size = larger

    def stop(self) -> None:
        self._stopped.set()
