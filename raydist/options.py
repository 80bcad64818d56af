"""A model's options, grouped by what they decide: where its ranks run (`PlacementConfig`), how
steps reach them (`DispatchConfig`) and what it keeps to come back from failures
(`RecoveryConfig`).

Each is a frozen dataclass checked once, when made, with the message a user sees for a bad
value. `raydist.DistModel` and `raydist.to_static` take them whole (``placement_config=``,
``dispatch_config=``, ``recovery_config=``) or field by field (``placement_strategy="SPREAD"``
is shorthand for the field of that name); the driver passes them whole from there on.
Importing this module imports neither Ray nor Paddle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DISPATCH = ("auto", "compiled", "calls", "tree")
REPLICA_MISMATCH = ("raise", "warn")


def check_positive_int(name: str, value: Any, *, what: str = "", optional: bool = False,
                       also: tuple[Any, ...] = ()) -> None:  # fmt: skip
    """Refuse ``value`` for the option ``name`` unless it is an int >= 1 (None too with ``optional``;
    the values ``also``, e.g. "auto"); ``what`` says what the number counts."""
    if (optional and value is None) or (isinstance(value, str) and value in also):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = " or ".join((["None", "an int >= 1"] if optional else ["a positive int"]) + [repr(a) for a in also])
        raise ValueError(f"{name} must be {allowed}{f' ({what})' if what else ''}, got {value!r}")


def _check_seconds(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ValueError(f"{name} must be None or a positive number of seconds, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Where a model's ranks run on the Ray cluster.

    Attributes:
        resources_per_rank: the Ray resources of one rank (its placement bundle), e.g.
            ``{"CPU": 4, "rank_node": 1}``; default ``{"CPU": 1}``, and ``{"GPU": 1}`` too
            with ``use_gpu``.
        placement_strategy: of the ranks' placement group: "PACK" (few nodes), "SPREAD",
            "STRICT_PACK" or "STRICT_SPREAD".
        placement_timeout_s: how long to wait for the cluster to place the ranks (an
            autoscaling cluster grows meanwhile); None waits for ever.
        master_port: the port of Paddle's TCP store on rank 0's node; None: a free one (and
            another free one if this one is taken).
        spare_ranks: rank actors kept started (process up, Paddle imported on CPUs) and joined
            to nothing, each holding one rank's resources, for the next restart or resize to
            use instead of starting processes. 0: none.
        runtime_env: the Ray runtime environment of the rank actors (``env_vars``, ``pip``,
            ``working_dir``...).
    """

    resources_per_rank: Mapping[str, float] | None = None
    placement_strategy: str = "PACK"
    placement_timeout_s: float | None = 300.0
    master_port: int | None = None
    spare_ranks: int = 0
    runtime_env: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        resources = self.resources_per_rank
        if resources is not None:
            if not isinstance(resources, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                    for k, v in resources.items()):  # fmt: skip
                raise ValueError("resources_per_rank must map Ray resource names to amounts >= 0, e.g. "
                                 f"{{'CPU': 1, 'GPU': 1}}, got {resources!r}")  # fmt: skip
            object.__setattr__(self, "resources_per_rank", dict(resources))  # the caller's dict may change
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                             f"got {self.placement_strategy!r}")  # fmt: skip
        _check_seconds("placement_timeout_s", self.placement_timeout_s)
        port = self.master_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"master_port must be None or a port number (1-65535), got {port!r}")
        if isinstance(self.spare_ranks, bool) or not isinstance(self.spare_ranks, int) or self.spare_ranks < 0:
            raise ValueError(f"spare_ranks must be an int >= 0, got {self.spare_ranks!r}")
        if self.runtime_env is not None and not isinstance(self.runtime_env, Mapping):
            raise ValueError(f"runtime_env must be a dict (Ray's runtime_env), got {self.runtime_env!r}")
        if self.runtime_env is not None:
            object.__setattr__(self, "runtime_env", dict(self.runtime_env))

    def bundle(self, use_gpu: bool) -> dict[str, float]:
        """One rank's placement bundle."""
        if self.resources_per_rank is not None:
            return dict(self.resources_per_rank)
        return {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """How a model's steps reach its ranks, and how long a step may take.

    Attributes:
        dispatch: "compiled" (a Ray Compiled Graph: the least driver work per step, but its
            channels busy-wait, a core per waiting process), "calls" (one actor call per
            rank), "tree" (the driver sends each message to rank 0, the ranks pass it on from
            node to node and within nodes, and the results come back the same way: the
            driver's cost does not grow with the ranks), or "auto": compiled with GPUs; on
            CPUs, calls below 8 ranks and tree from 8.
        max_in_flight: how many messages of steps may be outstanding before the driver waits
            for the oldest; 1 with ``steps_per_message=1`` makes every call wait for its step.
        steps_per_message: calls made while a message is outstanding are held and sent
            together, up to this many steps in one message (the ranks run them back to back:
            the same numbers as one at a time); reading a loss sends what is held. "auto": as
            many as make about 0.5 s of steps, up to 64, from the steps' measured pace.
        step_timeout_s: how long a step may take (and a rank may wait for its loader batch)
            before its ranks count as hung: a rank in one step, or not answering, for this
            long plus 5 s is a `raydist.RankError` naming it, however many steps its message
            holds, and the ranks are torn down. None: no limit. A dead rank is reported at
            once, whatever this is.
    """

    dispatch: str = "auto"
    max_in_flight: int = 2
    steps_per_message: int | str = "auto"
    step_timeout_s: float | None = 900.0

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCH:
            raise ValueError(f"dispatch must be one of {DISPATCH}, got {self.dispatch!r}")
        check_positive_int("max_in_flight", self.max_in_flight)
        check_positive_int("steps_per_message", self.steps_per_message, also=("auto",))
        _check_seconds("step_timeout_s", self.step_timeout_s)

    def resolved(self, use_gpu: bool, detached: bool) -> DispatchConfig:
        """With "auto" made "compiled" where that is the choice (GPUs, not detached); the transport
        picks calls or tree from the group's size (`raydist.driver.dispatch.transport`)."""
        if self.dispatch == "auto" and use_gpu and not detached:
            return dataclasses.replace(self, dispatch="compiled")
        return self


@dataclasses.dataclass(frozen=True)
class RecoveryConfig:
    """What a model keeps, beside its checkpoints, to come back from failures.

    Attributes:
        peer_memory: every this many train steps, each rank hands a copy of its shards
            (parameters, optimizer state) to host memory on another node, off the step's
            path. After a rank or a node dies where no data-parallel replica holds its shards
            (tensor, pipeline parallel), a restart (in ``fit`` too, which then needs no
            ``checkpoint_dir``) builds the state from the newest complete copy and replays
            the train steps since from the same batches: no disk is read, and the run equals
            one that never failed. Only a rank and its copy's node both lost fall back to the
            last checkpoint. None: off.
        check_replicas: every this many train steps, the data-parallel replicas of each shard
            are compared by a CRC-32 of their bits, beside the steps. Replicas that disagree
            are a `raydist.ReplicaMismatchError` at the next train call (the ranks, the
            tensors, the step), and the ranks are torn down: ``restart()`` (``fit`` with
            ``max_failures``) goes back to the newest copy no later than the last check that
            passed and replays the steps since. None: off.
        replica_mismatch: "raise" (the error above) or "warn" (logged, and the run goes on).
    """

    peer_memory: int | None = None
    check_replicas: int | None = None
    replica_mismatch: str = "raise"

    def __post_init__(self) -> None:
        for option in ("peer_memory", "check_replicas"):
            check_positive_int(option, getattr(self, option), what="train steps between two", optional=True)
        if self.replica_mismatch not in REPLICA_MISMATCH:
            raise ValueError(f"replica_mismatch must be 'raise' or 'warn', got {self.replica_mismatch!r}")


Config = TypeVar("Config", PlacementConfig, DispatchConfig, RecoveryConfig)


def merged(kind: type[Config], given: Config | None, argument: str, **fields: Any) -> Config:
    """``given`` (or the defaults) with the keywords ``fields`` that differ from their defaults in
    place of its fields: the keywords are shorthand for them. A keyword and ``given`` that both
    set one field to different values are refused, naming both (``argument``: ``given``'s)."""
    if given is not None and not isinstance(given, kind):
        raise TypeError(f"{argument} must be a raydist.{kind.__name__}, got {type(given).__name__}")
    defaults = {f.name: f.default for f in dataclasses.fields(kind)}
    unknown = set(fields) - set(defaults)
    if unknown:
        raise TypeError(f"{kind.__name__} has no field {sorted(unknown)}")
    changed = {name: value for name, value in fields.items() if not _same(value, defaults[name])}
    if given is None:
        return kind(**changed)
    for name, value in changed.items():
        if not _same(getattr(given, name), defaults[name]) and not _same(getattr(given, name), value):
            raise ValueError(f"{name}={value!r} and {argument}.{name}={getattr(given, name)!r} disagree: "
                             "give one of them")  # fmt: skip
    return dataclasses.replace(given, **changed) if changed else given


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b
