"""Recovery after a rank died: the state its surviving peers hold, and whether a restart can go on from it.

A rank's death ends its group (Paddle cannot rejoin a process group in one
process), but the survivors' processes still hold their shards until they are
torn down. `Recovery` keeps the books a restart needs: which train steps the
driver sent to the live group and with which learning rate. When a rank dies,
`Recovery.salvage` asks the survivors, beside their steps, to hand over their
state: each puts its pieces in its node's object store, the driver keeps the
references (`raydist.handover`: the state never passes through the driver). If
they hold all of it (every shard of the parameters and optimizer state, as on a
data-parallel mesh whose every group keeps a replica) at the last train step the
driver saw complete, a restart goes on from it and loses nothing but the failed
steps: each new rank fetches the pieces its shards need.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any

import ray

from ...handover import Piece, StateMap, Tensor
from ...protocol import RankActor
from ..cluster.config import call_on
from ..cluster.group import RankGroup

log = logging.getLogger("raydist")

# How long the survivors of a rank's death have to finish or break off their step
# and hand over their state; past it, the group is torn down without it.
LIVE_STATE_WAIT_S = 3.0


class Recovery:
    """The train steps sent to the live group, and the survivors' state once a rank of it died."""

    def __init__(self, keep: int = 1, base: int = 0, carried: list | None = None) -> None:
        self.started(keep, base, carried)

    def started(self, keep: int, base: int = 0, carried: list | None = None) -> None:
        """A new group: no train step sent to it yet. ``keep``: how many of the latest to remember
        (more than can be in flight, and with peer memory the steps since the last copies);
        ``base``: the train steps the model's state is after (the model's count goes on from it);
        ``carried``: the books of the steps before ``base`` that the group before kept (`before`)."""
        self.base = base
        self.trained = 0  # train steps sent to this group
        # (train-step index over the model's life, step number, rate, message)
        self._sent: collections.deque = collections.deque(carried or (), maxlen=max(keep, 1))
        self._salvaged: tuple[StateMap, Any, int] | None = None
        self.unsalvaged = "no rank died (a step failed, or hung)"  # why there is no salvaged state

    def sent(self, number: int, rate: Any, message: Any = None) -> None:
        """Train step ``number`` was sent, to run with learning rate ``rate`` (`LearningRate.position`);
        ``message``: what it carried (kept for a replay from peer memory)."""
        self._sent.append((self.base + self.trained, number, rate, message))
        self.trained += 1

    def completed(self, done: int) -> int:
        """The train steps the model completed (over its life), ``done``: the number of the first
        step of any mode that did not complete."""
        return self.base + self.trained - sum(1 for _, number, _, _ in self._sent if number >= done)

    def before(self, index: int) -> list:
        """The books of the train steps kept from before ``index`` (for the next group: the copies
        made before it stay servable with the steps since; later ones are of a timeline left)."""
        return [entry for entry in self._sent if entry[0] < index]

    def number(self, index: int) -> int | None:
        """The step number of train step ``index`` (over the model's life; None: not kept, or not sent)."""
        return next((number for i, number, _, _ in reversed(self._sent) if i == index), None)

    def since(self, index: int, completed: int) -> list[tuple[Any, Any]] | None:
        """(rate, message) of the train steps from ``index`` (over the model's life) to ``completed``,
        in order; None if the oldest of them is no longer kept."""
        kept = [(i, rate, message) for i, _, rate, message in self._sent if index <= i < completed]
        if len(kept) != completed - index:
            return None
        return [(rate, message) for _, rate, message in kept]

    def resume_rate(self, done: int, rate_now: Any) -> Any:
        """The learning rate the first step that did not complete ran with (else ``rate_now``)."""
        return next((rate for _, number, rate, _ in self._sent if number >= done), rate_now)

    def salvage(self, group: RankGroup, names: set[str], failing: int | None, rate_now: Any) -> None:
        """A rank of ``group`` died: keep the state its survivors hold (tensors ``names``) if they hold all
        of it at the last train step the driver saw complete. ``failing``: the number of the oldest
        step not done; ``rate_now``: the learning rate the next step would run with."""
        found = live_state(group.actors, names)
        if isinstance(found, str):
            self.unsalvaged = found
            log.warning("raydist: the surviving ranks cannot serve a restart: %s", found)
            return
        trained, state = found
        unfinished = [i - self.base for i, number, _, _ in self._sent if failing is not None and number >= failing]
        if trained != self.trained - len(unfinished):
            self.unsalvaged = (f"the surviving ranks are after {trained} train steps, the driver saw "
                               f"{self.trained - len(unfinished)} complete")  # fmt: skip
            log.warning("raydist: %s", self.unsalvaged)
            return
        rate = rate_now if not unfinished else next(r for i, _, r, _ in self._sent if i - self.base == trained)
        self._salvaged = (state, rate, trained)

    def take(self) -> tuple[StateMap, Any, int] | None:
        """(where the state lies, learning rate, train steps) the survivors held, if a rank died and they
        held all of it."""
        salvaged, self._salvaged = self._salvaged, None
        return salvaged


