"""Steps in flight: the driver sends step k+1 before step k is done.

A `DistModel` call dispatches a step to every rank and returns at once: a
`Loss` for train and eval, read from the ranks only when it is used as a
number. At most ``max_in_flight`` steps are outstanding; dispatching one
more first completes the oldest, so a failure surfaces at most that many
calls later, as a `RankError` naming the step, the rank and its traceback.

Steps complete in order, from any thread (a progress thread may read a
`Loss` while the main thread sends). Ctrl-C (``KeyboardInterrupt``) while
waiting for a step leaves that step and the later ones in flight: the ranks
go on with them, their losses stay readable, and the next call waits for them
first. A step is never half sent: an interrupt during a send is raised once
the step is counted.
"""

from __future__ import annotations

import collections
import contextlib
import math
import numbers
import operator
import signal
import threading
from typing import Any, Callable, NamedTuple

import numpy as np


class Step:
    """One dispatched step: its ticket (what the transport returned) until done, then its result or error."""

    __slots__ = ("number", "ticket", "finish", "_window", "_value", "_error", "done")

    def __init__(self, number: int, ticket: Any, finish: Callable[[Any, str], Any], window: "Window"):
        self.number = number
        self.ticket = ticket
        self.finish = finish  # (ticket, "step N") -> the step's result, raising a rank's failure
        self._window = window
        self._value = None
        self._error: BaseException | None = None
        self.done = False

    def result(self) -> Any:
        """The step's result; waits for it (and every older step)."""
        if not self.done:
            self._window.complete_through(self)
        if self._error is not None:
            raise self._error
        return self._value


class Window:
    """The steps in flight, oldest first, at most ``size`` of them; numbered from ``first``."""

    def __init__(self, size: int, first: int = 0):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"max_in_flight must be a positive int, got {size!r}")
        self.size = size
        self._steps: collections.deque[Step] = collections.deque()
        self._count = first
        self._lock = threading.Lock()  # the deque and the count
        self._completing = threading.Lock()  # one thread waits for the oldest step at a time

    def submit(self, send: Callable[[], Any], finish: Callable[[Any, str], Any]) -> Step:
        """Make room (complete the oldest steps), then ``send`` one; ``send`` returns its ticket."""
        while True:
            with _interrupts_deferred(), self._lock:
                if len(self._steps) < self.size:
                    step = Step(self._count, send(), finish, self)
                    self._count += 1
                    self._steps.append(step)
                    return step
            self._complete_oldest()

    def complete_through(self, step: Step) -> None:
        while not step.done:
            self._complete_oldest()

    def drain(self) -> None:
        """Complete every step in flight (raising the first failure)."""
        while self._steps:
            self._complete_oldest()

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def oldest(self) -> int | None:
        """The number of the oldest step in flight (being completed, or failing); None if none."""
        steps = self._steps
        return steps[0].number if steps else None

    @property
    def submitted(self) -> int:
        """The number the next step will get (steps sent so far, counted from ``first``)."""
        return self._count

    def _complete_oldest(self) -> None:
        with self._completing:
            with self._lock:
                if not self._steps:
                    return
                step = self._steps[0]
            try:
                value = step.finish(step.ticket, f"step {step.number}")
            except KeyboardInterrupt as e:
                raise KeyboardInterrupt(self._interrupted(step)) from e
            except BaseException as e:
                with self._lock:
                    for failed in self._steps:  # the group is gone: the later steps cannot complete
                        failed._error, failed.done, failed.ticket = e, True, None
                    self._steps.clear()
                raise
            with self._lock:
                self._steps.popleft()
                step._value, step.done, step.ticket = value, True, None

    def _interrupted(self, step: Step) -> str:
        last = self._count - 1
        steps = f"step {step.number}" if last == step.number else f"steps {step.number}-{last}"
        return (f"while waiting for step {step.number}: {steps} still run on the ranks; their results stay "
                "readable, and the next call waits for them first")  # fmt: skip


@contextlib.contextmanager
def _interrupts_deferred():
    """Hold Ctrl-C back (main thread only) until the block is done, then raise it."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # fmt: skip
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt("the step was sent first: it runs, and its result stays readable")


class Evaluated(NamedTuple):
    """An eval step with metrics: its loss, and each metric's values (to ``Metric.update``)."""

    loss: float
    metrics: list[list[np.ndarray]]

    def __float__(self) -> float:
        return self.loss


def _number_op(op):
    def forward(self, other):
        return op(float(self), _plain(other))

    def reverse(self, other):
        return op(_plain(other), float(self))

    return forward, reverse


def _plain(x):
    return float(x) if isinstance(x, Loss) else x


class Loss:
    """The loss of a train or eval step, read from the ranks when used as a number.

    Behaves as a float: ``float(loss)``, ``f"{loss:.4f}"``, ``print(loss)``,
    arithmetic, comparisons, ``numpy.asarray(loss)`` and ``math.isclose`` all
    wait for the step (and raise its failure, if it failed). ``loss.done``
    tells without waiting.
    """

    __slots__ = ("_step",)

    def __init__(self, step: Step):
        self._step = step

    @property
    def done(self) -> bool:
        return self._step.done

    @property
    def step(self) -> int:
        """The step's number (0 for the model's first; counted across restarts)."""
        return self._step.number

    def __float__(self) -> float:
        return float(self._step.result())

    def item(self) -> float:
        return float(self)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(float(self), dtype=dtype)

    def __repr__(self) -> str:
        return repr(float(self))

    def __str__(self) -> str:
        return str(float(self))

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)

    def __bool__(self) -> bool:
        return bool(float(self))

    def __int__(self) -> int:
        return int(float(self))

    def __hash__(self) -> int:
        return hash(float(self))

    def __round__(self, ndigits=None):
        return round(float(self), ndigits)

    def __abs__(self) -> float:
        return abs(float(self))

    def __neg__(self) -> float:
        return -float(self)

    def __pos__(self) -> float:
        return float(self)

    def __trunc__(self) -> int:
        return math.trunc(float(self))

    __add__, __radd__ = _number_op(operator.add)
    __sub__, __rsub__ = _number_op(operator.sub)
    __mul__, __rmul__ = _number_op(operator.mul)
    __truediv__, __rtruediv__ = _number_op(operator.truediv)
    __pow__, __rpow__ = _number_op(operator.pow)
    __lt__, __gt__ = _number_op(operator.lt)
    __le__, __ge__ = _number_op(operator.le)
    __eq__, _ = _number_op(operator.eq)
    __ne__, _ = _number_op(operator.ne)
    del _


numbers.Real.register(Loss)  # a number for isinstance(x, numbers.Number) checks
