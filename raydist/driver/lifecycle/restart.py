"""A restart after a failure, in phases: choose the state's source, start a new group, put the state in,
start its peer memory, replay the steps since.

`Restarts` keeps the `Failure` until a restart succeeds: a restart that fails in any phase
(its group cannot be placed, a rank dies while it builds, loads or replays) is one more
failure for the caller to count, and the next `Restarts.restart` starts again from the same
failure, asking every source again (a copy or a checkpoint may be gone meanwhile). The
group's part is behind `Rebuild`, so the machine is tested without Ray
(`tests/test_recovery_units.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import HandoverLost
from .parts import LifeParts
from .recovery import LIVE_STATE_WAIT_S
from .sources import Checkpoints, Failure, Offer, PeerCopies, Source, Start, Survivors, choose, replayable

if TYPE_CHECKING:
    from ...handover import StateMap
    from ..cluster.group import RankGroup
    from ..dispatch.client import RankClient
    from ..model.saves import Saves

log = logging.getLogger("raydist")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What a restart went on from: ``source`` ("replicas", "peer_memory", "checkpoint" or "start");
    ``behind``: the completed train steps the state stands behind the last one that completed (0: on
    from there; a number: peer memory's, whose steps since came from a loader, for the loop to feed
    again) or None (the ``checkpoint``'s state, or the initial one: the loop goes back to it);
    ``trained``: the train steps (over the model's life) the state is after, its replay done."""

    source: str
    behind: int | None
    checkpoint: str | None = None
    trained: int = 0


class Rebuild(Protocol):
    """What a restart does to the model's group (`raydist.driver.lifecycle.lifecycle.Lifecycle`)."""

    def close(self) -> int:
        """Stop the failed group's ranks; the placement bundles it held (room for the new group)."""

    def start(self, first_step: int, freed: int, base: int) -> None:
        """A new group (its steps numbered from ``first_step``), the model built on it, its state
        after ``base`` train steps."""

    def put_back(self, state: StateMap, rate: Any) -> None:
        """The new ranks take ``state`` from where it lies (and the learning rate ``rate``, unless None)."""

    def load(self, path: str) -> None:
        """The new group reads the checkpoint at ``path``."""

    def mirror(self, base: int, forget: bool) -> None:
        """Start the new group's peer memory and replica checks (``forget``: the copies before are
        of another timeline)."""

    def replay(self, steps: tuple, rate: Any) -> int:
        """Run ``steps`` again (up to the first that came from a loader); the learning rate then
        ``rate`` if all ran. How many ran."""

    def emit(self, kind: str, step: int, **fields: Any) -> None:
        """An event of the run (`raydist.driver.watching.events`)."""


class Restarts:
    """The restarts of one model: ``saves``, the checkpoints of its timeline; ``rebuild``, its group's part."""

    def __init__(self, saves: Saves, rebuild: Rebuild):
        self.saves, self.rebuild = saves, rebuild
        self.pending: Failure | None = None  # the failure a restart is owed for, until one succeeds

    def restart(self, failed: Callable[[], Failure], sources: dict[str, Source]) -> Restored:
        """Restart after the failure that ``failed()`` reads (read once: a restart that fails is tried
        again from the same), from the best of ``sources`` by name (`raydist.driver.lifecycle.sources`)."""
        if self.pending is None:
            self.pending = failed()
        restored = self._restart(self.pending, sources)
        self.pending = None
        return restored

    def _restart(self, failure: Failure, sources: dict[str, Source]) -> Restored:
        began = time.monotonic()
        offers = {name: source.offer(failure) for name, source in sources.items()}
        offer = choose(offers)
        state_s = time.monotonic() - began  # the state's time: finding it, and putting it in the new group
        _log(offer, offers)
        self.saves.went_back(min(failure.bound, offer.reaches))
        rebuild = self.rebuild
        freed = rebuild.close()
        rebuild.start(failure.first_step, freed, offer.trained)
        put_began = time.monotonic()
        if offer.path is not None:
            rebuild.load(offer.path)
        elif offer.state is not None:
            try:
                rebuild.put_back(offer.state, offer.rate)
            except Exception as e:
                if HandoverLost.caused(e):  # a node that held some of it is gone: not offered again
                    failure.spent.add("replicas" if offer.source == "replicas" else offer.trained)
                raise
        state_s += time.monotonic() - put_began
        rebuild.mirror(offer.trained, forget=not offer.replay and offer.source != "replicas")
        replay_began, replayed = time.monotonic(), 0
        if offer.replay:
            replayed = rebuild.replay(offer.steps, failure.rate)
        replay_s = time.monotonic() - replay_began
        behind = len(offer.steps) - replayed if offer.replay else 0 if offer.source == "replicas" else None
        if offer.replay and offer.source == "peer_memory":
            more = f", {behind} more to feed again" if behind else ""
            log.warning("raydist: replayed %d train steps%s", replayed, more)
        rebuild.emit("restart", failure.first_step, source=offer.source, checkpoint=offer.path,
                     replayed=offer.replayed, behind=behind, trained=offer.trained + replayed,
                     seconds=round(time.monotonic() - began, 3), state_s=round(state_s, 3),
                     replay_s=round(replay_s, 3))  # fmt: skip
        return Restored(offer.source, behind, offer.path, offer.trained + replayed)


