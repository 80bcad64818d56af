"""Steps in flight: the driver sends step k+1 before step k is done.

A `DistModel` call dispatches a step to every rank and returns at once: a
`Loss` for train and eval, read from the ranks only when it is used as a
number. At most ``max_in_flight`` messages are outstanding. A call made
while the ranks are idle goes out at once; one made while a message is out
is held at the driver and goes out with the next message, which leaves when
it holds ``steps_per_message`` steps (after waiting for the oldest if
``max_in_flight`` are out), when a loss is read, or as soon as the driver
sees the oldest message done. The ranks run a message's steps back to back,
so a loop of short steps costs the ranks one message per many steps, not one
per step, and a loop that reads its loss every few steps two messages per
read: the step after a read, and the steps up to the next one, which reach
the ranks while they run the first. Whenever the driver waits for a message
and fewer than ``max_in_flight`` are out, what is held goes first, so a loop
that reads the loss of the step before the one it just sent keeps the ranks
busy as it would with every step sent at once. A failure surfaces a few
calls later, as a `RankError` naming the step, the rank and its traceback;
reading a loss, a mode switch or any other call to the ranks sends what is
held first.

Steps complete in order, from any thread (a progress thread may read a
`Loss` while the main thread sends). Ctrl-C (``KeyboardInterrupt``) while
waiting for a step leaves that step and the later ones in flight: the ranks
go on with them, their losses stay readable, and the next call waits for them
first. A step is never half sent: an interrupt during a send is raised once
the step is counted.
"""

from __future__ import annotations

import _signal  # signal.getsignal without its enum conversion: 5 µs a call, several calls a step
import collections
import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ...options import check_positive_int

# steps_per_message="auto": a message holds steps for about this long (so the
# driver's cost per message is a small share), and at most AUTO_MOST of them
# (so a progress bar still moves, and a failure is not far behind).
MESSAGE_S = 0.5
AUTO_MOST = 64
KEEP_MESSAGES = 2048  # messages the window keeps for the timeline


class Step:
    """One step: held at the driver, then sent in a message (`Sent`), then done with its result or error."""

    __slots__ = ("number", "message", "finish", "parcel", "_window", "_value", "_error", "done")

    def __init__(self, number: int, message: Any, finish: Callable[[Any], Any], window: Window):
        self.number = number
        self.message = message  # until sent
        self.finish = finish  # the ranks' results of this step -> the step's result
        self.parcel: Sent | None = None  # once sent
        self._window = window
        self._value = None
        self._error: BaseException | None = None
        self.done = False

    def result(self) -> Any:
        """The step's result; sends it if it is still held, and waits for it (and every older step)."""
        if not self.done:
            self._window.complete_through(self)
        if self._error is not None:
            raise self._error
        return self._value


class Sent:
    """Steps sent in one message (its wire form is `raydist.messages.Parcel`); ``ticket`` is what the
    transport returned for it; ``sending`` and ``sent``: when its send began and ended
    (``time.monotonic_ns``)."""

    __slots__ = ("steps", "ticket", "sending", "sent")

    def __init__(self, steps: list[Step], ticket: Any, sending: int):
        self.steps = steps
        self.ticket = ticket
        self.sending = sending
        self.sent = time.monotonic_ns()

    @property
    def sent_at(self) -> float:
        """When it was sent, on ``time.monotonic``'s scale."""
        return self.sent / 1e9

    @property
    def numbers(self) -> range:
        return range(self.steps[0].number, self.steps[-1].number + 1)


