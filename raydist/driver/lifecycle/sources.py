"""Where a restart takes its state from: four sources, each saying what it can give or why not, and one rule.

A failure leaves a `Failure`: the books of the failed group (`Recovery`), the state its
survivors held, and where its steps stood. Each source looks at it and makes an `Offer`
(a state after some train steps, and the train steps since that a replay can run) or
says, in a sentence for the log, why it cannot serve:

- `Survivors`: the surviving ranks' live state, at the last completed step;
- `PeerCopies`: the newest complete copy in peer memory, and the steps since;
- `Checkpoints`: the newest checkpoint of the current timeline;
- `Start`: the builders' initial state (with the steps since it, when the driver kept them).

`choose` takes the offer whose state, after its replay, is the newest; on a tie the one
first in `ORDER` (no replay beats a replay, memory beats disk). After a replica mismatch
(`Failure.bound`) no source offers a state newer than the last check that passed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from ... import checkpoint
from ...messages import ArraysStep
from .recovery import locate

if TYPE_CHECKING:
    from ..model.saves import Saves
    from .peers import PeerMemory
    from .recovery import Recovery

ORDER = ("replicas", "peer_memory", "checkpoint", "start")


@dataclasses.dataclass
class Failure:
    """What a failure left for its restart, read once: a restart that fails itself (a node lost while
    its ranks are placed, a rank dead in the replay) is tried again from the same. ``recovery``: the
    books of the failed group; ``salvaged``: its survivors' state (state, rate, train steps of the
    group), or None and ``unsalvaged`` why not; ``first_step``, ``done``: the numbers of the next step
    and of the first not completed; ``completed``: the train steps done (over the model's life);
    ``bound``: the newest count whose state a restart trusts (the last clean check after a mismatch);
    ``rate``: the learning rate the first step not completed ran with; ``spent``: the states a restart
    failed to hand over (their pieces' node gone): "replicas", and peer memory's copies by index."""

    recovery: Recovery
    salvaged: tuple[dict, Any, int] | None
    first_step: int
    done: int
    completed: int
    bound: int
    rate: Any
    unsalvaged: str
    spent: set = dataclasses.field(default_factory=set)  # states whose hand-over failed: "replicas", copy indices


@dataclasses.dataclass(frozen=True)
class Offer:
    """What ``source`` can give a restart: the state after ``trained`` train steps (``state``: where
    its pieces lie, `raydist.handover.StateMap`, for the new ranks to fetch; None: a checkpoint's, read
    from ``path`` by the new ranks, or the builders'),
    with the learning rate ``rate`` (None: the replay's, the checkpoint's or the builders'), and
    the (rate, message) of each train step since (``steps``) for a replay when ``replay``.
    ``replayed``: the steps the driver saw done that the state is behind (for the event)."""

    source: str
    trained: int
    replayed: int
    state: dict | None = None
    rate: Any = None
    steps: tuple = ()
    path: str | None = None
    replay: bool = False

    @property
    def reaches(self) -> int:
        """The train steps the state is after once the replay ran."""
        return self.trained + replayable(self.steps)


class Source(Protocol):
    def offer(self, failure: Failure) -> Offer | str:
        """What this source can give the restart of ``failure``, or why it cannot."""


def choose(offers: dict[str, Offer | str]) -> Offer:
    """The rule: the offer whose state is the newest after its replay; on a tie, the first in `ORDER`."""
    found = [o for o in offers.values() if isinstance(o, Offer)]
    return max(found, key=lambda o: (o.reaches, -ORDER.index(o.source)))


def replayable(steps: tuple | list) -> int:
    """How many of ``steps`` ((rate, message) each) a replay can run: those up to the first that came
    from a loader (the loop feeds that one and the rest again)."""
    return next((i for i, (_, message) in enumerate(steps) if not isinstance(message, ArraysStep)), len(steps))


class Survivors:
    """The state the surviving ranks held when a rank died (`Recovery.salvage`)."""

    def offer(self, failure: Failure) -> Offer | str:
        if failure.salvaged is not None and "replicas" in failure.spent:
            return "the survivors' state could not be handed over (a node that held some of it is gone)"
        if failure.salvaged is None:
            return failure.unsalvaged
        state, rate, trained = failure.salvaged
        return Offer("replicas", failure.recovery.base + trained, 0, state=state, rate=rate)


class PeerCopies:
    """Peer memory's copies (`raydist.driver.lifecycle.peers`): the newest whose every shard is held,
    made at or before the failure's bound, with the driver still keeping the steps since."""

    def __init__(self, peers: PeerMemory | None, names: set[str]):
        self.peers, self.names = peers, names

    def offer(self, failure: Failure) -> Offer | str:
        if self.peers is None:
            return "the model has no peer memory"
        whys = []
        for (_, index), holders in sorted(self.peers.copies().items(), key=lambda kv: kv[0][::-1],
                                                   reverse=True):  # fmt: skip
            if index > failure.bound:
                whys.append(f"the copy after {index} train steps is newer than the last state to trust "
                            f"({failure.bound})")  # fmt: skip
                continue
            steps = failure.recovery.since(index, failure.completed)
            if steps is None:
                whys.append(f"the driver no longer keeps the train steps since the copy after {index}")
                continue
            if index in failure.spent:
                whys.append(f"the copy after {index} train steps could not be handed over before")
                continue
            try:
                holdings = {rank: self.peers.read(held) for rank, held in holders.items()}
            except Exception as e:  # noqa: BLE001 - a keeper lost meanwhile: an older copy may do
                first = str(e).splitlines()[0] if str(e) else ""
                whys.append(f"the copy after {index} train steps could not be read ({type(e).__name__}: {first})")
                continue
            found = locate(holdings, self.names)
            if not isinstance(found, str):
                return Offer("peer_memory", index, len(steps), state=found[1], steps=tuple(steps), replay=True)
            whys.append(f"the copy after {index} train steps is incomplete: "
                        f"{found.replace('surviving rank', 'rank kept')}")  # fmt: skip
        return "; ".join(whys[:3]) or "no copy is left (none made yet, or the ranks that made them and the " \
            "keepers that held them are all gone)"


class Checkpoints:
    """The newest checkpoint of the current timeline (`raydist.driver.model.saves`) at or before the bound."""

    def __init__(self, saves: Saves):
        self.saves = saves

    def offer(self, failure: Failure) -> Offer | str:
        saved = self.saves.newest(at_most=failure.bound)
        if saved is None:
            newer = self.saves.last
            return "no checkpoint on this timeline" if newer is None else \
                f"every checkpoint is newer than the last state to trust ({failure.bound} train steps)"  # fmt: skip
        step = checkpoint.read_manifest(saved.path).get("step", 0)
        return Offer("checkpoint", saved.trained, max(0, failure.done - step), path=saved.path)


class Start:
    """The builders' initial state, which every new group makes again; with the steps since it when the
    model never left its first timeline (no checkpoint loaded, no restart from one) and the driver
    kept them all (peer memory keeps the steps' messages)."""

    def __init__(self, saves: Saves):
        self.saves = saves

    def offer(self, failure: Failure) -> Offer | str:
        recovery = failure.recovery
        steps = recovery.since(0, failure.completed) if recovery.base == 0 and self.saves.last is None else None
        if steps is not None and any(message is not None for _, message in steps):
            return Offer("start", 0, len(steps), steps=tuple(steps), replay=True)
        return Offer("start", 0, failure.done)
