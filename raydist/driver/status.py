"""``raydist.status()``: the live raydist ranks of the cluster this driver is connected to,
detached models' (`raydist.driver.detached`) with who holds them."""

from __future__ import annotations

import dataclasses
import re

import ray

from .actors import DETACHED_NAMESPACE

_RANK_NAME = re.compile(r"^(?P<group>.+)-(rank|spare)-(?P<rank>\d+)$")


@dataclasses.dataclass(frozen=True)
class RankStatus:
    """One live rank, as it reports itself."""

    group: str  # the actors' name prefix (``name=`` of to_static, or raydist-<id>)
    rank: int
    node_ip: str
    node_id: str  # Ray's node id (several nodes may share an IP, e.g. ray.cluster_utils.Cluster)
    pid: int
    device: str  # "cpu" or "gpu:<index>"
    mode: str | None  # "train", "eval", "predict", or None before the first mode is built
    peak_rss_mib: float
    detached: bool = False  # a detached model's rank (it outlives its driver: raydist.attach(group))
    held_by: str | None = None  # of a detached model: the live driver that holds it (None: none does)


def status(timeout_s: float = 10.0) -> list[RankStatus]:
    """Every live raydist rank in the cluster (of any driver and namespace), by group and rank.

    Ranks answer from a thread of their own, so this works while they run
    steps. A rank that does not answer within ``timeout_s`` is left out.
    """
    if not ray.is_initialized():
        return []
    # Ray's state API (ray.util.state.list_actors) would filter by class and
    # state, but it answers through the dashboard: measured here, it fails with
    # ServerUnavailable under ray.init(include_dashboard=False). The named-actor
    # list comes from the GCS, which every cluster has; ranks are named
    # "<group>-rank-<i>" (raydist.driver.group), or "<pool>-spare-<j>" (raydist.driver.spares).
    actors = []
    detached: dict[str, str | None] = {}  # group -> its holder
    for entry in ray.util.list_named_actors(all_namespaces=True):
        match = _RANK_NAME.match(entry["name"])
        if match:
            try:
                actors.append((match["group"], ray.get_actor(entry["name"], namespace=entry["namespace"])))
            except ValueError:  # gone meanwhile
                continue
            if entry["namespace"] == DETACHED_NAMESPACE and match["group"] not in detached:
                detached[match["group"]] = _holder(match["group"])
    refs = []
    for group, actor in actors:
        try:
            refs.append((group, actor.status.remote()))
        except AttributeError:  # an actor of somebody else's with a name like ours
            pass
    ready, _ = ray.wait([r for _, r in refs], num_returns=len(refs), timeout=timeout_s)
    ready = set(ready)
    out = []
    for group, ref in refs:
        if ref not in ready:
            continue
        try:
            report = ray.get(ref)
        except ray.exceptions.RayError:
            continue
        if report["rank"] < 0:  # a spare no group has adopted yet
            continue
        group = report.get("group") or group
        own = {f.name: report[f.name] for f in dataclasses.fields(RankStatus) if f.name in report and f.name != "group"}
        out.append(RankStatus(group=group, detached=group in detached, held_by=detached.get(group), **own))
    return sorted(out, key=lambda s: (s.group, s.rank))


def _holder(name: str) -> str | None:
    """Who holds the detached model ``name`` (None: no live driver, or no record)."""
    from .detached import find, holder_of

    try:
        holder = holder_of(find(name))
    except (LookupError, ray.exceptions.RayError):
        return None
    return None if holder is None else str(holder)
