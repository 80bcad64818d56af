"""How steps reach the ranks: one message (a `Parcel` of one or more steps), the same for every rank.

A message is small and identical for all ranks (each rank works out its
own shard, and whether its result is read, from what it was told at the mode
switch), so it is serialized once:

- `CallTransport`: one actor call per rank; the message is pickled once
  (`raydist.messages.pack`, and the ranks pack their results), or
  ``ray.put`` once when it is not small. The default on CPUs, and the
  fallback when a graph cannot be compiled.
- `CompiledTransport`: a Ray Compiled Graph, ``RankActor.run`` on every rank
  fed from one input channel: one write per message instead of an actor call
  per rank. Its channels busy-wait: the driver waiting for
  a step and every rank waiting for its next one each keep a core at 100 %,
  which on CPU ranks that need every core slows compute-bound steps. The
  default with GPUs. Ray documents the graph as not thread-safe, and a read
  cut short (Ctrl-C, a timeout) loses the channels' alignment, so every use
  of the graph runs on one thread of its own: callers wait for its results,
  and a wait can be interrupted and resumed.

- `TreeTransport`: the driver sends a message to rank 0 only, and each rank
  passes it on to a few others (`relay_tree`: from node to node, then within
  a node), so the driver's cost per message does not grow with the ranks.
  The results come back up the same tree, from the ranks the driver reads
  only, as one answer (`raydist.messages.RankAnswers`: each value one array
  over the ranks, so reading it does not grow with them either). The default
  on CPUs from `TREE_FROM` ranks.

All three wait for a message through the group's `raydist.driver.cluster.hangs.Watch`,
which finds a hung rank within a step's limit whatever the message's size, and
hand every failure to `RankGroup.fail`: the caller sees `RankError` naming the
rank, and the group is torn down.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import ray

from ...errors import RankError
from ...messages import INLINE_BYTES, Parcel, RankAnswers, StepResults, pack, unpack
from ..cluster.hangs import Watch

if TYPE_CHECKING:
    from ..cluster.group import RankGroup

log = logging.getLogger("raydist")



class CallTransport:
    """One ``run`` call per rank and step; a ticket is the calls' refs."""

    name = "calls"

    def __init__(self, group: RankGroup, watch: Watch):
        self.group = group
        self.watch = watch
        self._out: list[list[ray.ObjectRef]] = []  # the messages sent and not yet received, oldest first

    def send(self, parcel: Parcel) -> list[ray.ObjectRef]:
        payload = pack(parcel) if parcel.nbytes <= INLINE_BYTES else ray.put(parcel)
        refs = [actor.run.remote(payload) for actor in self.group.actors]
        self._out.append(refs)
        return refs

    def receive(self, refs: list[ray.ObjectRef], steps: range) -> list:
        # a rank that dies as the next message begins can take its answer to this one with it: the
        # survivors' failures in the messages after this one say in which step it died
        i = next((i for i, out in enumerate(self._out) if out is refs), len(self._out))
        answers = self.group.gather(refs, during(steps), watch=self.watch, steps=steps, later=self._out[i + 1:])
        del self._out[i : i + 1]  # not before: a wait cut short (Ctrl-C) is asked again
        return [unpack(r) for r in answers]

    def close(self) -> None:
        self._out.clear()


@dataclasses.dataclass
class _Ticket:
    sent: concurrent.futures.Future  # the graph's refs for the step
    read: concurrent.futures.Future | None = None  # the ranks' results, once asked for


class CompiledTransport:
    """A compiled graph: ``run`` on every rank, one input channel, one output per rank."""

    name = "compiled"

    def __init__(self, group: RankGroup, max_in_flight: int, watch: Watch):
        from ray.dag import InputNode, MultiOutputNode

        self.group = group
        self.watch = watch
        with InputNode() as message:
            dag = MultiOutputNode([actor.run.bind(message) for actor in group.actors])
        self._graph = dag.experimental_compile(_max_inflight_executions=max_in_flight)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raydist-graph")
        self._closed = False

    def send(self, parcel: Parcel) -> _Ticket:
        return _Ticket(self._thread.submit(self._graph.execute, parcel))

    def receive(self, ticket: _Ticket, steps: range) -> list:
        if ticket.read is None:
            ticket.read = self._thread.submit(self._read, ticket.sent)
        try:
            # Ctrl-C and the watch's slices interrupt this wait, not the read (a graph's
            # read cut short cannot be asked again); a hung rank's teardown ends the read
            return self.watch.wait(ticket.read.result, during(steps))
        except RankError:
            raise
        except Exception as e:
            raise self.group.fail(e, during(steps), steps=steps) from e

    @staticmethod
    def _read(sent: concurrent.futures.Future) -> list:
        return [ray.get(ref, timeout=-1) for ref in sent.result()]  # -1: no limit

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        quiet = logging.getLogger("ray.dag.compiled_dag_node")
        level, quiet.level = quiet.level, logging.CRITICAL  # it logs every killed rank as an error
        try:
            self._graph.teardown()
        except Exception:  # the actors are gone already
            pass
        finally:
            quiet.setLevel(level)
            self._thread.shutdown(wait=False, cancel_futures=True)