class Window:
    """The steps not yet done, oldest first: at most ``size`` messages in flight; numbered from ``first``.

    ``send(first, messages)`` sends the messages of consecutive steps as one
    message and returns its ticket; ``receive(ticket, numbers)`` waits for it
    and returns each step's results from the ranks (raising a failure).
    ``most``: steps per message at most; "auto" (`AUTO_MOST`) sizes messages
    to about `MESSAGE_S` of steps, from the steps' measured pace.
    """

    def __init__(self, size: int, first: int = 0, *, send: Callable[[int, list], Any],
                 receive: Callable[[Any, range], list], most: int | str = 1):  # fmt: skip
        check_positive_int("max_in_flight", size)
        check_positive_int("steps_per_message", most, also=("auto",))
        self.size = size
        self._send, self._receive = send, receive
        self._auto = isinstance(most, str)  # "auto", the one str allowed
        self.most: int = AUTO_MOST if isinstance(most, str) else most
        self._k = 1 if self._auto else self.most  # steps per message now
        self._sent: collections.deque[Sent] = collections.deque()
        self._held: list[Step] = []  # submitted while `size` messages were in flight
        self._count = first
        self.completed = first  # the number after the last step done without failing
        self.messages = 0  # messages sent
        self._done_at: float | None = None  # when the last message was done
        self._lock = threading.Lock()  # the queues and the count
        self._completing = threading.Lock()  # one thread waits for the oldest message at a time
        # the last messages, for the timeline: (first step, steps, send began, sent, done), monotonic ns
        self.log: collections.deque = collections.deque(maxlen=KEEP_MESSAGES)
        self.send_ns = 0  # the driver's time in sends, over every message

    def submit(self, message: Any, finish: Callable[[Any], Any]) -> Step:
        """Add a step. It is sent at once if no message is in flight; otherwise it is held,
        to go with the next message, which leaves when `steps_per_message` steps are held
        (once fewer than ``size`` messages are in flight: after the oldest if need be), when
        a loss is read, or once the oldest message is done.

        Held rather than sent beside a running message: each message costs every rank
        about as much CPU as a small step (BENCHMARKS.md: a loss read every step against
        none), so a loop reading every 10 steps sends 2 messages per read, not 3."""
        with _interrupts_deferred(), self._lock:
            step = Step(self._count, message, finish, self)
            self._count += 1
            self._held.append(step)
            if not self._sent or (len(self._held) >= self._k and len(self._sent) < self.size):
                self._send_held()
                return step
            if len(self._held) < self._k:
                return step
        try:
            self._complete_oldest()  # which sends what is held
        except KeyboardInterrupt:
            with self._lock:  # an interrupted call sends nothing: its step goes
                if self._held and self._held[-1] is step:
                    self._held.pop()
                    self._count -= 1
            raise
        return step

    def complete_through(self, step: Step) -> None:
        while not step.done:
            self._complete_oldest()  # which sends what is held first, if there is room

    def complete_until(self, number: int) -> None:
        """Complete the steps up to step ``number`` (raising the first failure)."""
        while self.completed <= number and (self._sent or self._held):
            self._complete_oldest()

    def drain(self) -> None:
        """Send what is held, and complete every step (raising the first failure)."""
        while self._sent or self._held:
            self._complete_oldest()

    def __len__(self) -> int:
        """Steps not done yet (held or in flight)."""
        return sum(len(p.steps) for p in self._sent) + len(self._held)

    @property
    def oldest(self) -> int | None:
        """The number of the oldest step not done (being completed, or failing); None if none."""
        if self._sent:
            return self._sent[0].steps[0].number
        return self._held[0].number if self._held else None

    @property
    def submitted(self) -> int:
        """The number the next step will get (steps submitted so far, counted from ``first``)."""
        return self._count

    def _send_held(self) -> None:
        """Send the held steps as one message (with the lock held)."""
        steps, self._held = self._held, []
        sending = time.monotonic_ns()
        try:
            ticket = self._send(steps[0].number, [s.message for s in steps])
        except BaseException as e:
            for step in steps:
                step._error, step.done = e, True
            raise
        for step in steps:
            step.message = None
        parcel = Sent(steps, ticket, sending)
        self.send_ns += parcel.sent - sending
        for step in steps:
            step.parcel = parcel
        self._sent.append(parcel)
        self.messages += 1

    def _complete_oldest(self) -> None:
        with self._completing:
            with _interrupts_deferred(), self._lock:
                if not self._sent:
                    if self._held:
                        self._send_held()
                    return
                if self._held and len(self._sent) < self.size:
                    # the driver is about to wait: what is held goes first, for the ranks to run
                    # next (a loop that reads the loss of the step before the one it just sent)
                    self._send_held()
                parcel = self._sent[0]
            try:
                results = self._receive(parcel.ticket, parcel.numbers)
                values = [step.finish(r) for step, r in zip(parcel.steps, results)]
            except KeyboardInterrupt as e:
                raise KeyboardInterrupt(self._interrupted(parcel.steps[0])) from e
            except BaseException as e:
                with self._lock:  # the group is gone: the later steps cannot complete
                    for p in self._sent:
                        for failed in p.steps:
                            failed._error, failed.done = e, True
                        p.ticket = None
                    for failed in self._held:
                        failed._error, failed.done, failed.message = e, True, None
                    if self._held:  # never sent: the ranks' next steps take their numbers
                        self._count = self._held[0].number
                    self._sent.clear()
                    self._held.clear()
                raise
            with _interrupts_deferred(), self._lock:
                self._sent.popleft()
                parcel.ticket = None
                self.log.append((parcel.steps[0].number, len(parcel.steps), parcel.sending, parcel.sent,
                                 time.monotonic_ns()))  # fmt: skip
                for step, value in zip(parcel.steps, values):
                    step._value, step.done = value, True
                self.completed = parcel.steps[-1].number + 1
                self._pace(parcel)
                if self._held:  # room now: the ranks get the held steps at once
                    self._send_held()

    def _pace(self, parcel: Sent) -> None:
        """Size the next messages (auto) to about MESSAGE_S of steps, from how fast this one went."""
        now = time.monotonic()
        began = parcel.sent_at if self._done_at is None else max(parcel.sent_at, self._done_at)
        self._done_at = now
        if self._auto:
            per_step = max(now - began, 1e-6) / len(parcel.steps)
            self._k = max(1, min(self.most, int(MESSAGE_S / per_step)))

    def _interrupted(self, step: Step) -> str:
        last = self._count - 1
        steps = f"step {step.number}" if last == step.number else f"steps {step.number}-{last}"
        return (f"while waiting for step {step.number}: {steps} still run on the ranks; their results stay "
                "readable, and the next call waits for them first")  # fmt: skip


