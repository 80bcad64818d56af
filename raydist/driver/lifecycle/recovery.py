"""Recovery after a rank died: the state its surviving peers hold, and whether a restart can go on from it.

A rank's death ends its group (Paddle cannot rejoin a process group in one
process), but the survivors' processes still hold their shards until they are
torn down. `Recovery` keeps the books a restart needs: which train steps the
driver sent to the live group and with which learning rate. When a rank dies,
`Recovery.salvage` asks the survivors, beside their steps, for their state:
if they hold all of it (every shard of the parameters and optimizer state, as
on a data-parallel mesh whose every group keeps a replica) at the last train
step the driver saw complete, a restart goes on from it and loses nothing but
the failed steps; otherwise from the last checkpoint.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import numpy as np
import ray

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
        self._salvaged: tuple[dict, Any, int] | None = None
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

    def take(self) -> tuple[dict, Any, int] | None:
        """(state, learning rate, train steps) the survivors held, if a rank died and they held all of it."""
        salvaged, self._salvaged = self._salvaged, None
        return salvaged


def live_state(actors: list, names: set[str]) -> tuple[int, dict[str, np.ndarray]] | str:
    """After a rank died: the FULL state its surviving peers hold, and the train steps it is
    after; or, if they do not hold all of it, why not.

    Asked beside their steps (`RankActor.live_state`): the dead ranks' calls fail at
    once, a survivor blocked in a collective that never returns gives nothing.
    """
    refs = call_on(actors, RankActor.live_state, LIVE_STATE_WAIT_S)
    deadline = time.monotonic() + LIVE_STATE_WAIT_S + 2.0
    answers, pending = {}, list(refs)
    while pending:
        # the first answers that hold all of it will do: a survivor blocked in a collective with
        # a peer that broke off its step would keep the restart waiting for LIVE_STATE_WAIT_S
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            answer = ray.get(ready[0])
        except Exception:  # noqa: BLE001 - a dead rank: it holds nothing
            continue
        if answer is not None:
            answers[refs.index(ready[0])] = answer
            if _why_not(answers, names) is None:
                found = assemble_live(answers, names)
                if not isinstance(found, str):
                    return found
    return assemble_live(answers, names)


def assemble_live(answers: dict[int, tuple[int, bool, dict]],
                  names: set[str]) -> tuple[int, dict[str, np.ndarray]] | str:  # fmt: skip
    """The full state (tensors ``names``) from the surviving ranks' ``{rank: (train steps,
    broke off, {name: (local, layout)})}``; or why it cannot be had: no survivor, survivors
    at different steps, a step that may have been broken off halfway through its updates,
    a piece or a tensor no survivor holds, or replicas that differ."""
    why = _why_not(answers, names)
    if why is not None:
        return why
    steps = {rank: t for rank, (t, _, _) in answers.items()}
    pieces = {rank: state for rank, (_, _, state) in answers.items()}
    full = {}
    for name in names:
        array, layout = next(state[name] for state in pieces.values() if name in state)
        if layout is None:
            full[name] = array
            continue
        local = {}
        for key, holders in layout.holders().items():
            alive = [r for r in holders if r in pieces]
            value = pieces[alive[0]][name][0]
            if any(not np.array_equal(pieces[r][name][0], value) for r in alive[1:]):
                return f"the surviving replicas of {name!r} differ"
            local[alive[0]] = value
        full[name] = layout.assemble(local)
    return next(iter(steps.values())), full


def _why_not(answers: dict[int, tuple[int, bool, dict]], names: set[str]) -> str | None:
    """Why the surviving ranks' answers cannot give the full state (short of comparing replicas); None if they can."""
    if not answers:
        return "no surviving rank answered"
    steps = {rank: t for rank, (t, _, _) in answers.items()}
    if len(set(steps.values())) > 1:
        return f"the surviving ranks stand at different steps ({steps})"
    pieces = {rank: state for rank, (_, _, state) in answers.items()}
    for rank, (_, broke_off, state) in answers.items():
        why = _half_updated(state) if broke_off else None
        if why:
            return f"rank {rank} broke off a train step, and {why}"
    missing = sorted(names - {name for state in pieces.values() for name in state})
    if missing:
        return f"no surviving rank holds {missing}"
    for name in names:
        _, layout = next(state[name] for state in pieces.values() if name in state)
        for key, holders in (layout.holders().items() if layout is not None else ()):
            if not any(r in pieces for r in holders):
                return f"no surviving rank holds piece {key} of {name!r} (held by ranks {holders})"
    return None


def _half_updated(state: dict) -> str | None:
    """Why a rank's state may hold some of a broken-off step's updates and not others; None if not.

    Paddle's train program updates each parameter right after its gradient's
    all_reduce, so a peer's death between two all_reduces leaves the first
    parameters updated. Adam-like optimizers count steps per parameter (their
    beta pow accumulators): equal counts show that no update, or every update,
    ran. Optimizers without such counts (SGD, Momentum) cannot show it.
    """
    counts: dict[str, set] = {}
    for name, (array, _) in state.items():
        for kind in ("beta1_pow_acc", "beta2_pow_acc"):
            if kind in name:
                counts.setdefault(kind, set()).add(float(np.asarray(array).ravel()[0]))
    if not counts:
        return "its optimizer keeps no per-parameter step count (Adam's beta pows) to show no update of it ran"
    if any(len(values) > 1 for values in counts.values()):
        return "some of its parameters were updated and others not"
    return None
