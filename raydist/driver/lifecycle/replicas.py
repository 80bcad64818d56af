"""The replica check: every N train steps, the data-parallel replicas of each shard compared.

``to_static(..., check_replicas=N)``. After every N-th train step each rank keeps a
CRC-32 of each of its shards (`raydist.worker.replicas`); once the driver has seen
that step complete it asks the ranks for them, beside the steps, and compares the
codes of every piece that several ranks hold (a layout's holders,
`raydist.topology.Layout.holders`). Ranks whose code differs from the majority's,
or every holder of a piece where there is no majority (two replicas), are a
`raydist.ReplicaMismatchError`, raised at the next train call: a `RankError`, so
``fit(max_failures=...)`` recovers from it as from a lost rank, going back to a
copy no later than the last check that passed (peer memory, or a checkpoint).
``replica_mismatch="warn"`` logs it and goes on.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import ray

from ...errors import ReplicaMismatchError
from ...protocol import RankActor
from ..cluster.config import call_on

log = logging.getLogger("raydist")


class ReplicaCheck:
    """The checks of one model: asked once their step completed, compared once every rank answered."""

    def __init__(self, every: int, warn: bool):
        self.every, self.warn = every, warn
        self.clean = 0  # the newest train-step count whose check passed (0: the start)
        self.mismatch: ReplicaMismatchError | None = None  # found, not yet raised
        self.started(None, 0)

    def started(self, actors: list | None, base: int, renumbered: bool = False) -> None:
        """A new group (its state after ``base`` train steps): no check asked of it yet.
        ``renumbered``: its steps count anew (a checkpoint's state, another driver's), so the
        last clean count is its start."""
        self._actors = actors
        self._next = (base // self.every + 1) * self.every  # the next count to check
        self._asked: collections.deque[tuple[int, list]] = collections.deque()
        self.clean = base if renumbered else max(self.clean, base)

    def due(self, sent: int) -> bool:
        """Whether there is anything to ask or compare, ``sent`` train steps being sent so far (a
        bound of those done: the train calls in between look no further)."""
        return self.mismatch is not None or bool(self._asked) or (self._actors is not None and self._next <= sent)

    def overdue(self, sent: int) -> int | None:
        """The oldest train-step count whose check is not compared yet though ``sent`` train steps
        were sent, ``every`` or more past it: a caller that sends more without it could train on a
        corrupt replica for longer than two checks' distance. None if none is."""
        if self._actors is None:
            return None
        oldest = self._asked[0][0] if self._asked else self._next
        return oldest if sent >= oldest + self.every else None

    def poll(self, completed: int, wait: Callable[[list], list] | None = None) -> None:
        """Ask for the checks of steps that completed (``completed``: the model's train steps done),
        compare those answered; a mismatch is kept for `raise_found`. ``wait``: get every one asked
        with it (the group's watched gather: a rank that hangs is found there, as in a step)."""
        if self._actors is None:
            return
        while self._next <= completed:
            self._asked.append((self._next, call_on(self._actors, RankActor.replica_codes, self._next)))
            self._next += self.every
        while self._asked and (wait is not None or not ray.wait(self._asked[0][1], num_returns=len(self._asked[0][1]),
                                                                timeout=0)[1]):  # fmt: skip
            index, refs = self._asked.popleft()
            if wait is not None:
                codes = dict(enumerate(wait(refs)))
            else:
                try:
                    codes = dict(enumerate(ray.get(refs)))
                except Exception:  # noqa: BLE001 - a rank's failure reaches the driver by its own path
                    continue
            found = compare(codes, index)
            if found is None:
                if all(mine is not None for mine in codes.values()):  # a rank without its codes proves nothing
                    self.clean = max(self.clean, index)
            elif self.warn:
                log.warning("raydist: %s (replica_mismatch='warn': going on)", found.cause)
            else:
                self.mismatch = found

    def raise_found(self) -> None:
        """Raise the mismatch found, once."""
        found, self.mismatch = self.mismatch, None
        if found is not None:
            self._actors = None  # the group is to be replaced
            raise found


def compare(codes: dict[int, dict[str, tuple[tuple, int]] | None], index: int) -> ReplicaMismatchError | None:
    """The mismatch among the ranks' ``codes`` ({rank: {name: (piece key, code)}}, None: not kept)
    after ``index`` train steps; None if the replicas of every piece agree."""
    pieces: dict[tuple[str, tuple], dict[int, int]] = collections.defaultdict(dict)
    for rank, mine in codes.items():
        for name, (key, code) in (mine or {}).items():
            pieces[(name, tuple(key))][rank] = code
    bad_ranks: set[int] = set()
    bad_names: set[str] = set()
    for (name, _), values in pieces.items():
        count = collections.Counter(values.values())
        if len(count) <= 1:
            continue
        top, n = count.most_common(1)[0]
        majority = n * 2 > len(values)
        bad_ranks.update(r for r, v in values.items() if not majority or v != top)
        bad_names.add(name)
    if not bad_names:
        return None
    return ReplicaMismatchError(index, sorted(bad_ranks), sorted(bad_names))