# Each rank passes a relayed message on to at most this many others on its node, and
# (the first rank of a node) this many on other nodes.
FANOUT = 4
# dispatch="auto" on CPUs relays messages through the ranks from this many ranks on (bench dispatch).
TREE_FROM = 8


def relay_tree(nodes: list[str], fanout: int = FANOUT) -> dict[int, list[int]]:
    """Who passes a message on to whom, from rank 0: {rank: its children}. ``nodes``: each
    rank's node, ranks of a node together. The first rank of each node gets the message from
    another node's first rank (a ``fanout``-ary tree over nodes), and passes it on within its node
    (a ``fanout``-ary tree over the node's ranks), so a message crosses to each node once."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    children: dict[int, list[int]] = {rank: [] for rank in range(len(nodes))}

    def heap(ranks: list[int]) -> None:
        for i, rank in enumerate(ranks):
            children[rank] += ranks[fanout * i + 1:fanout * i + 1 + fanout]

    heap([ranks[0] for ranks in by_node.values()])
    for ranks in by_node.values():
        heap(ranks)
    return children


class TreeTransport:
    """Messages relayed from rank to rank (`relay_tree`); a ticket is the root's ``collect`` ref."""

    name = "tree"

    def __init__(self, group: RankGroup, watch: Watch, fanout: int = FANOUT):
        self.group = group
        self.watch = watch
        self.tree = tree = relay_tree(group.nodes, fanout)
        actors = group.actors
        group.gather([actors[r].set_children.remote([actors[c] for c in tree[r]]) for r in range(len(actors))],
                     "relay setup")  # fmt: skip
        self._root = actors[0]

    def send(self, parcel: Parcel) -> ray.ObjectRef:
        # whole, even when large: rank 0 puts it in the object store for the others, so that
        # they borrow it from rank 0, not from the driver (whose work would grow with them)
        self._root.relay.remote(parcel.first, parcel)
        return self._root.collect.remote(parcel.first)

    def receive(self, ref: ray.ObjectRef, steps: range) -> Sequence[Any]:
        try:
            answers = self.watch.wait(lambda timeout: ray.get(ref, timeout=timeout), during(steps))
        except RankError:
            raise
        except Exception as e:
            raise self.group.fail(e, during(steps), steps=steps) from e
        return TreeAnswers(answers, len(self.group))

    def close(self) -> None:
        pass


class TreeAnswers(Sequence):
    """The relay tree's answer to a message, by rank, as the other transports give theirs (a rank's
    `StepResults` or None), without taking it apart: `stacked` hands a value over all ranks at once."""

    def __init__(self, answers: RankAnswers | None, size: int):
        self._answers, self._size = answers, size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, rank: int) -> StepResults | None:  # type: ignore[override]  # by rank, no slices
        if not 0 <= rank < self._size:
            raise IndexError(rank)
        return None if self._answers is None else self._answers[rank]

    def stacked(self, value: int, ranks: tuple[int, ...]):
        return None if self._answers is None else self._answers.stacked(value, ranks)


def during(steps: range) -> str:
    """What a message's failure happened during, as far as the driver knows (a rank may say which step)."""
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


Transport: TypeAlias = "CallTransport | CompiledTransport | TreeTransport"


def open_transport(group: RankGroup, max_in_flight: int, dispatch: str, watch: Watch) -> Transport:
    """The step transport for ``group``: ``dispatch`` "tree", "calls", or "compiled" if it can
    be compiled (else calls). ``watch``: how long a step may take before its ranks count as hung.
    """
    if dispatch == "tree":
        return TreeTransport(group, watch)
    if dispatch == "compiled":
        try:
            return CompiledTransport(group, max_in_flight, watch)
        except Exception as e:  # noqa: BLE001 - any failure to compile leaves the plain path
            log.warning("raydist: cannot compile the step graph (%s); using one actor call per rank", e)
    return CallTransport(group, watch)
