"""``dm.lr_scheduler``: every rank's ``LRScheduler``, held from the driver.

The driver keeps a replica of the ranks' scheduler (rank 0 sends it pickled
once it is built), so reading it (``last_lr``, ``get_lr()``, ``state_dict()``)
asks no rank. A change (``step()``, ``step(metrics)``, ``set_state_dict()``) is
made to the replica at once and travels to the ranks with the next step
message, which every rank applies before that step: a change takes effect
from the next call on, whatever is still in flight, as in one process. It
is an ``LRScheduler`` itself, so Paddle's callbacks that step
``model._optimizer._learning_rate`` work with it unchanged. Setting an
attribute (``dm.lr_scheduler.last_epoch = 3``) is refused: it would change
the replica only, and the ranks would silently diverge from it.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from paddle.optimizer.lr import LRScheduler

from ...messages import LrChange


class RankScheduler(LRScheduler):
    """The ranks' learning-rate scheduler (see the module). Its attributes are the replica's."""

    def __init__(self, replica: LRScheduler, send: Callable[[LrChange], None]):
        # LRScheduler.__init__ is not called: it would step the schedule
        self.__dict__["_replica"] = replica
        self.__dict__["_send"] = send

    def step(self, *args: Any, **kwargs: Any) -> None:
        """``step(epoch=None)``, or ``step(metrics, epoch=None)`` for ``ReduceOnPlateau``;
        the ranks take it before their next step. ``metrics`` may be a `raydist.Loss`."""
        args = tuple(float(a) if isinstance(a, numbers.Real) and not isinstance(a, int) else a for a in args)
        self._replica.step(*args, **kwargs)
        self._send(LrChange("step", args, dict(kwargs)))

    def __call__(self) -> float:
        return self._replica()

    def get_lr(self) -> float:
        return self._replica.get_lr()

    def state_dict(self) -> dict:  # type: ignore[override]  # Paddle's TypedDict: the replica's, whatever it holds
        return self._replica.state_dict()

    def set_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        self._replica.set_state_dict(state_dict)
        self._send(LrChange("state", (dict(state_dict),)))

    set_dict = set_state_dict  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:  # last_lr, last_epoch, base_lr, ...
        return getattr(self.__dict__["_replica"], name)

    def state_keys(self) -> None:
        self._replica.state_keys()

    def __setattr__(self, name: str, value: Any) -> None:
        # Setting an attribute would change the driver's replica only, and the ranks would go on with theirs.
        raise AttributeError(
            f"dm.lr_scheduler.{name} cannot be set: it would change the driver's copy only, not the ranks' "
            "schedulers; use dm.lr_scheduler.step(...) or dm.lr_scheduler.set_state_dict(...), which are sent "
            "to the ranks")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"dm.lr_scheduler.{name} cannot be deleted: the ranks' schedulers keep theirs")

    def _rebind(self, replica: LRScheduler, send: Callable[[LrChange], None]) -> None:
        """Stand for a new group's schedulers (after a restart): the user keeps the same handle."""
        self.__dict__.update(_replica=replica, _send=send)

    def __reduce__(self):
        raise TypeError("dm.lr_scheduler stands for the ranks' schedulers and does not pickle")

    def __repr__(self) -> str:
        return f"raydist.RankScheduler({type(self._replica).__name__}, last_lr={self._replica.last_lr})"
