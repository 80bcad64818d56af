"""`Changes`: the model's parts say that what a later driver needs changed (the mode, the specs, the
last checkpoint, the learning rate); a detached model's record follows (`raydist.driver.lifecycle`).
Made first and given to each part when it is made, so no part is wired to another afterwards."""

from __future__ import annotations

from collections.abc import Callable


class Changes:
    """Listeners of the model's changes, each told what changed: "mode", "checkpoint" or "rate"."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[str], None]] = []

    def listen(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def changed(self, what: str) -> None:
        for listener in list(self._listeners):
            listener(what)
