"""The driver's one path to a group of ranks: control calls, steps, and the errors of both.

Everything the driver asks of the ranks goes through a `RankClient`:

- `RankClient.call` runs one `raydist.protocol.RankActor` endpoint on every rank
  (``client.call(RankActor.state_meta, "param")``) after the steps in flight
  are done, so a mode switch, a state read or a save never overtakes a step;
- `RankClient.step` adds a step to the window of steps in flight
  (`raydist.driver.dispatch.window`), which sends it, alone or with the next ones in
  one message, through the transport (`raydist.driver.dispatch.transport`);
- every failure, from either, reaches the caller as `RankError` naming the
  rank (`RankGroup.fail`), the group torn down once; a rank that hangs, as
  soon as it has hung for a step's limit (`raydist.driver.cluster.hangs`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...errors import GroupShutdownError
from ...messages import Parcel, StepMessage
from ...topology import REDUCTIONS
from ..cluster.config import Endpoint
from ..cluster.group import RankGroup
from ..cluster.hangs import Watch
from .transport import TREE_FROM, Transport, open_transport
from .window import Step, Window

log = logging.getLogger("raydist")



class LiveGroup:
    """The client of a model's live group of ranks, which a restart, a resize or an attach replaces
    (`raydist.driver.lifecycle.lifecycle.Lifecycle`): one cell the model's parts are made with."""

    def __init__(self) -> None:
        self.client: RankClient | None = None

    def get(self) -> RankClient:
        """The live group's client; a `GroupShutdownError` if there is none."""
        return live(self.client)


def live(client: RankClient | None) -> RankClient:
    """``client``, the live group's; a `GroupShutdownError` if there is none (the model was shut down)."""
    if client is None:
        raise GroupShutdownError("the model has no live group of ranks: it was shut down")
    return client


class RankClient:
    """The ranks of one `RankGroup`, the steps in flight to them, and how steps travel.

    ``first_step``: the number of the first step (steps are counted across
    restarts, so errors and checkpoints name the right one);
    ``steps_per_message``: see `raydist.driver.dispatch.window.Window`.
    """

    def __init__(self, group: RankGroup, *, max_in_flight: int, dispatch: str, step_timeout_s: float | None,
                 first_step: int = 0, steps_per_message: int | str = 1):  # fmt: skip
        self.group = group
        self.window = Window(max_in_flight, first_step, send=self._send, receive=self._receive,
                             most=steps_per_message)  # fmt: skip
        # on CPUs (where "auto" is still open), calls to a few ranks, relayed through many
        self._dispatch = dispatch if dispatch != "auto" else ("tree" if len(group) >= TREE_FROM else "calls")
        self.watch = Watch(group, step_timeout_s)
        self._transport: Transport | None = None
        self._opening = threading.Lock()
        self._after_first: list[Callable[[], Any]] = []

    @property
    def dispatch(self) -> str:
        """The dispatch in use: "calls", "tree" or "compiled"."""
        return self._dispatch

    def after_first_step(self, callback: Callable[[], Any]) -> None:
        """Call ``callback`` once the first message of steps is done (for work that would
        slow the group's first steps, such as starting spare ranks)."""
        self._after_first.append(callback)

    @property
    def size(self) -> int:
        return len(self.group)

    @property
    def alive(self) -> bool:
        return self.group.alive

    @property
    def transport(self) -> str | None:
        """"compiled", "calls" or "tree" once the first step opened it."""
        return None if self._transport is None else self._transport.name

    def actor(self, rank: int):
        """``rank``'s actor handle (for ranks that call each other, e.g. a loader's readers)."""
        return self.group.actors[rank]

    def call(self, method: Endpoint, *args: Any, ranks: Sequence[int] | None = None, **kwargs: Any) -> list[Any]:
        """``method``'s results from every rank (or ``ranks``), in order, once every step in flight is done."""
        self.window.drain()
        self.group.check_alive()
        return self.group.call(method, *args, ranks=ranks, watch=self.watch, **kwargs)

    def call_each(self, method: Endpoint, args: dict[int, tuple]) -> list[Any]:
        """``method``'s results from the ranks of ``args``, each called with its own arguments."""
        self.window.drain()
        self.group.check_alive()
        return self.group.call_each(method, args, watch=self.watch)

    def tell(self, rank: int, method: Endpoint, *args: Any, **kwargs: Any) -> None:
        """Call ``method`` on ``rank`` without waiting; its failures reach the steps that need it."""
        self.group.check_alive()
        self.group.tell(method, *args, ranks=[rank], **kwargs)

    def step(self, message: StepMessage, finish: Callable[[list], Any]) -> Step:
        """Add one step; ``finish`` turns the ranks' results into the step's (on completion)."""
        self.group.check_alive()
        return self.window.submit(message, finish)

    def _send(self, first: int, messages: list[StepMessage]) -> Any:
        self.group.check_alive()
        transport = self._open()
        return transport, transport.send(Parcel(first, tuple(messages)))

    def _receive(self, ticket: tuple, steps: range) -> list[StepAnswers]:
        """Each step's results from the ranks (a rank whose results are not read answers None)."""
        transport, sent = ticket
        answers = MessageAnswers(transport.receive(sent, steps))
        if self._after_first:  # once per group: the per-message path stays as it was
            self._run_after_first()
        return [StepAnswers(answers, i) for i in range(len(steps))]

    def _run_after_first(self) -> None:
        callbacks, self._after_first = self._after_first, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # e.g. no room for spares: the steps go on without them
                log.warning("raydist: %s failed after the first step", callback, exc_info=True)

    def complete_until(self, number: int) -> None:
        """Complete the steps in flight up to step ``number``; raises the first failure."""
        self.window.complete_until(number)

    def drain(self) -> None:
        """Complete every step in flight; raises the first failure."""
        self.window.drain()

    def close(self, drain: bool = False) -> None:
        """Stop the ranks (after the steps in flight, if ``drain``). Idempotent."""
        try:
            if drain and self.group.alive:
                self.window.drain()
        finally:
            transport, self._transport = self._transport, None
            if transport is not None and self.group.alive:
                transport.close()  # a graph stops before its actors do
            self.group.shutdown()

    def _open(self) -> Transport:
        if self._transport is None:
            with self._opening:
                self.group.check_alive()
                if self._transport is None:
                    transport = open_transport(self.group, self.window.size, self._dispatch, self.watch)
                    self.group.on_shutdown(transport.close)
                    self._transport = transport
        return self._transport


