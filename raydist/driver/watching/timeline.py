"""``dm.timeline(path)``: a run's last steps as a Chrome trace (trace-event JSON), for Perfetto or chrome://tracing.

One process per rank and one for the driver, on the driver's clock:

- ``rank r``, thread "steps": per step, its wait for the batch ("data wait", a
  loader's; a driver batch is there already) and the step itself ("step N",
  forward, backward and update as one program);
- ``rank r``, thread "collectives" (CPU ranks): each collective and pipeline
  receive inside the steps (`raydist.compat.collectives.comm_records`). On gloo a
  collective returns once every member reached it, so a long one is a rank
  waiting for a slower peer, and the slow rank shows with the longer steps;
- ``driver``, thread "messages": each message of steps from its send to its
  results, and thread "sends", the driver's own time sending it.

Clocks: every rank reports ``time.monotonic_ns``; the driver asks each for it
`CLOCK_ROUNDS` times and takes the offset of the round trip that was quickest
(the reading is taken to be from its middle), as NTP does. On one machine
the ranks share the driver's clock, and the offsets found are the error.
"""

from __future__ import annotations

import json
import time
from typing import Any

import ray

from ...protocol import RankActor
from ..cluster.config import call_on

CLOCK_ROUNDS = 7


def clock_offsets(actors: list) -> list[tuple[int, int]]:
    """Each actor's clock minus the driver's (ns), and the round trip it was read in (ns)."""
    out = []
    for actor in actors:
        rounds = []
        for _ in range(CLOCK_ROUNDS):
            before = time.monotonic_ns()
            theirs = int(ray.get(call_on([actor], RankActor.clock)[0]))
            after = time.monotonic_ns()
            rounds.append((theirs - (before + after) // 2, after - before))
        out.append(min(rounds, key=lambda r: r[1]))  # the shortest round trip's
    return out


def timeline(client: Any, model: str, path: str, steps: int | None = None) -> dict[str, Any]:
    """Collect the ranks' and the driver's records of the last ``steps`` steps; write the trace to ``path``."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a positive int or None, got {steps!r}")
    client.drain()  # the steps sent so far are done, and on the timeline
    group = client.group
    group.check_alive()
    reports = group.call(RankActor.steps, steps, during="timeline")
    offsets = clock_offsets(group.actors)
    trace = build_trace(model, reports, offsets, list(client.window.log))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    return trace


def build_trace(model: str, reports: list[dict | None], offsets: list[tuple[int, int]],
                messages: list[tuple[int, int, int, int, int]]) -> dict[str, Any]:  # fmt: skip
    """The trace of the ranks' ``reports`` (`raydist.worker.steplog.StepLog.recent`, one per rank),
    their clock ``offsets`` and the driver's ``messages`` (`raydist.driver.dispatch.window.Window.log`)."""
    events: list[dict[str, Any]] = []
    first_step = min((r["steps"][0][0] for r in reports if r and r["steps"]), default=None)
    spans = []  # (pid, tid, name, start ns on the driver's clock, end ns, args)
    for rank, (report, (offset, _)) in enumerate(zip(reports, offsets)):
        pid = rank + 1
        for number, mode, asked, fed, ended in (report or {}).get("steps", []):
            if fed > asked:
                spans.append((pid, 1, "data wait", asked - offset, fed - offset, {"step": number}))
            spans.append((pid, 1, f"step {number}", fed - offset, ended - offset, {"step": number, "mode": mode}))
        for start, end, kind, ring in (report or {}).get("comms", []):
            spans.append((pid, 2, kind, start - offset, end - offset, {"ring": ring}))
    for first, count, sending, sent, done in messages:
        if first_step is not None and first + count <= first_step:
            continue
        numbers = f"{first}" if count == 1 else f"{first}-{first + count - 1}"
        spans.append((0, 1, f"steps {numbers}", sending, done, {"first": first, "steps": count}))
        spans.append((0, 2, "send", sending, sent, {"first": first}))
    base = min((s[3] for s in spans), default=0)
    names = {0: "driver"} | {rank + 1: f"rank {rank}" for rank in range(len(reports))}
    for pid, name in names.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        threads = ("messages", "sends") if pid == 0 else ("steps", "collectives")
        for tid, thread in enumerate(threads, 1):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})
    for pid, tid, name, start, end, args in spans:
        events.append({"ph": "X", "name": name, "cat": "driver" if pid == 0 else "rank", "pid": pid, "tid": tid,
                       "ts": (start - base) / 1000, "dur": max(end - start, 0) / 1000, "args": args})  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"model": model, "clock_offsets_ns": [o for o, _ in offsets],
                          "clock_round_trips_ns": [rt for _, rt in offsets]}}  # fmt: skip