class _Deferral:
    """Ctrl-C held back in the main thread while the window's books are changed.

    Swapping SIGINT's handler around every send would cost two signal calls a
    step, so the first use puts `_on_sigint` in place of Python's default handler for good:
    it raises KeyboardInterrupt as the default one does, except inside
    `interrupts_deferred`, where it notes the interrupt for the block's end. A
    handler of the program's own is left alone (and nothing is deferred).
    """

    depth = 0  # blocks entered (main thread only)
    caught = False

    @classmethod
    def on_sigint(cls, signum, frame):
        if cls.depth:
            cls.caught = True
            return
        signal.default_int_handler(signum, frame)


_SIGINT = int(signal.SIGINT)


@contextlib.contextmanager
def _interrupts_deferred():
    """Hold Ctrl-C back (main thread only) until the block is done, then raise it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _signal.getsignal(_SIGINT)
    if handler is signal.default_int_handler:
        signal.signal(_SIGINT, _Deferral.on_sigint)
    elif handler != _Deferral.on_sigint:
        yield
        return
    _Deferral.depth += 1
    try:
        yield
    finally:
        _Deferral.depth -= 1
    if not _Deferral.depth and _Deferral.caught:
        _Deferral.caught = False
        raise KeyboardInterrupt("the step was sent first: it runs, and its result stays readable")


class Evaluated(NamedTuple):
    """An eval step with metrics: its loss, and each metric's values (to ``Metric.update``)."""

    loss: float
    metrics: list[list[np.ndarray]]

    def __float__(self) -> float:
        return self.loss
