"""A detached model's ranks taken over by this driver (`raydist.attach`), or let go of when another takes them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ... import checkpoint
from ...errors import RankError
from ...protocol import RankActor
from ..cluster.group import RankGroup
from .parts import LifeParts

if TYPE_CHECKING:
    from ..dispatch.client import RankClient
    from .detached import Hold

log = logging.getLogger("raydist")


class Adoption(LifeParts):
    """`raydist.driver.lifecycle.lifecycle.Lifecycle`'s part for a detached model's running ranks."""

    client: RankClient | None
    hold: Hold | None

    def adopt(self, actors: list, pg: Any, meshes: list, mode: str, rate: Any = None) -> None:
        """Take over the running ranks of a detached model (its driver gone, or taken over): where
        they stand (their step, modes, learning rate) is asked of them. If a rank is gone, or the
        ranks disagree (their driver died while it sent a step), a new group starts from the last
        checkpoint instead. ``rate``: the learning rate's newest position, as the driver before knew it."""
        self.meshes = meshes
        try:
            group = RankGroup(self.config, adopt=(actors, pg))
            stands = group.call(RankActor.reattach, during="attach")
        except RankError as e:
            return self._start_over(f"a rank is gone ({str(e).splitlines()[0]})")
        if len({s.trained for s in stands}) > 1 or any(s.broke_off for s in stands):
            group.shutdown()
            return self._start_over(f"the ranks stand at different train steps {[s.trained for s in stands]}")
        self._took(group, max(s.next_step for s in stands), stands[0].trained)
        self.modes.adopt(meshes, stands[0].built)
        self.rates.started(stands[0].learning_rate)
        self.rates.catch_up(rate)
        if stands[0].built:
            self.state.built("train" in stands[0].built)
        self.modes.mode = mode
        self.modes.resume()
        self._mirror(stands[0].trained)
        self._watching()

    def _start_over(self, why: str) -> None:
        """A new group for a detached model whose ranks cannot go on, from its last checkpoint."""
        saved = self.state.saves.last
        path = saved.path if saved is not None else None
        log.warning("raydist: the detached model %r cannot go on where it stood: %s; starting its ranks again "
                    "from %s", self.config.name, why, path or "its initial parameters (no checkpoint)")  # fmt: skip
        self.start(first_step=checkpoint.read_manifest(path).get("step", 0) if path else 0,
                   base=saved.trained if saved is not None else 0)  # fmt: skip
        if path is not None:
            self.state.load(path, self.modes.built("train"), None)
        self.events.emit("restart", self.step(), size=self.live().size, source="checkpoint" if path else "start",
                         checkpoint=path, replayed=None)  # fmt: skip

    def _lost(self, why: str) -> None:
        """Another driver took this detached model over: stop using its ranks, without stopping them."""
        log.warning("raydist: %s", why)
        self._stop_watching_room()
        if self.client is not None:
            self.live().group.let_go(why)
        self.peers = None  # the keepers are the new driver's
