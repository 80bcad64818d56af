"""``raydist.status()``: the live raydist ranks of the cluster this driver is connected to."""

from __future__ import annotations

import dataclasses
import re

import ray

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
    for entry in ray.util.list_named_actors(all_namespaces=True):
        match = _RANK_NAME.match(entry["name"])
        if match:
            try:
                actors.append((match["group"], ray.get_actor(entry["name"], namespace=entry["namespace"])))
            except ValueError:  # gone meanwhile
                pass
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
        out.append(RankStatus(group=report.get("group") or group,
                              **{f.name: report[f.name] for f in dataclasses.fields(RankStatus) if f.name != "group"}))
    return sorted(out, key=lambda s: (s.group, s.rank))
