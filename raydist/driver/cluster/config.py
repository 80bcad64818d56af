"""Starting rank actors and reaching them: how a rank is started, and whether it answers.

Both a group (`raydist.driver.cluster.group.RankGroup`) and the spare pool
(`raydist.driver.cluster.spares.SparePool`) start actors here; the hang watch
(`raydist.driver.cluster.hangs`) and a group's failure path ask them here whether they live.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import ray

from ...options import DispatchConfig, PlacementConfig, RecoveryConfig
from ...protocol import Member, RankActor


@dataclasses.dataclass(frozen=True)
class GroupConfig:
    """How to start the ranks: the model's options (`raydist.options`) and what the driver adds.

    Attributes:
        num_workers: number of ranks, one Ray actor each.
        use_gpu: one GPU per rank and NCCL; otherwise CPU and gloo.
        placement, dispatch, recovery: the model's `PlacementConfig`, `DispatchConfig` (its
            ``step_timeout_s`` also bounds a rank's wait for its loader batch) and `RecoveryConfig`.
        name: prefix of the actor names (``<name>-rank-<i>``).
        paddle_logs: show Paddle's INFO logs from the ranks (quiet by default).
        actor_class: the actors: `RankActor` (they join Paddle's process group),
            or another `raydist.protocol.Member` that starts its own processes
            from `RankGroup.envs` (`raydist launch`).
        preload: modules CPU ranks import while they start (``ray.data`` when
            they will read a loader).
        detached: the actors and their placement group outlive the driver (Ray's
            ``lifetime="detached"``, in the namespace `DETACHED_NAMESPACE`, where
            any later driver finds them by name); see `raydist.driver.lifecycle.detached`.
    """

    num_workers: int
    use_gpu: bool = False
    placement: PlacementConfig = PlacementConfig()
    dispatch: DispatchConfig = DispatchConfig(step_timeout_s=None)
    recovery: RecoveryConfig = RecoveryConfig()
    name: str | None = None
    paddle_logs: bool = False
    actor_class: type[Member] = RankActor
    preload: tuple[str, ...] = ()
    detached: bool = False

    def bundle(self) -> dict[str, float]:
        """One rank's placement bundle."""
        return self.placement.bundle(self.use_gpu)


# Where the actors of detached models live: a driver's own namespace is anonymous (a new one per
# driver), so a later driver could not find them there.
DETACHED_NAMESPACE = "raydist"


_REMOTE: dict[type[Member], Any] = {}


def _remote(actor_class: type[Member]) -> Any:
    """``actor_class`` as a Ray actor class (with its concurrency groups), made once."""
    if actor_class not in _REMOTE:
        make: Any = ray.remote  # (Ray's stubs know no concurrency_groups)
        _REMOTE[actor_class] = make(concurrency_groups=actor_class.concurrency_groups)(actor_class)
    return _REMOTE[actor_class]


# a rank's actor is named "<group>-rank-<i>", a spare's "<group>-spare-<n>" (`RankGroup`, `SparePool`)
RANK_NAME = re.compile(r"^(?P<group>.+)-(rank|spare)-(?P<rank>\d+)$")


# a peer-memory keeper's "<group>-keeper-<node id's first 12>" (`raydist.driver.lifecycle.peers`)
KEEPER_NAME = re.compile(r"^(?P<group>.+)-keeper-(?P<node>[0-9a-f]+)$")


def is_member_of(actor_name: str, group: str) -> bool:
    """Whether ``actor_name`` names a rank, spare or keeper of ``group``."""
    match = RANK_NAME.match(actor_name) or KEEPER_NAME.match(actor_name)
    return match is not None and match["group"] == group


def start_actor(cfg: GroupConfig, name: str, rank: int, world_size: int, scheduling_strategy: Any = None):
    """One actor of ``cfg.actor_class`` holding one rank's resources; CPU rank actors start
    importing Paddle at once (GPU ones once their devices are known)."""
    res = cfg.bundle()
    lifetime = {"lifetime": "detached", "namespace": DETACHED_NAMESPACE} if cfg.detached else {}
    actor = _remote(cfg.actor_class).options(
        **lifetime,
        name=name,
        num_cpus=res.get("CPU", 0),
        num_gpus=res.get("GPU", 0),
        resources={k: v for k, v in res.items() if k not in ("CPU", "GPU")},
        scheduling_strategy=scheduling_strategy,
        runtime_env=None if cfg.placement.runtime_env is None else dict(cfg.placement.runtime_env),
    ).remote(rank, world_size)
    if issubclass(cfg.actor_class, RankActor) and not cfg.use_gpu:
        call_on([actor], RankActor.warm_up, not cfg.paddle_logs, cfg.preload)
    return actor


def ping_all(actors: Sequence, timeout: float) -> list:
    """Each actor's `Member.ping` answer within ``timeout``: its value, the `RayActorError` of a
    dead actor, or `NO_ANSWER`."""
    pings = call_on(actors, Member.ping)
    ready = set(ray.wait(pings, num_returns=len(pings), timeout=timeout)[0])
    answers = []
    for ref in pings:
        try:
            answers.append(ray.get(ref) if ref in ready else NO_ANSWER)
        except ray.exceptions.RayActorError as e:
            answers.append(e)
    return answers


NO_ANSWER = object()


# A rank's endpoint: a method of `raydist.protocol.RankActor` or `Member` (e.g. ``RankActor.state_meta``),
# called by name on the rank actors. Any: Ray types a method under ``@ray.method`` as remote-only.
Endpoint = Any


def call_on(actors: Sequence[Any], method: Endpoint, *args: Any, num_returns: int | None = None) -> list:
    """``method`` called on every actor of ``actors``: refs (``num_returns``: a list of that many per
    actor). The one place the driver calls a rank actor; `RankGroup.call` waits for the refs."""
    name = method.__name__
    if num_returns is None:
        return [getattr(a, name).remote(*args) for a in actors]
    return [getattr(a, name).options(num_returns=num_returns).remote(*args) for a in actors]


def call_each_on(actors: Sequence[Any], method: Endpoint, args: Sequence[tuple]) -> list:
    """``method`` called on each actor of ``actors`` with its own ``args``: refs."""
    return [getattr(a, method.__name__).remote(*a_args) for a, a_args in zip(actors, args)]
