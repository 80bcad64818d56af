"""The checkpoints of a model's current timeline, each by the train steps its state is after.

A timeline is the model's one line of states: each train step moves it on. A
restart that goes back to an earlier state (a checkpoint's, a peer-memory copy's,
the last one a replica check found clean) goes on from there on a new timeline,
and the checkpoints saved after that state belong to the one it left. Their
steps are computed again, and one of them may hold what made the restart go back
(a corruption the replica check found after the save): a restart never loads
them, and they are moved aside (`raydist.checkpoint.abandon`), so that neither
``fit(resume=True)``, which reads the directory, loads them, nor are they in the
way of the new timeline's saves of the same steps.

Train steps count over the model's life (`raydist.driver.lifecycle.recovery.Recovery`:
``base + trained``); a restart from a checkpoint goes on counting from the
checkpoint's count, so every number here is on one scale.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from ... import checkpoint

log = logging.getLogger("raydist")


@dataclasses.dataclass(frozen=True)
class Saved:
    """A checkpoint at ``path`` of the state after ``trained`` train steps."""

    trained: int
    path: str


class Saves:
    """The checkpoints of the current timeline, in the order they were saved or loaded.
    ``changed``: told when the newest one changes (the model's card shows it)."""

    def __init__(self, changed: Callable[[], None] | None = None) -> None:
        self._saved: list[Saved] = []
        self._changed = changed

    @property
    def last(self) -> Saved | None:
        """The checkpoint saved or loaded last."""
        return self._saved[-1] if self._saved else None

    def saved(self, trained: int, path: str) -> None:
        """A checkpoint of the state after ``trained`` train steps was committed at ``path``."""
        self._saved.append(Saved(trained, path))
        self._tell()

    def loaded(self, trained: int, path: str) -> None:
        """The model's state is now the checkpoint at ``path``'s, counted as after ``trained`` train
        steps: a timeline of its own begins there (what was saved before is of another)."""
        self._saved = [Saved(trained, path)]
        self._tell()

    def newest(self, at_most: int) -> Saved | None:
        """The newest checkpoint of a state after at most ``at_most`` train steps (None: none)."""
        fit = [s for s in self._saved if s.trained <= at_most]
        return max(fit, key=lambda s: s.trained) if fit else None

    def went_back(self, to: int) -> list[Saved]:
        """A restart goes on from the state after ``to`` train steps: the checkpoints of later states
        leave the timeline and are moved aside. The ones that left (their paths as they were)."""
        gone = [s for s in self._saved if s.trained > to]
        if not gone:
            return []
        self._saved = [s for s in self._saved if s.trained <= to]
        for s in gone:
            try:
                moved = checkpoint.abandon(s.path)
            except (FileNotFoundError, OSError) as e:  # removed by the user, or by keep_last: nothing to move
                log.debug("raydist: %s was not moved aside: %s", s.path, e)
                continue
            log.warning("raydist: %s is of a timeline the restart went back from (after %d train steps, the "
                        "state goes on from %d): moved aside to %s", s.path, s.trained, to, moved)  # fmt: skip
        self._tell()
        return gone

    def _tell(self) -> None:
        if self._changed is not None:
            self._changed()
