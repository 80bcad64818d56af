"""Spare ranks: actors started ahead of a restart, so that it skips their process start and import.

A restart after a failure (or a resize) starts every rank anew: Paddle's
process group cannot be joined twice in one process. Most of that time goes
to starting processes and importing Paddle (``python -m bench startup``). A
`SparePool` keeps ``count`` rank actors that have done both and joined
nothing: the next group adopts them (`raydist.driver.cluster.group.RankGroup`) and
starts only the ranks it still lacks; the pool then starts new spares for the
restart after.

Each spare holds one rank's resources (``resources_per_rank``) while it
waits, outside the group's placement group (which goes with the group), so
the placement strategy does not apply to it.
"""

from __future__ import annotations

import logging
import uuid

import ray

from .config import NO_ANSWER, GroupConfig, ping_all, start_actor

log = logging.getLogger("raydist")

# How long a spare has to answer before it counts as lost (its node gone, say).
ALIVE_S = 2.0


class SparePool:
    """``count`` warm rank actors that no group has adopted yet."""

    def __init__(self, config: GroupConfig, count: int):
        self.config = config
        self.count = count
        self._prefix = config.name or f"raydist-{uuid.uuid4().hex[:6]}"
        self._made = 0
        self._actors: list = []

    def __len__(self) -> int:
        return len(self._actors)

    def fill(self) -> None:
        """Start spares up to ``count`` (without waiting for them)."""
        while len(self._actors) < self.count:
            self._actors.append(start_actor(self.config, f"{self._prefix}-spare-{self._made}", -1, 0))
            self._made += 1

    def take(self, most: int) -> list:
        """Up to ``most`` live spares, out of the pool (lost ones are dropped)."""
        if not self._actors or most <= 0:
            return []
        live = []
        for actor, answer in zip(self._actors, ping_all(self._actors, ALIVE_S)):
            if answer is NO_ANSWER or isinstance(answer, ray.exceptions.RayActorError):
                log.warning("raydist: a spare rank did not answer; dropping it")
                _kill(actor)
            else:
                live.append(actor)
        taken, self._actors = live[:most], live[most:]
        return taken

    def give_back(self, actors: list) -> None:
        """Spares taken and not used."""
        self._actors[:0] = actors

    def shutdown(self) -> None:
        """Stop every spare. Idempotent."""
        actors, self._actors, self.count = self._actors, [], 0
        if ray.is_initialized():
            for actor in actors:
                _kill(actor)


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass
