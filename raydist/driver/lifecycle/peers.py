"""Peer memory: every K train steps each rank's state, copied to host memory on another node.

``to_static(..., peer_memory=K)``. A rank copies its shards after every K-th train
step and a thread of its own puts the copy in the object store and hands it to a
`Keeper` (`raydist.worker.mirror`). The keeper reads it onto its node's object store
and holds it there: what it read stays readable after the rank that made (and owns)
it died, even under the store's memory pressure (measured with Ray 2.60: a read
object stays pinned while a process maps it; `tests/test_peer_memory.py`'s lost
nodes recover from such copies, and fail if Ray changes that). Holding it costs
no copy of the keeper's own. A keeper is a small actor (no CPU) pinned to a node; the
copies of the ranks on one node go to the keeper of the next node that runs ranks
of the model (in node order), or, when the ranks run on one node, of any other
node there is. A rank keeps its own reference too: after a node's loss the
survivors still have theirs even where their keeper went with the node.

After a rank died and no data-parallel replica holds its shards, a restart goes on
from the newest copy that every shard has (the survivors' own, and the keepers'):
each new rank fetches the pieces its shards need from where they lie
(`raydist.handover`, never through the driver), then the driver replays the train steps since it from the driver's
batches (`raydist.driver.lifecycle.recovery`): no disk is read. Only when a rank
and its copy's node both died does the restart fall back to the last checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...handover import Kept, Piece, describe, listed, returns
from ...messages import MirrorPlan
from ...protocol import RankActor
from ..cluster.config import DETACHED_NAMESPACE, call_on
from ..cluster.group import RankGroup
from .recovery import Holding

log = logging.getLogger("raydist")

KEEPER_WAIT_S = 10.0  # how long a restart waits for the keepers to say what they hold


class Keeper:
    """Holds the ranks' copies in its node's object store (read there, held by this process): by
    (group generation, rank, train-step index)."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, int, int], Any] = {}

    def keep(self, generation: int, rank: int, index: int, keep: list[int] | None, ref: list) -> None:
        """Keep the copy ``ref[0]`` (the rank's object: in a list, so it arrives unread); ``keep``:
        the indices of this rank's copies of this generation to keep beside it (`raydist.worker.mirror.kept`:
        one of them every rank holds), the others and older generations' go; None: let nothing go."""
        self._held[(generation, rank, index)] = ray.get(ref[0])  # numpy arrays: views of the store
        if keep is not None:
            for key in [k for k in self._held if k[0] < generation or (k[0] == generation and k[1] == rank
                                                                        and k[2] != index and k[2] not in keep)]:
                del self._held[key]

    def forget(self, before: int) -> None:
        """Let go of the copies of generations before ``before`` (a model whose steps count anew)."""
        self._held = {k: v for k, v in self._held.items() if k[0] >= before}

    def held(self) -> list[tuple[int, int, int]]:
        """(generation, rank, index) of every copy held."""
        return sorted(self._held)

    def describe(self, key: tuple[int, int, int]) -> dict[str, Piece]:
        """What the copy ``key`` holds (`raydist.handover.Piece` by name, no data)."""
        return describe(self._held[(key[0], key[1], key[2])], key[1], codes=False)

    def pieces(self, key: tuple[int, int, int], names: list[str]) -> Any:
        """The pieces ``names`` of the copy ``key``, each its own object (called with ``num_returns=len(names)``,
        by the new rank that needs them: it owns what it gets)."""
        return returns([self._held[(key[0], key[1], key[2])][name][0] for name in names])


def keeper_nodes(rank_nodes: Sequence[str], alive: Sequence[str]) -> list[str]:
    """For each rank (by the node it runs on), the node its copies go to: the next node that runs
    ranks, in node order; with every rank on one node, the first other ``alive`` node; with no
    other node, its own."""
    ring = sorted(set(rank_nodes))
    others = sorted(n for n in alive if n not in ring)
    out = []
    for node in rank_nodes:
        if len(ring) > 1:
            out.append(ring[(ring.index(node) + 1) % len(ring)])
        else:
            out.append(others[0] if others else node)
    return out


class KeeperClient:
    """The driver's calls to one node's `Keeper`; ``actor``, its handle, goes to the ranks that keep
    copies with it (`MirrorPlan`) or fetch pieces from it (`raydist.handover.Kept`)."""

    def __init__(self, actor: Any):
        self.actor = actor

    def forget(self, generation: int) -> ray.ObjectRef:
        """Let the copies of generations before ``generation`` go (a ref to wait for)."""
        return self.actor.forget.remote(generation)

    def held(self) -> ray.ObjectRef:
        """A ref to the (generation, rank, index) of every copy it holds."""
        return self.actor.held.remote()

    def describe(self, key: tuple[int, int, int], timeout: float) -> dict[str, Piece]:
        """What the copy ``key`` holds (`Keeper.describe`), within ``timeout``."""
        pieces: dict[str, Piece] = ray.get(self.actor.describe.remote(key), timeout=timeout)
        return pieces

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