@dataclasses.dataclass(frozen=True)
class Holding:
    """What a rank, or a keeper for a copy, holds of the state: after ``trained`` train steps (the
    rank's count, or the copy's index); ``torn``: why it may hold some of a broken-off step's updates
    and not others (None: it cannot); ``pieces``: `raydist.handover.Piece` by name; ``sources``: where
    each lies (an object reference the driver owns, or a `raydist.handover.Kept`)."""

    trained: int
    torn: str | None
    pieces: dict[str, Piece]
    sources: dict[str, Any]


def live_state(actors: list, names: set[str], wait_s: float = LIVE_STATE_WAIT_S) -> tuple[int, StateMap] | str:
    """After a rank died (or before a move): where the FULL state the live ranks hold lies, and the
    train steps it is after; or, if they do not hold all of it, why not.

    Asked beside their steps (`RankActor.hand_over`): the dead ranks' calls fail at once, a
    survivor blocked in a collective that never returns gives nothing. Each piece is an object
    the driver owns on its rank's node, never read here: it outlives the rank's end.
    """
    order = sorted(names)
    calls = call_on(actors, RankActor.hand_over, wait_s, order, num_returns=len(order) + 1)
    refs = [call[0] for call in calls]
    deadline = time.monotonic() + wait_s + 2.0
    answers, pending = {}, list(refs)
    while pending:
        # the first answers that hold all of it will do: a survivor blocked in a collective with
        # a peer that broke off its step would keep the restart waiting for wait_s
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            answer = ray.get(ready[0])
        except Exception:  # noqa: BLE001 - a dead rank: it holds nothing
            continue
        if answer is not None:
            rank = refs.index(ready[0])
            trained, torn, pieces = answer
            answers[rank] = Holding(trained, torn, pieces, {n: calls[rank][1 + order.index(n)] for n in pieces})
            found = locate(answers, names)
            if not isinstance(found, str):
                return found
    return locate(answers, names)


def locate(holdings: dict[int, Holding], names: set[str]) -> tuple[int, StateMap] | str:
    """Where each piece of the full state (tensors ``names``) lies among the ranks' ``holdings``
    (by rank), and the train steps it is after; or why it cannot be had: no holder, holders at
    different steps, a step that may have been broken off halfway through its updates, a piece or
    a tensor no holder holds, or replicas that differ."""
    why = _why_not(holdings, names)
    if why is not None:
        return why
    found: StateMap = {}
    for name in sorted(names):
        holders = [r for r in sorted(holdings) if name in holdings[r].pieces]
        piece = holdings[holders[0]].pieces[name]
        if piece.layout is None:
            found[name] = Tensor(piece.shape, piece.dtype, None, {(): holdings[holders[0]].sources[name]})
            continue
        sources = {}
        for key, ranks in piece.layout.holders().items():
            alive = [r for r in ranks if r in holders]
            if len({holdings[r].pieces[name].code for r in alive} - {None}) > 1:
                return f"the surviving replicas of {name!r} differ"
            sources[key] = holdings[alive[0]].sources[name]
        found[name] = Tensor(piece.shape, piece.dtype, piece.layout, sources)
    return holdings[next(iter(holdings))].trained, found


def _why_not(holdings: dict[int, Holding], names: set[str]) -> str | None:
    """Why the holdings cannot give the full state (short of comparing replicas); None if they can."""
    if not holdings:
        return "no surviving rank answered"
    steps = {rank: h.trained for rank, h in holdings.items()}
    if len(set(steps.values())) > 1:
        return f"the surviving ranks stand at different steps ({steps})"
    for rank, holding in holdings.items():
        if holding.torn:
            return f"rank {rank} broke off a train step, and {holding.torn}"
    missing = sorted(names - {name for h in holdings.values() for name in h.pieces})
    if missing:
        return f"no surviving rank holds {missing}"
    for name in sorted(names):
        layout = next(h.pieces[name] for h in holdings.values() if name in h.pieces).layout
        for key, ranks in (layout.holders().items() if layout is not None else ()):
            if not any(r in holdings and name in holdings[r].pieces for r in ranks):
                return f"no surviving rank holds piece {key} of {name!r} (held by ranks {ranks})"
    return None