def _log(offer: Offer, offers: dict[str, Offer | str]) -> None:
    """Say where the restart goes on from, and why not from a newer state."""
    if offer.source == "replicas":
        log.warning("raydist: went on from the state the surviving ranks held after %d train steps "
                    "(no checkpoint read)", offer.trained)  # fmt: skip
        return
    whys = offers.get("peer_memory")
    if offer.source == "peer_memory":
        log.warning("raydist: went on from peer memory's copy after %d train steps (no checkpoint read)",
                    offer.trained)  # fmt: skip
        return
    where = f"back to the checkpoint {offer.path}" if offer.path else "starting over"
    if isinstance(whys, str):
        if whys != "the model has no peer memory":
            log.warning("raydist: peer memory cannot serve the restart: %s; %s", whys, where)
    elif whys is not None:
        log.warning("raydist: peer memory's copy after %d train steps reaches %d, the %s %d: %s", whys.trained,
                    whys.reaches, offer.source, offer.reaches, where)  # fmt: skip
    if offer.source == "start" and offer.replay:
        log.warning("raydist: went on from the initial state (no copy made yet), replaying %d train steps",
                    len(offer.steps))  # fmt: skip


class Restarting(LifeParts):
    """`raydist.driver.lifecycle.lifecycle.Lifecycle`'s part in a restart: the failure it reads, the
    survivors' state it keeps, the state and the steps it puts in a new group."""

    client: RankClient | None
    restarts: Restarts
    _mismatched: bool

    def restart(self) -> Restored:
        """A fresh group (after a failure), with the newest state there is (`raydist.driver.lifecycle.sources`):
        the survivors' (if they hold all of it), peer memory's newest complete copy and the train steps
        since replayed, the newest checkpoint of the timeline, or the initial parameters; after a replica
        mismatch, nothing newer than the last check that passed. The checkpoints after the state it goes
        on from leave the timeline (`raydist.driver.model.saves`). What it went on from: see `Restored`,
        and `raydist.DistModel.restart`."""
        self.state.wait_saved()  # a background save ends first: committed, or gone with the ranks
        sources: dict[str, Source] = {"replicas": Survivors(), "peer_memory": PeerCopies(self.peers, self.state.names),
                                      "checkpoint": Checkpoints(self.state.saves),
                                      "start": Start(self.state.saves)}  # fmt: skip
        return self.restarts.restart(self._failed_at, sources)

    def _failed_at(self) -> Failure:
        """What the failure of the live group left for a restart."""
        recovery, window = self.recovery, self.live().window
        completed = recovery.completed(window.completed)
        rate = recovery.resume_rate(window.completed, self.rates.position())
        failure = Failure(recovery, recovery.take(), window.submitted, window.completed, completed, completed,
                          rate, recovery.unsalvaged)  # fmt: skip
        if self._mismatched and self.replicas is not None:  # after the last check that passed, any state may
            failure.salvaged, failure.bound, self._mismatched = None, min(completed, self.replicas.clean), False
            failure.unsalvaged = "after a replica mismatch the survivors' state may hold the corruption"  # hold it
        return failure

    def _replay(self, steps: tuple, resume_rate: Any) -> int:
        """Run again the train steps ``steps`` ((rate, message) each) that came from the driver's
        batches, in order, up to the first that came from a loader; the learning rate then where the
        next step (that one, or the first that did not complete) runs with. How many ran."""
        replayed, mode = 0, self.modes.mode
        for rate, message in steps[:replayable(steps)]:
            self.rates.go_to(rate)
            self.modes.mode = "train"
            again = self.modes.message(list(message.arrays), self.rates.take_changes)
            step = self.live().step(again, lambda results: None)
            self.sent(step.number, True, rate, again)
            replayed += 1
        self.live().drain()
        if self.modes.mode != mode:
            self.modes.switch(mode)
        self.rates.go_to(steps[replayed][0] if replayed < len(steps) else resume_rate)
        return replayed

    def _salvage(self, group: RankGroup) -> None:
        """A rank of ``group`` died: keep what its survivors hold, for `restart`."""
        if self.client is None or group is not self.live().group or not self.modes.built("train"):
            return
        self.recovery.salvage(group, self.state.names, self.live().window.oldest, self.rates.position())
        if self.peers is not None:  # the survivors' own copies, before the group is torn down
            self.peers.salvage(group, LIVE_STATE_WAIT_S)

    def _put_back(self, state: StateMap, rate: Any) -> None:
        """The new group takes the state of the one before from where it lies, and its learning rate."""
        if not self.modes.built("train") and not set(state) <= set(self.state.meta()):
            self.modes.build("train")  # the optimizer's state lives in the train program
        self.state.take(state)
        self.rates.go_to(rate)


class LifeRebuild:
    """The lifecycle's part in a restart (`raydist.driver.lifecycle.restart.Rebuild`)."""

    def __init__(self, life: Restarting):
        self.life = weakref.proxy(life)  # the lifecycle holds this: no cycle that keeps a dropped model alive

    def close(self) -> int:
        freed = self.life.client.group.live_bundles()
        self.life.close()
        return freed

    def start(self, first_step: int, freed: int, base: int) -> None:
        self.life.start(first_step, freed=freed, base=base, mirror=False)

    def put_back(self, state: StateMap, rate: Any) -> None:
        self.life._put_back(state, rate)

    def load(self, path: str) -> None:
        self.life.state.load(path, self.life.modes.built("train"), None)

    def mirror(self, base: int, forget: bool) -> None:
        self.life._mirror(base, forget=forget)

    def replay(self, steps: tuple, rate: Any) -> int:
        return self.life._replay(steps, rate)

    def emit(self, kind: str, step: int, **fields: Any) -> None:
        self.life.events.emit(kind, step, size=self.life.client.size, **fields)
