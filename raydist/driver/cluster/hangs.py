"""Hung ranks: a step's time limit, counted from the step the ranks last began.

A message may hold many steps (``steps_per_message``), so its limit cannot be a
step's limit times its steps: a collective that hangs in the first of 64 steps
would be found after 64 limits. The driver instead waits for a message in
slices; whenever a slice ends without the answer, it asks every rank, beside
its steps (`raydist.protocol.RankActor.ping`), which step it runs and for how
long. A rank that has been in one step longer than the limit, or that has not
answered for that long (a stopped process, a host cut off), fails the wait
with `RankError` naming it; the group is torn down. A rank whose process died
is not this module's business: Ray reports that at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ...errors import RankError
from ...messages import Progress
from .config import NO_ANSWER, ping_all

T = TypeVar("T")

# A rank in one step gets this much longer than step_timeout_s, so that its own timeout (a step
# that waits step_timeout_s for its loader batch) is what gets reported. A silent rank (a stopped
# process, a host cut off) reports nothing of its own: it is named after step_timeout_s.
REPORT_GRACE_S = 5.0
# How long a rank has to answer a ping before it counts as silent this time.
PING_S = 2.0
# The driver looks at the ranks every quarter of the limit, within these bounds: a silent rank is
# named within step_timeout_s + LOOK_MAX_S + PING_S of its last answer.
LOOK_MIN_S, LOOK_MAX_S = 0.5, 2.5


class Watched(Protocol):
    """What a `Watch` asks of the group it watches (`raydist.driver.cluster.group.RankGroup`)."""

    actors: list[Any]

    def timed_out(self, stuck: list[int], during: str, why: str) -> RankError:
        """Tear the group down after ranks ``stuck`` hung (``why``: how): the error to raise."""
        ...


class Watch:
    """The limit on a step of ``group``'s ranks (``step_timeout_s`` + `REPORT_GRACE_S`; None: none), and
    on a rank's silence (``step_timeout_s``). ``clock``: seconds, monotonic (tests give a fake one)."""

    def __init__(self, group: Watched, step_timeout_s: float | None, clock: Callable[[], float] = time.monotonic):
        self.group = group
        self._clock = clock
        self.limit = None if step_timeout_s is None else step_timeout_s + REPORT_GRACE_S
        self.silence = step_timeout_s
        self.every = None if self.limit is None else min(max(self.limit / 4, LOOK_MIN_S), LOOK_MAX_S)

    def wait(self, get: Callable[[float | None], T], during: str) -> T:
        """``get(timeout)``'s answer, asked in slices (``get`` raises `TimeoutError` when a slice
        ends first; it must be safe to ask again). Between slices the ranks are looked at: a rank
        hung for longer than the limit raises `RankError` (the group torn down)."""
        if self.limit is None:
            return get(None)
        began = self._clock()
        heard: dict[int, float] = {}  # rank -> when it last answered
        while True:
            try:
                return get(self.every)
            except TimeoutError:
                pass
            asked = self._clock()
            answers = ping_all(self.group.actors, PING_S)
            silent, hung, longest = [], [], 0.0
            for rank, answer in enumerate(answers):
                if answer is NO_ANSWER:
                    silent.append(rank)
                    continue
                heard[rank] = asked
                if isinstance(answer, Progress):
                    longest = max(longest, answer.for_s)
                    if answer.for_s > self.limit:
                        hung.append(rank)
            silence = self.silence if self.silence is not None else math.inf
            gone = [r for r in silent if self._clock() - heard.get(r, began) > silence]
            if gone or (hung and silent):
                raise self.group.timed_out(
                    silent, during,
                    f"no answer from ranks {silent} for {self.silence:g} s or more (a stopped process, or a host cut "
                    "off from the others)" + (f"; ranks {hung} wait in one step for {longest:.0f} s" if hung else ""),
                )  # fmt: skip
            if hung:
                raise self.group.timed_out(
                    hung, during,
                    f"ranks {hung} have been in one step for {longest:.0f} s, more than step_timeout_s + "
                    f"{REPORT_GRACE_S:.0f} s: a collective that never returns, or a peer that vanished without Ray "
                    "noticing (raise step_timeout_s for longer steps)",
                )  # fmt: skip
