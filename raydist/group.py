"""The rank group: placement group, one actor per rank, rendezvous, failure, teardown.

Ranks are ordered by node (the driver's node first), then by bundle; on GPU
the co-located ranks take their node's GPUs in id order (`raydist.env`). A
rank that raises or dies ends the whole group: every actor is killed (peers
blocked in a collective included) and the driver gets a `RankError` naming
the rank.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .env import RankPlace, paddle_env
from .errors import GroupShutdownError, RankError, RankFailed, UsageError
from .rank import RankActor

log = logging.getLogger("raydist")

# "data": a loader's reader thread, so reading overlaps the steps (default group).
# How long a failure waits for Ray to report a rank's death, which may be its cause.
DEATH_GRACE_S = 2.0

_RemoteRank = ray.remote(concurrency_groups={"data": 1})(RankActor)


@dataclasses.dataclass
class GroupConfig:
    """How to start the ranks.

    Attributes:
        num_workers: number of ranks, one Ray actor each.
        use_gpu: one GPU per rank and NCCL; otherwise CPU and gloo.
        resources_per_rank: Ray resources of one rank's bundle; default
            ``{"CPU": 1}``, plus ``{"GPU": 1}`` with ``use_gpu``.
        placement_strategy: of the placement group (PACK, SPREAD, STRICT_PACK...).
        master_port: port of Paddle's TCP store on rank 0's node; a free one
            if None, and another free one if this one is taken.
        placement_timeout_s: how long to wait for the cluster to place the
            ranks (autoscaling clusters grow meanwhile); None waits forever.
        name: prefix of the actor names (``<name>-rank-<i>``).
        paddle_logs: show Paddle's INFO logs from the ranks (quiet by default).
        runtime_env: Ray runtime environment of the rank actors (env_vars,
            pip, working_dir...).
    """

    num_workers: int
    use_gpu: bool = False
    resources_per_rank: dict[str, float] | None = None
    placement_strategy: str = "PACK"
    master_port: int | None = None
    placement_timeout_s: float | None = 300.0
    name: str | None = None
    paddle_logs: bool = False
    runtime_env: dict | None = None

    def bundle(self) -> dict[str, float]:
        if self.resources_per_rank is not None:
            return dict(self.resources_per_rank)
        return {"CPU": 1.0, "GPU": 1.0} if self.use_gpu else {"CPU": 1.0}


class RankGroup:
    """``num_workers`` rank actors that form one Paddle process group."""

    def __init__(self, config: GroupConfig, join: bool = True):
        """``join``: the actors join the Paddle process group themselves (DistModel);
        if False, each rank's environment is left in ``envs`` for a process the
        actor starts (`raydist.launch`)."""
        self.config = config
        self.join = join
        self.envs: list[dict[str, str]] = []
        self.actors: list = []
        self.places: list[RankPlace] = []
        self.pids: list[int] = []
        self.fixes: list[str] = []
        self._pg = None
        self._alive = False
        self._steps = None
        self._start()

    # -- start -----------------------------------------------------------------

    def _start(self) -> None:
        cfg = self.config
        port = cfg.master_port
        for attempt in range(3):
            try:
                self._pg = placement_group([cfg.bundle()] * cfg.num_workers, strategy=cfg.placement_strategy)
                self._wait_placed()
                self._spawn()
                self._rendezvous(port)
                return
            except RankError as e:
                # A master port taken between our check and Paddle's bind
                # aborts rank 0 (a libuv assertion): start over on a new port.
                if not (e.rank == 0 and e.died and e.during == "setup" and attempt < 2):
                    raise
                log.warning("rank 0 died while opening the master port; retrying on another port")
                port = None
            except BaseException:
                self.shutdown()
                raise

    def _wait_placed(self) -> None:
        cfg, start = self.config, time.monotonic()
        logged = start
        while True:
            # Checked every round: a fresh cluster publishes its autoscaler
            # status a few seconds after it starts.
            if not _fits_a_node(cfg.bundle()) and not _autoscaling():
                remove_placement_group(self._pg)
                raise ValueError(
                    f"no node of this cluster can hold one rank's {cfg.bundle()} (nodes: {_node_resources()}), "
                    "and no autoscaler can add one: ask for less with resources_per_rank"
                )
            waited = time.monotonic() - start
            left = 10.0 if cfg.placement_timeout_s is None else cfg.placement_timeout_s - waited
            try:
                ray.get(self._pg.ready(), timeout=max(0.5, min(_PLACEMENT_POLL_S, left)))
                return
            except ray.exceptions.GetTimeoutError:
                waited = time.monotonic() - start
                msg = f"waiting for {cfg.num_workers} x {cfg.bundle()}: {_placeable(cfg.bundle())} placeable"
                if cfg.placement_timeout_s is not None and waited >= cfg.placement_timeout_s:
                    remove_placement_group(self._pg)
                    raise TimeoutError(
                        f"could not place the ranks in {waited:.0f} s ({msg}). Give the cluster more "
                        "resources, or ask less per rank with resources_per_rank."
                    ) from None
                if time.monotonic() - logged >= 10:
                    logged = time.monotonic()
                    log.warning("%s (%.0f s)", msg, waited)

    def _spawn(self) -> None:
        """Start one actor per rank, ranks ordered by node (the driver's first), then bundle."""
        cfg = self.config
        bundle_nodes = placement_group_table(self._pg)["bundles_to_node_id"]
        here = ray.get_runtime_context().get_node_id()
        order = sorted(range(cfg.num_workers), key=lambda b: (bundle_nodes[b] != here, bundle_nodes[b], b))
        prefix = cfg.name or f"raydist-{uuid.uuid4().hex[:6]}"
        res = cfg.bundle()
        self.actors = [
            _RemoteRank.options(
                name=f"{prefix}-rank-{rank}",
                num_cpus=res.get("CPU", 0),
                num_gpus=res.get("GPU", 0),
                resources={k: v for k, v in res.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=b),
                runtime_env=cfg.runtime_env,
            ).remote(rank, cfg.num_workers)
            for rank, b in enumerate(order)
        ]
        self._alive = True
        placed = self.gather([a.place.remote() for a in self.actors], "placement")
        self.places = [p for p, _ in placed]
        self.pids = [pid for _, pid in placed]

    def _rendezvous(self, port: int | None) -> None:
        rank0 = self.actors[0]
        if port is not None and not self.gather([rank0.port_is_free.remote(port)], "rendezvous", ranks=[0])[0]:
            log.warning("master port %s is taken on rank 0's node; using a free one", port)
            port = None
        if port is None:
            port = self.gather([rank0.free_port.remote()], "rendezvous", ranks=[0])[0]
        own_ports = self.gather([a.free_port.remote() for a in self.actors], "rendezvous")
        endpoints = [f"{p.node_ip}:{q}" for p, q in zip(self.places, own_ports)]
        master = f"{self.places[0].node_ip}:{port}"
        self.envs = [paddle_env(r, self.places, endpoints, master, use_gpu=self.config.use_gpu) for r in range(len(self))]
        if self.join:
            setups = [a.setup.remote(e, self.config.use_gpu, self.config.paddle_logs) for a, e in zip(self.actors, self.envs)]
            self.fixes = self.gather(setups, "setup")[0]

    # -- calls -----------------------------------------------------------------

    def __len__(self) -> int:
        return self.config.num_workers

    @property
    def alive(self) -> bool:
        return self._alive

    def broadcast(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        """Call ``method`` with the same arguments on every rank (refs in rank order)."""
        self._check_alive()
        return [getattr(a, method).remote(*args) for a in self.actors]

    def run(self, method: str, *args: Any) -> list:
        """`broadcast` and wait for every rank's result."""
        return self.gather(self.broadcast(method, *args), method)

    def gather(self, refs: Sequence[ray.ObjectRef], during: str, ranks: Sequence[int] | None = None,
               timeout: float | None = None) -> list:  # fmt: skip
        """Results of ``refs`` (one per rank in ``ranks``, default all, in order).

        The first failure tears the group down and raises: `UsageError` as
        itself, anything else as `RankError`. ``ray.get`` of several refs
        raises as soon as one of them failed, so this never waits on a rank
        that is blocked because a peer failed. After ``timeout`` seconds
        without every result (a collective that never returns), the ranks
        still busy are named in a `RankError` and the group is torn down.
        """
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        try:
            return ray.get(list(refs), timeout=timeout)
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
            raise self.fail(e, during, ranks[0] if len(ranks) == 1 else -1) from None
        except ray.exceptions.GetTimeoutError:
            _, busy = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            stuck = [ranks[list(refs).index(r)] for r in busy]
            raise self.timed_out(stuck, during, timeout) from None

    def timed_out(self, stuck: list[int], during: str, timeout: float) -> RankError:
        """Tear the group down after ranks ``stuck`` gave no answer in time."""
        self.shutdown(graceful=False)
        return RankError(
            stuck[0] if stuck else -1,
            f"no result from ranks {stuck} within {timeout} s: a collective that never returns, or a peer "
            "that vanished without Ray noticing (raise step_timeout_s for longer steps)",
            during=during,
        )

    def fail(self, e: Exception, during: str, rank: int = -1) -> Exception:
        """Tear the group down after ``e``; the error to raise, naming the root cause.

        A rank's death makes its peers' collectives fail too, sometimes before
        Ray reports the death: a dead rank, if any, is the one to name.
        """
        dead = self._dead_rank()
        if dead is not None:
            rank, e = dead
        elif self.rank_of(e) >= 0:
            rank = self.rank_of(e)
        self.shutdown(graceful=False)
        return _failure(e, rank, during)

    def _dead_rank(self, timeout: float = DEATH_GRACE_S) -> tuple[int, Exception] | None:
        pings = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return pings.index(ref), e
        return None

    def rank_of(self, e: Exception) -> int:
        """Which rank a failure came from: `RankFailed` says; a death names the actor."""
        cause = getattr(e, "cause", None)
        if isinstance(cause, RankFailed):
            return cause.rank
        message = str(e)
        return next((r for r, a in enumerate(self.actors) if a._actor_id.hex() in message), -1)

    def _check_alive(self) -> None:
        if not self._alive:
            raise GroupShutdownError("the rank group is shut down (after shutdown() or a rank failure)")

    # -- teardown --------------------------------------------------------------

    def _kill_actors(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []

    def steps(self, max_in_flight: int, compiled: bool = True, timeout: float | None = None):
        """The transport of step messages (`raydist.dispatch`), opened on first use."""
        self._check_alive()
        if self._steps is None:
            from .dispatch import open_steps

            self._steps = open_steps(self, max_in_flight, compiled, timeout)
        return self._steps

    def shutdown(self, graceful: bool = True) -> None:
        """Kill every rank and free the placement group. Idempotent.

        ``graceful``: stop the step graph before killing the ranks; after a
        failure ranks may be stuck in a collective, so they are killed first.
        """
        self._alive = False
        if not ray.is_initialized():
            return
        steps, self._steps = self._steps, None
        if steps is not None and graceful:
            steps.close()
        self._kill_actors()
        if steps is not None and not graceful:
            steps.close()
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:  # already removed
                pass
            self._pg = None


def _failure(e: Exception, rank: int, during: str) -> Exception:
    if isinstance(e, ray.exceptions.RayActorError):
        return RankError(rank, _death_cause(e), died=True, during=during)
    cause = getattr(e, "cause", None)
    if isinstance(cause, UsageError):
        return UsageError(str(cause))
    if isinstance(cause, RankFailed):
        return RankError(cause.rank, cause.traceback, during=during)
    return RankError(rank, _task_traceback(e), during=during)


def _task_traceback(e: ray.exceptions.RayTaskError) -> str:
    """The rank's traceback, as Python prints one (Ray's text, without colour codes)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", getattr(e, "traceback_str", None) or str(e)).strip()
    header, _, frames = text.partition("\n")
    if not header.startswith("ray::"):
        return text
    return f"{frames}" if frames.startswith("Traceback") else f"Traceback (most recent call last):\n{frames}"


_PLACEMENT_POLL_S = 2.0


def init_ray(num_workers: int, resources_per_rank: dict | None, use_gpu: bool) -> bool:
    """Connect to Ray if needed: to the cluster of ``RAY_ADDRESS`` (as under `ray job
    submit`), else a new local Ray with enough logical CPUs for the ranks.
    Returns whether this started (or connected) Ray, so the caller can stop it."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return True
    cpus = (resources_per_rank or {}).get("CPU", 0 if use_gpu else 1)
    num_cpus = max(os.cpu_count() or 1, int(math.ceil(num_workers * cpus)))
    log.info("starting a local Ray instance with %d CPUs", num_cpus)
    ray.init(num_cpus=num_cpus)
    return True


def _death_cause(e: ray.exceptions.RayActorError) -> str:
    return str(e).strip() or type(e).__name__


def _node_resources() -> list[dict[str, float]]:
    keep = ("CPU", "GPU", "memory")
    return [{k: v for k, v in n.get("Resources", {}).items() if k in keep} for n in ray.nodes() if n.get("Alive")]


def _fits_a_node(bundle: dict[str, float]) -> bool:
    return any(
        all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in bundle.items()) for n in ray.nodes() if n.get("Alive")
    )


def _autoscaling() -> bool:
    """Whether an autoscaler may still add nodes to this cluster.

    A cluster from `ray.init()` or `ray start` runs Ray's monitor with its
    read-only node provider, whose node types are the nodes' own ids
    ("node_<id>"); a cluster launcher or KubeRay autoscaler names its types.
    When we cannot tell (no status published yet, another autoscaler
    version), we assume it may scale: waiting, bounded by
    placement_timeout_s, is safer than refusing a cluster that could grow.
    """
    import json

    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        status = json.loads(_internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS))
        types = status["autoscaler_report"]["node_type_mapping"]
    except Exception:
        return True
    return not types or any(kind != f"node_{node}" for node, kind in types.items())


def _placeable(bundle: dict[str, float]) -> int:
    """How many bundles the cluster's nodes could hold in total (ignoring what is in use)."""
    total = 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        total += int(min((have.get(k, 0.0) // v if v else float("inf")) for k, v in bundle.items()))
    return total
