"""What raydist runs on the cluster, as anyone connected to it sees it: ``raydist.status()`` (each
rank), ``raydist.models()`` and ``raydist status`` (each model and launched script).

Ranks are found by name: ``<group>-rank-<i>`` (`raydist.driver.cluster.group`), or
``<pool>-spare-<j>`` (`raydist.driver.cluster.spares`). Ray's state API
(``ray.util.state.list_actors``) would filter by class and state, but it answers
through the dashboard: measured here, it fails with ServerUnavailable under
``ray.init(include_dashboard=False)``. The named-actor list comes from the GCS,
which every cluster has, and Ray Client forwards it. Ranks answer from a thread
of their own, so this works while they run steps. What only a driver knows (its
holder, the elastic bounds, the last checkpoint) each rank keeps as its driver
last told it (`raydist.protocol.Member.describe`); who holds a detached model
now, its record says (`raydist.driver.lifecycle.detached`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray

from ...protocol import Member
from ..cluster.config import DETACHED_NAMESPACE, RANK_NAME, call_on


@dataclasses.dataclass(frozen=True)
class RankStatus:
    """One live rank, as it reports itself."""

    group: str  # the actors' name prefix (``name=`` of to_static, or raydist-<id>)
    rank: int
    node_ip: str
    node_id: str  # Ray's node id (several nodes may share an IP, e.g. ray.cluster_utils.Cluster)
    pid: int
    device: str  # "cpu" or "gpu:<index>"
    mode: str | None  # "train", "eval", "predict", or None before the first mode is built (and for scripts)
    peak_rss_mib: float
    detached: bool = False  # a detached model's rank (it outlives its driver: raydist.attach(group))
    held_by: str | None = None  # of a detached model: the live driver that holds it (None: none does)
    kind: str = "model"  # "model" (a DistModel's rank) or "script" (a rank of `raydist launch`)
    step: int | None = None  # the number after the last step it ran (None: a script's)
    last_answer: float | None = None  # when it last answered its driver (time.time()), None: never yet


@dataclasses.dataclass(frozen=True)
class ModelStatus:
    """A model (or a launched script) on the cluster: what its ranks report, and what its driver
    told them. ``missing``: the ranks whose actors exist but did not answer in time."""

    name: str
    kind: str  # "model" or "script"
    detached: bool
    holder: str | None  # the live driver that holds it (None: a detached model no driver holds)
    size: int  # its ranks
    bounds: tuple[int, int] | None  # an elastic model's (min, max) ranks; (n, n) for a fixed size
    mode: str | None
    step: int | None  # the steps it has run (the most any rank ran)
    nodes: list[str]  # the Ray node ids its ranks run on
    last_checkpoint: str | None
    script: str | None  # a launched script's file
    ranks: list[RankStatus]
    missing: list[int]
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # its last few (`DistModel.events`)
    restarts: int | None = None  # a launched script's restarts so far (``raydist launch --max-restarts``)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def status(timeout_s: float = 10.0) -> list[RankStatus]:
    """Every live raydist rank in the cluster (of any driver and namespace, models' and launched
    scripts'), by group and rank. A rank that does not answer within ``timeout_s`` is left out."""
    ranks, _ = _survey(timeout_s)
    return ranks


def models(timeout_s: float = 10.0) -> list[ModelStatus]:
    """Every raydist model and launched script in the cluster (of any driver), by name: its holder,
    size and elastic bounds, mode and step, nodes, last checkpoint, and each rank's `RankStatus`."""
    ranks, found = _survey(timeout_s)
    out = []
    for group in sorted(found):
        detached, actors, cards = found[group]["detached"], found[group]["ranks"], found[group]["cards"]
        mine = [s for s in ranks if s.group == group]
        card: dict[str, Any] = next((c for c in cards if c), {})
        steps = [s.step for s in mine if s.step is not None]
        modes = {s.mode for s in mine if s.mode is not None}
        holder = (found[group]["holder"] if detached else card.get("holder"))
        bounds = card.get("sizes")
        out.append(ModelStatus(
            name=group, kind=mine[0].kind if mine else card.get("kind", "model"), detached=detached, holder=holder,
            size=len(actors), bounds=tuple(bounds) if bounds else None,
            mode=modes.pop() if len(modes) == 1 else (", ".join(sorted(modes)) or None),
            step=max(steps) if steps else None, nodes=sorted({s.node_id for s in mine}),
            last_checkpoint=card.get("last_checkpoint"), script=card.get("script"), ranks=mine,
            missing=sorted(set(actors) - {s.rank for s in mine}), events=card.get("events", []),
            restarts=card.get("restarts"),
        ))  # fmt: skip
    return out


def rank_status(report: dict[str, Any], group: str, detached: bool, held_by: str | None) -> RankStatus:
    """A rank's `RankStatus` from its own report (``Member.status``)."""
    own = {f.name: report[f.name] for f in dataclasses.fields(RankStatus)
           if f.name in report and f.name not in ("group", "detached", "held_by")}  # fmt: skip
    return RankStatus(group=group, detached=detached, held_by=held_by, **own)


def _survey(timeout_s: float) -> tuple[list[RankStatus], dict[str, dict[str, Any]]]:
    """The ranks that answered, and for each group: whether detached, its holder (detached:
    from the record), its ranks' numbers (by actor name) and the cards its ranks hold."""
    if not ray.is_initialized():
        return [], {}
    found: dict[str, dict[str, Any]] = {}
    refs = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        match = RANK_NAME.match(entry["name"])
        if not match:
            continue
        try:
            actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
            [ref] = call_on([actor], Member.status)
        except (ValueError, AttributeError):  # gone meanwhile; or somebody else's actor with a name like ours
            continue
        refs.append((match["group"], "rank" in entry["name"][len(match["group"]):], int(match["rank"]), ref))
        record = found.setdefault(match["group"], {"detached": entry["namespace"] == DETACHED_NAMESPACE,
                                                   "ranks": set(), "cards": []})  # fmt: skip
        if record["detached"] and "holder" not in record:
            record["holder"] = _holder(match["group"])
    ready = set(ray.wait([r for *_, r in refs], num_returns=len(refs), timeout=timeout_s)[0]) if refs else set()
    out = []
    for group, named_rank, number, ref in refs:
        report = None
        if ref in ready:
            try:
                report = ray.get(ref)
            except ray.exceptions.RayError:
                pass
        if report is not None and report["rank"] < 0:  # a spare no group has adopted yet
            continue
        if named_rank:
            found[group]["ranks"].add(number)
        if report is None:
            continue
        group = report.get("group") or group  # a spare adopted by another group
        entry = found.setdefault(group, {"detached": False, "ranks": set(), "cards": []})
        entry["ranks"].add(report["rank"])
        entry["cards"].append(report.get("card") or {})
        out.append(rank_status(report, group, entry["detached"], entry.get("holder")))
    for entry in found.values():
        entry["ranks"] = sorted(entry["ranks"])
    return sorted(out, key=lambda s: (s.group, s.rank)), {g: e for g, e in found.items() if e["ranks"]}


def _holder(name: str) -> str | None:
    """Who holds the detached model ``name`` (None: no live driver, or no record)."""
    from ..lifecycle.detached import find

    try:
        holder = find(name).live_holder()
    except (LookupError, ray.exceptions.RayError):
        return None
    return None if holder is None else str(holder)


def ago(when: float | None) -> str:
    """``when`` (time.time()) as "3.2 s ago", "never" for None."""
    if when is None:
        return "never"
    seconds = max(0.0, time.time() - when)
    if seconds < 120:
        return f"{seconds:.1f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"
