"""The driver's replica of the ranks' learning rate, and the changes the next step carries.

A float learning rate is kept as a value; an ``LRScheduler`` as a
`raydist.driver.model.schedule.RankScheduler` over a replica of rank 0's scheduler.
Either way a change (``step()``, a new value from ReduceLROnPlateau, a restored
checkpoint) is made here at once and travels to the ranks with the next step
message, so it takes effect from the next call on, as in one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ... import pickling
from ...messages import LrChange
from .changes import Changes

if TYPE_CHECKING:
    from .schedule import RankScheduler


class LearningRate:
    """The learning rate the ranks run with, as the driver knows it."""

    def __init__(self, changes: Changes) -> None:
        self.scheduler: RankScheduler | None = None  # the same handle for the user across restarts
        self.value: float | None = None  # a float learning rate (None with a scheduler, or no optimizer)
        self._changes: list[LrChange] = []
        self._told = changes  # "rate" after each change (a detached model's record keeps the position)

    def started(self, built: float | bytes | None) -> None:
        """A new group of ranks built its optimizer with ``built`` (a float, a pickled scheduler, or None):
        it starts from the first value, and nothing is pending for it."""
        self._changes = []
        self.value = built if isinstance(built, float) else None
        if isinstance(built, bytes):
            from .schedule import RankScheduler  # a paddle LRScheduler: imported with Paddle, when needed

            replica = pickling.loads(built)
            if self.scheduler is None:
                self.scheduler = RankScheduler(replica, self._change)
            else:
                self.scheduler._rebind(replica, self._change)

    def _change(self, change: LrChange) -> None:
        self._changes.append(change)
        self._told.changed("rate")

    def now(self) -> float | None:
        """The learning rate the next train step uses."""
        return self.scheduler() if self.scheduler is not None else self.value

    def set(self, value: float) -> None:
        """A float learning rate for the ranks from the next call on (Paddle's ReduceLROnPlateau callback)."""
        if self.scheduler is not None:
            raise ValueError("the optimizer's learning rate is an LRScheduler: change it with dm.lr_scheduler")
        self.value = float(value)
        self._change(LrChange("value", (self.value,)))

    def take_changes(self) -> tuple[LrChange, ...]:
        """The changes made since the last step was sent, for the next one."""
        if not self._changes:
            return ()
        changes = tuple(self._changes)
        self._changes.clear()
        return changes

    def position(self) -> Any:
        """Where the schedule stands now: its state dict, or the float (None: no optimizer)."""
        return self.scheduler.state_dict() if self.scheduler is not None else self.value

    def go_to(self, position: Any) -> None:
        """Back to a `position` (a new group of ranks starts from the first value)."""
        if isinstance(position, dict):
            if self.scheduler is None:
                raise RuntimeError("a learning-rate schedule's position, for a model without a schedule")
            self.scheduler.set_state_dict(position)
        elif position is not None and position != self.value:
            self.set(position)

    def catch_up(self, position: Any) -> None:
        """Go to ``position`` if it is ahead of where the ranks stand (a detached model's record kept
        the schedule's changes that its driver made but never sent: it died first)."""
        if isinstance(position, dict) and self.scheduler is not None:
            if position.get("last_epoch", -1) > self.scheduler.state_dict().get("last_epoch", -1):
                self.go_to(position)
        elif isinstance(position, float) and self.scheduler is None:
            self.go_to(position)

    def manifest(self) -> dict:
        """What a checkpoint's manifest keeps of it."""
        return {"scheduler": self.scheduler.state_dict()} if self.scheduler is not None else {"value": self.value}

    def restore(self, saved: dict) -> None:
        """Back to what a checkpoint's manifest kept (`manifest`)."""
        if self.scheduler is not None and saved.get("scheduler") is not None:
            self.scheduler.set_state_dict(saved["scheduler"])
        elif self.value is not None and saved.get("value") is not None:
            self.set(saved["value"])
