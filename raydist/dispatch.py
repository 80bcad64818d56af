"""How a step reaches the ranks: one message, the same for every rank.

A step message is small and identical for all ranks (each rank works out its
own shard and whether its result is read from what it was told at the mode
switch), so it is serialized once:

- `CompiledSteps`: a Ray Compiled Graph, ``RankActor.run`` on every rank fed
  from one input channel: about a quarter of the driver's CPU per step of
  plain actor calls (BENCHMARKS.md). But its channels busy-wait: the driver
  waiting for a step and every rank waiting for the next one each keep a
  core at 100 % (measured), which on CPU ranks that need every core makes
  compute-bound steps up to 1.9x slower. The default with GPUs. When a rank
  raises, Ray's reader returns that error at once even while other ranks
  still wait in a collective; when a rank dies, Ray tears the graph down
  and every read fails.
- `CallSteps`: one actor call per rank; the message is ``ray.put`` once when
  it is not small. The default on CPUs, and the fallback when a graph
  cannot be compiled.

Both raise `RankError` naming the rank (and tear the group down, as
`RankGroup.gather` does).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray


log = logging.getLogger("raydist")

# Messages up to this size travel inside each step call instead of through the
# object store: a put costs more than pickling a few KiB per rank.
INLINE_BYTES = 64 * 1024


class CallSteps:
    """One ``run`` call per rank and step."""

    name = "calls"

    def __init__(self, group, timeout: float | None):
        self.group = group
        self.timeout = timeout

    def send(self, message: tuple, nbytes: int) -> list:
        payload = message if nbytes <= INLINE_BYTES else ray.put(message)
        return self.group.broadcast("run", payload)

    def receive(self, refs: list, during: str) -> list:
        return self.group.gather(refs, during, timeout=self.timeout)

    def close(self) -> None:
        pass


class CompiledSteps:
    """A compiled graph: ``run`` on every rank, one input channel, one output per rank."""

    name = "compiled"

    def __init__(self, group, max_in_flight: int, timeout: float | None):
        from ray.dag import InputNode, MultiOutputNode

        self.group = group
        self.timeout = timeout
        with InputNode() as message:
            dag = MultiOutputNode([actor.run.bind(message) for actor in group.actors])
        self._graph = dag.experimental_compile(_max_inflight_executions=max_in_flight)

    def send(self, message: tuple, nbytes: int) -> list:
        return self._graph.execute(message)

    def receive(self, refs: list, during: str) -> list:
        results = []
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            for ref in refs:
                left = -1 if deadline is None else max(0.0, deadline - time.monotonic())  # -1: no limit
                results.append(ray.get(ref, timeout=left))
        except ray.exceptions.RayChannelTimeoutError:
            raise self.group.timed_out(list(range(len(results), len(refs))), during, self.timeout) from None
        except Exception as e:
            raise self.group.fail(e, during) from None
        return results

    def close(self) -> None:
        quiet = logging.getLogger("ray.dag.compiled_dag_node")
        level, quiet.level = quiet.level, logging.CRITICAL  # it logs every killed rank as an error
        try:
            self._graph.teardown()
        except Exception:  # the actors are gone already
            pass
        finally:
            quiet.setLevel(level)


def open_steps(group, max_in_flight: int, compiled: bool, timeout: float | None):
    """The step transport for ``group``: compiled if asked and possible, else calls.

    ``timeout``: seconds a step may take before its ranks count as stuck.
    """
    if compiled:
        try:
            return CompiledSteps(group, max_in_flight, timeout)
        except Exception as e:  # noqa: BLE001 - any failure to compile leaves the plain path
            log.warning("raydist: cannot compile the step graph (%s); using one actor call per rank", e)
    return CallSteps(group, timeout)


def message_bytes(message: Any) -> int:
    """Bytes of the arrays in a step message (the rest is a few words)."""
    return sum(getattr(a, "nbytes", 0) for part in message if isinstance(part, (list, tuple)) for a in part)