class MessageAnswers:
    """Every rank's answer to one message (a `raydist.messages.StepResults`, or None for a rank
    whose results are not read), and reductions over ranks done once for all its steps."""

    __slots__ = ("answers", "_reduced")

    def __init__(self, answers: list):
        self.answers = answers
        self._reduced: dict[tuple, Any] = {}

    def reduced(self, value: int, ranks: tuple[int, ...], op: str) -> Any:
        """``op`` over ``ranks`` of the value ``value``, for every step (None if not stacked per step)."""
        key = (value, ranks, op)
        if key not in self._reduced:
            stacked_by_transport: Callable[..., Any] | None = getattr(self.answers, "stacked", None)  # a tree's
            stacked = stacked_by_transport(value, ranks) if stacked_by_transport is not None else None
            if stacked is None:  # by rank: stack them here
                columns = [self.answers[r].columns[value] for r in ranks]
                if all(isinstance(c, np.ndarray) for c in columns):
                    stacked = np.stack(columns)
            self._reduced[key] = None if stacked is None else REDUCTIONS[op](stacked, axis=0).astype(stacked.dtype)
        return self._reduced[key]


class StepAnswers:
    """Step ``step``'s results by rank (``answers[rank]``: that rank's list of fetched values, or None)."""

    __slots__ = ("message", "step")

    def __init__(self, message: MessageAnswers, step: int):
        self.message, self.step = message, step

    def __getitem__(self, rank: int) -> list | None:
        answer = self.message.answers[rank]
        return None if answer is None else answer[self.step]

    def __len__(self) -> int:
        return len(self.message.answers)

    def reduced(self, value: int, ranks: tuple[int, ...], op: str) -> Any:
        """``op`` over ``ranks`` of this step's value ``value`` (reduced once for the message); None if
        the ranks' answers are not stacked per step."""
        reduced = self.message.reduced(value, ranks, op)
        return None if reduced is None else reduced[self.step]