class PeerMemory:
    """The model's keepers and its generations of copies (one generation per group of ranks)."""

    def __init__(self, every: int, prefix: str, detached: bool):
        self.every, self.prefix, self.detached = every, prefix, detached
        self.generation = 0
        self._keepers: dict[str, KeeperClient] = {}  # node id -> its keeper
        self.local: dict[tuple[int, int, int], Holding] = {}  # survivors' own copies, taken after a death

    def attach(self, group: RankGroup, base: int, copy_now: bool = False, forget: bool = False,
               check_every: int | None = None, avoid: Collection[str] = (), in_flight: int = 1) -> None:
        """``group`` (its state after ``base`` train steps) copies its state every ``every`` train
        steps; ``copy_now``: and now. ``forget``: the copies before are of another count of steps
        (the state came from a checkpoint, or another driver): let them go. ``avoid``: nodes that
        keep no copies (draining: they go soon). ``in_flight``: messages the driver may have in flight."""
        self.generation = max(self.generation + 1, time.time_ns())  # above any earlier driver's
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in avoid]
        targets = keeper_nodes([p.node_id for p in group.places], alive)
        plans = [MirrorPlan(self.every, self.generation, base, self._keeper(node).actor, check_every, in_flight)
                 for node in targets]
        if forget:
            self.local = {}
            ray.get([k.forget(self.generation) for k in self._keepers.values()])
        group.call_each(RankActor.mirror, {r: (plan, base if copy_now else None) for r, plan in enumerate(plans)},
                        during="peer memory")  # fmt: skip

    def _keeper(self, node: str) -> KeeperClient:
        keeper = self._keepers.get(node)
        if keeper is None:
            lifetime = {"lifetime": "detached", "namespace": DETACHED_NAMESPACE} if self.detached else {}
            actor = ray.remote(Keeper).options(
                name=f"{self.prefix}-keeper-{node[:12]}", get_if_exists=True,  # cluster.config.KEEPER_NAME
                num_cpus=0, max_concurrency=1,  # no CPU: a node whose CPUs the ranks hold still keeps copies
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False), **lifetime,
            ).remote()  # fmt: skip
            keeper = self._keepers[node] = KeeperClient(actor)
        return keeper

    def salvage(self, group: RankGroup, wait_s: float) -> None:
        """A rank of ``group`` died: take the survivors' own copies before the group is torn down (as
        objects the driver owns on the survivors' nodes: they outlive the ranks)."""
        deadline = time.monotonic() + wait_s
        described = call_on(group.actors, RankActor.mirrored)
        ready, _ = ray.wait(described, num_returns=len(described), timeout=wait_s)
        asked = []
        for rank, ref in enumerate(described):
            if ref not in ready:
                continue
            try:
                copies = ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead rank: it has nothing
                continue
            for index, pieces in copies.items():
                names = sorted(pieces)
                refs = call_on([group.actors[rank]], RankActor.copy_pieces, index, names, num_returns=len(names))[0]
                asked.append((rank, index, pieces, dict(zip(names, listed(refs)))))
        made = [r for *_, sources in asked for r in sources.values()]
        # made before the group is torn down: a rank ended in the middle of the call leaves nothing
        done = set(ray.wait(made, num_returns=len(made), timeout=max(0.1, deadline - time.monotonic()),
                            fetch_local=False)[0]) if made else set()  # fmt: skip
        # added to what earlier deaths left: a restart that failed itself still has the first survivors'
        for rank, index, pieces, sources in asked:
            if all(r in done for r in sources.values()):
                self.local[(self.generation, rank, index)] = Holding(index, None, pieces, sources)

    def copies(self) -> dict[tuple[int, int], dict[int, Any]]:
        """Every copy there is, by (generation, index): {rank: a survivor's `Holding`, or (keeper, key)}.
        The survivors' own, then what the live keepers hold (a dead node's keeper holds nothing)."""
        found: dict[tuple[int, int], dict[int, Any]] = {}
        for (generation, rank, index), state in self.local.items():
            found.setdefault((generation, index), {})[rank] = state
        asked = {node: k.held() for node, k in self._keepers.items()}
        deadline = time.monotonic() + KEEPER_WAIT_S
        for node, ref in asked.items():
            try:
                keys = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - its node is gone, or it does not answer
                self._keepers.pop(node, None)
                continue
            keeper = self._keepers[node]
            for key in keys:
                generation, rank, index = key
                found.setdefault((generation, index), {}).setdefault(rank, (keeper, key))
        return found

    @staticmethod
    def read(held: Any) -> Holding:
        """What a copy holds and where its pieces lie: a survivor's (a `Holding` already), or a
        keeper's (``(keeper, key)``: its pieces fetched from the keeper by the ranks that need them)."""
        if isinstance(held, Holding):
            return held
        keeper, key = held
        pieces = keeper.describe(key, KEEPER_WAIT_S)
        return Holding(key[2], None, pieces, {name: Kept(keeper.actor, tuple(key), name) for name in pieces})

    def shutdown(self) -> None:
        """Stop the keepers (the model ends)."""
        for keeper in self._keepers.values():
            try:
                keeper.kill()
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        self._keepers = {}
        self.local = {}
