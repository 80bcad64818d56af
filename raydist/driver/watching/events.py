"""The run's events: everything a model's lifecycle does, as dicts (``dm.events()``).

Each event has ``kind``, ``time`` (``time.time()``), ``step`` (the number the next
step sent gets) and ``model`` (its name), and what belongs to its kind:

- ``failure``: ``rank``, ``node`` (its IP), ``during``, ``error`` (the first line);
- ``restart``: ``size``, ``source`` (where the state came from: "replicas", the
  surviving ranks' live state; "peer_memory", the copies in another node's memory;
  "checkpoint"; "start", the initial parameters), ``checkpoint`` (its path, if one),
  ``replayed`` (steps the driver had seen done that the state was behind: computed
  twice, by the restart's replay or the loop, as ``fit`` does), ``behind`` (of those,
  the completed steps the loop must feed again: 0 when the state is where the failed
  group stood, None after a checkpoint or the start, which ``replayed`` counts), ``seconds`` (the
  restart's time), ``state_s`` (of it: finding the state and putting it in the new
  group), ``replay_s`` (of it: the replay), ``trained`` (the train steps, over the model's
  life, its state is after once the replay ran: a loop of its own goes on from there);
- ``replica_mismatch``: ``ranks``, ``names`` (the tensors whose replicas differ), ``after``
  (the train steps when the codes were taken);
- ``resize``: ``from``, ``to``, ``why`` ("grow" or "drain");
- ``drain``: ``nodes``, ``deadline`` (``time.time()`` seconds, or None), ``action``
  ("move": an elastic model moves off; "checkpoint": ``fit`` saves at once);
- ``checkpoint``: ``path``, ``background``, ``stall_s`` (how long the call held
  the loop: the rest of a background save runs beside the next steps);
- ``attach`` and ``take_over``: ``holder`` (the new driver), ``from`` (the one
  taken over from, for ``take_over``).

`Events` keeps the last `KEEP` and tells its sinks of each new one: the Ray
metrics' counters (`raydist.driver.watching.metrics`), ``fit``'s ``events.jsonl``.
"""

from __future__ import annotations

import builtins
import collections
import json
import logging
import posixpath
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("raydist")

KEEP = 10_000
EVENTS_FILE = "events.jsonl"


class Events:
    """A model's events, oldest first."""

    def __init__(self, model: str):
        self.model = model
        self._events: collections.deque[dict] = collections.deque(maxlen=KEEP)
        self._sinks: list[Callable[[dict], None]] = []
        self._lock = threading.Lock()

    def emit(self, kind: str, step: int, **fields: Any) -> dict:
        event = {"kind": kind, "time": time.time(), "step": step, "model": self.model, **fields}
        with self._lock:
            self._events.append(event)
            sinks = list(self._sinks)
        for sink in sinks:
            try:
                sink(event)
            except Exception:  # noqa: BLE001 - an event's sink never stops the run
                log.exception("raydist: telling of an event failed")
        return event

    def list(self) -> list[dict]:
        with self._lock:
            return [dict(e) for e in self._events]

    def last(self, n: int) -> builtins.list[dict]:  # (`list` here is the method above)
        with self._lock:
            return [dict(e) for e in list(self._events)[-n:]]

    def add_sink(self, sink: Callable[[dict], None]) -> None:
        with self._lock:
            self._sinks.append(sink)

    def remove_sink(self, sink: Callable[[dict], None]) -> None:
        with self._lock:
            if sink in self._sinks:
                self._sinks.remove(sink)


class JsonLines:
    """A sink: each event appended as a line of JSON to ``directory``'s `EVENTS_FILE` (a local path
    or a pyarrow.fs URI, as checkpoint directories are). A file that exists is gone on with (a
    resumed run's). Object stores cannot append: the file is written whole each time, from the
    lines read at the start and those added since."""

    def __init__(self, directory: str):
        from ... import checkpoint

        self.filesystem, where = checkpoint.open_dir(directory)
        self.filesystem.create_dir(where, recursive=True)
        self.path = posixpath.join(where, EVENTS_FILE)
        self._local = type(self.filesystem).__name__ == "LocalFileSystem"
        self._lines: list[str] = []
        if not self._local and checkpoint.exists(posixpath.join(directory, EVENTS_FILE)):
            with self.filesystem.open_input_stream(self.path) as f:
                self._lines = f.read().decode().splitlines(keepends=True)

    def __call__(self, event: dict) -> None:
        line = json.dumps(event, default=str) + "\n"
        if self._local:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
            return
        self._lines.append(line)
        with self.filesystem.open_output_stream(self.path) as f:
            f.write("".join(self._lines).encode())


def read_events(directory: str) -> list[dict]:
    """The events a run's ``fit`` wrote to ``directory`` (none: [])."""
    from ... import checkpoint

    if not checkpoint.exists(posixpath.join(directory, EVENTS_FILE)):
        return []
    filesystem, where = checkpoint.open_dir(directory)
    with filesystem.open_input_stream(posixpath.join(where, EVENTS_FILE)) as f:
        return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
