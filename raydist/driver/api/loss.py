"""`Loss`: what a train or eval call of a `raydist.DistModel` returns at once, while its step runs."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from ..dispatch.window import Step


def _number_op(op: Callable[[Any, Any], Any]) -> tuple[Callable[[Loss, Any], Any], Callable[[Loss, Any], Any]]:
    """``op`` on a loss and another operand, either way round, as on the loss's float."""

    def forward(self: Loss, other: Any) -> Any:
        return op(float(self), _plain(other))

    def reverse(self: Loss, other: Any) -> Any:
        return op(_plain(other), float(self))

    return forward, reverse


def _plain(x: Any) -> Any:
    return float(x) if isinstance(x, Loss) else x


class Loss:
    """The loss of a train or eval step (``dm(x, y)``), read from the ranks when used as a number.

    ``dm(x, y)`` returns it at once, so the driver sends the next steps while this one runs;
    reading it waits. It behaves as a float: ``float(loss)``, ``f"{loss:.4f}"``, ``print(loss)``,
    arithmetic (``//``, ``%``, ``divmod``, ``math.floor``... too: every
    operation of ``numbers.Real``, as on ``float(loss)``), comparisons,
    ``numpy.asarray(loss)`` and ``math.isclose`` all wait for the step (and
    raise its failure, if it failed). ``loss.done`` tells without waiting.
    """

    __slots__ = ("_step",)

    def __init__(self, step: Step):
        self._step = step

    @property
    def done(self) -> bool:
        """Whether the step finished (its loss read, or its failure raised, without waiting)."""
        return self._step.done

    @property
    def step(self) -> int:
        """The step's number (0 for the model's first; counted across restarts)."""
        return self._step.number

    def __float__(self) -> float:
        return float(self._step.result())

    def outcome(self) -> Any:
        """What the step returned, waiting for it: the float loss, or an `Evaluated` loss with
        the metric values of an eval step with metrics."""
        return self._step.result()

    def item(self) -> float:
        """The loss as a float, as ``paddle.Tensor.item`` (waits for the step)."""
        return float(self)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
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

    def __round__(self, ndigits: int | None = None) -> float:
        return round(float(self), ndigits)

    def __abs__(self) -> float:
        return abs(float(self))

    def __neg__(self) -> float:
        return -float(self)

    def __pos__(self) -> float:
        return float(self)

    def __trunc__(self) -> int:
        return math.trunc(float(self))

    def __floor__(self) -> int:
        return math.floor(float(self))

    def __ceil__(self) -> int:
        return math.ceil(float(self))

    def __complex__(self) -> complex:
        return complex(float(self))

    @property
    def real(self) -> float:
        return float(self).real

    @property
    def imag(self) -> float:
        return float(self).imag

    def conjugate(self) -> float:
        return float(self).conjugate()

    __add__, __radd__ = _number_op(operator.add)
    __sub__, __rsub__ = _number_op(operator.sub)
    __mul__, __rmul__ = _number_op(operator.mul)
    __truediv__, __rtruediv__ = _number_op(operator.truediv)
    __floordiv__, __rfloordiv__ = _number_op(operator.floordiv)
    __mod__, __rmod__ = _number_op(operator.mod)
    __divmod__, __rdivmod__ = _number_op(divmod)
    __pow__, __rpow__ = _number_op(operator.pow)
    __lt__, __gt__ = _number_op(operator.lt)
    __le__, __ge__ = _number_op(operator.le)
    __eq__, _ = _number_op(operator.eq)
    __ne__, _ = _number_op(operator.ne)
    del _


numbers.Real.register(Loss)  # a number for isinstance checks: it implements every method of numbers.Real
