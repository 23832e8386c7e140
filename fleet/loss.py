"""Step 1 of the replica-loss procedure: confirm the loss, size it, and look for a common cause.

Contract (all pure; the activities gather the observations):

* ``confirm_group(group, pods, nodes, routed_pods, publish_not_ready)`` ->
  ``GroupVerdict``: is this replica group **lost** or **slow-but-present**?
  Lost means a pod is gone/failed/terminating, its node is NotReady/Unknown,
  its engine is dead (health 5xx/unreachable, container not ready, crash loop)
  or wedged (work queued, tokens not advancing). One lost rank loses the whole
  group. A replica that is merely saturated or slow - including one whose
  ``serving-ready`` gate fleetmend itself turned off - is *not* a loss: the
  verdict says so and the procedure stops without touching anything. The
  verdict also lists lost pods the router can still reach (``dead_but_routed``):
  those must be derouted first.
* ``size_loss(snapshot, lost_group_ids)`` -> ``LossSize``: groups and GPUs lost,
  the fraction of the serving pool, the nodes and failure domains involved.
* ``correlate(events, snapshot, window_s)`` -> ``Correlation``: several losses
  within the window are one incident; a loss of the revision being rolled out
  is a **bad rollout** (revert, never replace); two or more lost nodes in one
  NVLink domain, or every pool node of a zone, is a **domain loss** (a
  multi-node group lost to one rank's fault does not make its Ready nodes lost).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from fleet.incident import LossReport
from fleet.observation import EngineHealth, PodObservation, WorkloadSelector
from fleet.pool import GroupRole, NodeInfo, PoolSnapshot, ReplicaGroup, WorkloadKind
from fleet.recovery import IncidentCause
from fleet.vocabulary import NVLINK_DOMAIN_LABEL, ZONE_LABEL

_ENGINE_DEAD_WAITING_REASONS = frozenset({"CrashLoopBackOff", "RunContainerError", "CreateContainerError"})


class Verdict(StrEnum):
    LOST = "lost"
    PRESENT = "slow-but-present"


class GroupVerdict(BaseModel):
    model_config = ConfigDict(frozen=True)

    group_id: str
    verdict: Verdict
    reason: str
    lost_pods: tuple[str, ...] = ()
    dead_but_routed: tuple[str, ...] = Field(default=(), description="Lost pods the router can still reach")
    evidence: tuple[str, ...] = ()

    @property
    def lost(self) -> bool:
        return self.verdict is Verdict.LOST


def _pod_loss_evidence(obs: PodObservation, node: NodeInfo | None) -> list[str]:
    ev: list[str] = []
    if not obs.exists:
        return [f"pod {obs.pod} no longer exists"]
    if obs.phase in ("Failed", "Succeeded", "Unknown"):
        detail = f" ({obs.status_reason})" if obs.status_reason else ""
        ev.append(f"pod {obs.pod} is in phase {obs.phase}{detail}")
    if obs.deleting:
        ev.append(f"pod {obs.pod} is terminating")
    if node is not None and node.ready is not True:
        ev.append(_node_not_ready(node))
    if obs.waiting_reason in _ENGINE_DEAD_WAITING_REASONS:
        ev.append(f"pod {obs.pod} container is waiting in {obs.waiting_reason}")
    if obs.terminated_reason and not obs.containers_ready:
        ev.append(f"pod {obs.pod} container terminated: {obs.terminated_reason}")
    if obs.engine_health is EngineHealth.FAILING:
        ev.append(f"engine on {obs.pod} answers /health with an error (engine dead)")
    elif obs.engine_health is EngineHealth.UNREACHABLE:
        ev.append(f"engine on {obs.pod} does not answer")
    if not obs.containers_ready and not ev:
        ev.append(f"pod {obs.pod} containers are not ready (engine readiness probe failing)")
    if obs.engine_progressing is False:
        ev.append(f"engine on {obs.pod} is wedged: requests queued but no token generated")
    return ev


def _node_not_ready(node: NodeInfo) -> str:
    state = "Unknown (kubelet stopped posting status)" if node.ready is None else "NotReady"
    return f"node {node.name} is {state}"


def _still_serving_behind_a_silent_node(
    obs: PodObservation, node: NodeInfo | None, evidence: list[str]
) -> bool:
    """A partition, not a loss: the only evidence is the node's NotReady/Unknown (its kubelet silent to
    the API server) while the pod's engine answers a direct probe (a wedged engine would add its own
    evidence). Its replica still serves; derouting it on the node's condition alone would remove
    capacity that works (a top-of-rack switch cut, #30)."""
    return (
        node is not None
        and obs.engine_health is EngineHealth.OK
        and node.ready is not True
        and evidence == [_node_not_ready(node)]
    )


def confirm_group(
    group: ReplicaGroup,
    pods: Mapping[str, PodObservation],
    nodes: Mapping[str, NodeInfo] | Iterable[NodeInfo] = (),
    routed_pods: Iterable[str] = (),
    publish_not_ready: bool = False,
) -> GroupVerdict:
    """Lost or slow-but-present? A pod of the group missing from ``pods`` counts as gone."""
    node_map = nodes if isinstance(nodes, Mapping) else {n.name: n for n in nodes}
    routed = set(routed_pods)
    evidence: list[str] = []
    lost: list[str] = []
    unreachable: list[str] = []
    for pod in group.pods:
        obs = pods.get(pod, PodObservation(pod=pod, exists=False))
        node = node_map.get(obs.node) if obs.node else None
        pod_ev = _pod_loss_evidence(obs, node)
        if pod_ev and _still_serving_behind_a_silent_node(obs, node, pod_ev):
            unreachable.append(
                f"node {obs.node} unreachable from the API, still serving ({pod}'s engine answers)"
            )
            continue
        if pod_ev:
            lost.append(pod)
            evidence += pod_ev
    if lost:
        dead_routed = tuple(
            p
            for p in lost
            if p in routed
            or (
                (ep := pods[p].endpoint if p in pods else None) is not None
                and pods[p].exists
                and ep.routable(publish_not_ready)
            )
        )
        whole = ""
        if len(group.pods) > 1:
            whole = f"; {len(lost)} of {len(group.pods)} ranks lost, so the whole group is lost"
        return GroupVerdict(
            group_id=group.id,
            verdict=Verdict.LOST,
            reason=f"{evidence[0]}{whole}",
            lost_pods=tuple(lost),
            dead_but_routed=dead_routed,
            evidence=tuple(evidence),
        )
    notes = list(dict.fromkeys(unreachable))
    gated = [
        p
        for p in group.pods
        if p in pods and not pods[p].pod_ready and pods[p].containers_ready and not unreachable
    ]
    if gated:
        notes.append(f"{', '.join(gated)} held not-ready by the serving-ready gate (saturated, not dead)")
    probed = [p for p in group.pods if p in pods and pods[p].engine_health is EngineHealth.OK]
    if unreachable:
        reason = (
            f"{group.id}: {'; '.join(notes)}: a node cut off from the API server, not a replica loss "
            "(its engines keep serving through the gateway; nothing is derouted on the node's condition alone)"
        )
        return GroupVerdict(group_id=group.id, verdict=Verdict.PRESENT, reason=reason, evidence=tuple(notes))
    reason = (
        f"all {len(group.pods)} pod(s) of {group.id} exist and are Running on Ready nodes"
        + (", engine answers" if probed else "")
        + ": slow-but-present, not a replica loss"
        + (f" ({'; '.join(notes)})" if notes else "")
    )
    return GroupVerdict(group_id=group.id, verdict=Verdict.PRESENT, reason=reason, evidence=tuple(notes))


class LossSize(BaseModel):
    model_config = ConfigDict(frozen=True)

    groups_lost: int
    serving_groups: int = Field(description="Serving groups before the loss")
    fraction: float = Field(description="Lost serving groups / serving groups before the loss")
    gpus_lost: int
    nodes: tuple[str, ...]
    domains: dict[str, tuple[str, ...]] = Field(
        default_factory=dict, description="Topology label -> distinct values among the lost nodes"
    )
    summary: str


def size_loss(
    snapshot: PoolSnapshot,
    lost_group_ids: Iterable[str],
    domain_labels: tuple[str, ...] = (NVLINK_DOMAIN_LABEL, ZONE_LABEL),
) -> LossSize:
    lost = [snapshot.group(gid) for gid in dict.fromkeys(lost_group_ids)]
    serving = len(snapshot.serving)
    lost_serving = sum(1 for g in lost if g.role.value == "serving")
    nodes = tuple(sorted({n for g in lost for n in g.nodes}))
    domains: dict[str, tuple[str, ...]] = {}
    for label in domain_labels:
        values = sorted({v for n in nodes if (info := snapshot.node(n)) and (v := info.labels.get(label))})
        if values:
            domains[label] = tuple(values)
    fraction = lost_serving / serving if serving else 0.0
    gpus = sum(g.gpus for g in lost)
    dom = "; ".join(f"{k.rsplit('/', 1)[-1]} {', '.join(v)}" for k, v in domains.items())
    summary = (
        f"{len(lost)} replica group(s) lost ({lost_serving} of {serving} serving = {fraction:.0%}), "
        f"{gpus} GPU(s) on node(s) {', '.join(nodes) or '-'}" + (f"; {dom}" if dom else "")
    )
    return LossSize(
        groups_lost=len(lost),
        serving_groups=serving,
        fraction=fraction,
        gpus_lost=gpus,
        nodes=nodes,
        domains=domains,
        summary=summary,
    )


class LossEvent(BaseModel):
    """A confirmed group loss, as the incident correlates them."""

    model_config = ConfigDict(frozen=True)

    group_id: str
    revision: str
    nodes: tuple[str, ...] = ()
    at: float


class Correlation(BaseModel):
    model_config = ConfigDict(frozen=True)

    cause: IncidentCause
    reason: str
    group_ids: tuple[str, ...]
    revision: str | None = Field(default=None, description="The failing revision (bad rollout)")
    domain: str | None = Field(default=None, description="'label=value' of the lost domain")
    replace: bool = Field(
        description="False: do not rebuild capacity of the failing revision (revert instead)"
    )


def _implicated_nodes(event: LossEvent, snapshot: PoolSnapshot) -> tuple[str, ...]:
    """The nodes a lost group says something about, as evidence of a node or domain failure.

    A group on one node: its node (the loss is all that is known of it, and two such losses on two
    nodes of one NVLink domain are the domain's signature). A group spanning several nodes: only
    those of its nodes that are not Ready. One rank OOM-killed or lost takes the whole group with it,
    and a LeaderWorkerSet re-creates the group, but the nodes under its healthy ranks did not fail;
    counting them would call every multi-node group loss a failure-domain loss. (``failed_nodes`` is
    the stricter rule the fence uses, with the reports: there a single-node group's Ready node is
    not failed either, since cordoning it is an action; naming a cause is not.)
    """
    if len(event.nodes) <= 1:
        return event.nodes
    return tuple(n for n in event.nodes if (node := snapshot.node(n)) is None or node.ready is not True)


def correlate(
    events: Iterable[LossEvent],
    snapshot: PoolSnapshot,
    window_s: float,
    domain_label: str = NVLINK_DOMAIN_LABEL,
    min_domain_nodes: int = 2,
) -> Correlation:
    """Group the losses within ``window_s`` of the first one and name their common cause."""
    ordered = sorted(events, key=lambda e: (e.at, e.group_id))
    if not ordered:
        raise ValueError("correlate() needs at least one loss event")
    first = ordered[0].at
    inside = [e for e in ordered if e.at - first <= window_s]
    ids = tuple(dict.fromkeys(e.group_id for e in inside))

    # A loss of the revision being rolled out (or rolled out within the window) is a bad rollout.
    target = snapshot.target_revision
    recent_rollout = snapshot.rollout_in_progress or (
        snapshot.rollout_started_at is not None and snapshot.rollout_started_at >= first - window_s
    )
    if target and recent_rollout:
        new_rev = [e for e in inside if e.revision == target]
        if new_rev:
            return Correlation(
                cause=IncidentCause.BAD_ROLLOUT,
                reason=(
                    f"{len(new_rev)} of {len(inside)} lost group(s) run revision {target}, which is being "
                    "rolled out: bad rollout - revert, do not replace with the failing revision"
                ),
                group_ids=ids,
                revision=target,
                replace=False,
            )

    lost_nodes = sorted({n for e in inside for n in _implicated_nodes(e, snapshot)})
    by_domain: dict[str, list[str]] = defaultdict(list)
    for name in lost_nodes:
        node = snapshot.node(name)
        if node is not None and (value := node.labels.get(domain_label)):
            by_domain[value].append(name)
    for value, names in sorted(by_domain.items()):
        if len(names) >= min_domain_nodes:
            return Correlation(
                cause=IncidentCause.DOMAIN_LOSS,
                reason=(
                    f"{len(names)} lost nodes ({', '.join(names)}) share {domain_label}={value}: "
                    "failure-domain loss - place replacements outside it"
                ),
                group_ids=ids,
                domain=f"{domain_label}={value}",
                replace=True,
            )
    # Every pool node of a zone lost (and more than one): the zone went.
    pool_nodes = {n for g in snapshot.groups for n in g.nodes}
    zones: dict[str, set[str]] = defaultdict(set)
    for name in pool_nodes:
        node = snapshot.node(name)
        if node is not None and node.zone:
            zones[node.zone].add(name)
    for zone, members in sorted(zones.items()):
        if len(members) >= min_domain_nodes and members <= set(lost_nodes):
            return Correlation(
                cause=IncidentCause.DOMAIN_LOSS,
                reason=f"every pool node of zone {zone} ({', '.join(sorted(members))}) is lost: zone loss",
                group_ids=ids,
                domain=f"{ZONE_LABEL}={zone}",
                replace=True,
            )
    if len(ids) > 1:
        span = inside[-1].at - first
        return Correlation(
            cause=IncidentCause.CORRELATED_LOSS,
            reason=(
                f"{len(ids)} groups lost within {span:.0f} s (window {window_s:.0f} s): one incident with a "
                "common cause (rollout, node-pool operation, image pull, disk, fabric) - handled together"
            ),
            group_ids=ids,
            replace=True,
        )
    return Correlation(
        cause=IncidentCause.SINGLE_LOSS,
        reason=f"single loss of {ids[0]}",
        group_ids=ids,
        replace=True,
    )


def match_reports(
    snapshot: PoolSnapshot, reports: Iterable[LossReport], *, by_pod_name: bool = True
) -> dict[str, ReplicaGroup]:
    """The replica groups the reports are about: a named group, a pod's group, every group on a node.

    A pod report that names its node makes the node's other groups candidates too: each is
    confirmed on its own evidence (a dead node's other engines are lost; a healthy spare beside a
    crashed pod is "slow-but-present"), so a node going down is handled as one incident even when
    the first alert is about one of its pods.

    A reported pod that is gone while the rest of its LeaderWorkerSet group is still there (the
    LeaderWorkerSet deleted the group to re-create it, and a worker is still terminating) is
    matched to that group by the LeaderWorkerSet's pod naming (``by_pod_name``).
    """
    lws_names = {
        g.workload_name for g in snapshot.groups if g.workload_kind is WorkloadKind.LEADER_WORKER_SET
    }
    candidates: dict[str, ReplicaGroup] = {}
    for r in reports:
        if r.replica_group:
            try:
                g = snapshot.group(r.replica_group)
                candidates[g.id] = g
            except KeyError:
                pass
        if r.pod and (g2 := snapshot.group_of_pod(r.pod)) is not None:
            candidates[g2.id] = g2
        elif r.pod and by_pod_name and (gid := lws_group_of_pod(r.pod, lws_names)) is not None:
            try:
                g4 = snapshot.group(gid)
                candidates[g4.id] = g4
            except KeyError:
                pass
        if r.node:
            for g3 in snapshot.groups_on_node(r.node):
                candidates[g3.id] = g3
    return candidates


def lws_group_of_pod(pod: str, leader_worker_sets: Iterable[str]) -> str | None:
    """The group a LeaderWorkerSet pod belongs to, by the LeaderWorkerSet's pod naming: the leader is
    ``<name>-<groupIndex>`` (it names the group), a worker ``<name>-<groupIndex>-<workerIndex>``.

    For a pod that no longer exists (an alert names the pod its LeaderWorkerSet just deleted to
    re-create the group) the name is all there is to go on. None when the name fits no
    LeaderWorkerSet named in ``leader_worker_sets``.
    """
    names = set(leader_worker_sets)
    for candidate in (pod, pod.rpartition("-")[0]):
        name, _, index = candidate.rpartition("-")
        if index.isdigit() and name in names:
            return candidate
    return None


def groups_being_recreated(
    snapshot: PoolSnapshot,
    workloads: Iterable[WorkloadSelector],
    reports: Iterable[LossReport],
    *,
    by_pod_name: bool = True,
) -> list[ReplicaGroup]:
    """Reported LeaderWorkerSet groups that are not in the pool because their controller is
    re-creating them: the LeaderWorkerSet still wants the group (its index is below
    ``spec.replicas``) and none of its pods exists. Such a group serves nothing until its new pods
    are ready, so it is lost now, without waiting for the new pods to show up.

    The group is described from a sibling of the same LeaderWorkerSet (one template: model,
    revision, pods per group, GPUs per pod); with no sibling to copy, nothing is assumed.
    """
    wanted = {w.name: w.replicas for w in workloads if w.kind == "LeaderWorkerSet" and w.replicas is not None}
    present = {g.id for g in snapshot.groups}
    out: dict[str, ReplicaGroup] = {}
    for r in reports:
        gid = r.replica_group or (lws_group_of_pod(r.pod, wanted) if r.pod and by_pod_name else None)
        if not gid or gid in present or gid in out:
            continue
        name, _, index = gid.rpartition("-")
        if not index.isdigit() or name not in wanted or int(index) >= (wanted[name] or 0):
            continue
        sibling = next(
            (
                g
                for g in snapshot.groups
                if g.workload_kind is WorkloadKind.LEADER_WORKER_SET
                and g.workload_name == name
                and g.role is GroupRole.SERVING
            ),
            None,
        )
        if sibling is None:
            continue
        pods = (gid, *(f"{gid}-{w}" for w in range(1, len(sibling.pods))))
        out[gid] = sibling.model_copy(
            update={
                "id": gid,
                "pods": pods,
                "leader_pod": gid,
                "nodes": (),
                "ready": False,
                "engine_up": False,
                "routed": False,
            }
        )
    return list(out.values())


# A fault hint that names the hardware: the node it ran on is suspect even while it reports Ready.
HARDWARE_HINTS = ("xid", "nvlink", "thermal", "ecc")


def silent_nodes(lost: Iterable[ReplicaGroup], pods: Mapping[str, PodObservation]) -> dict[str, str]:
    """Nodes of the lost groups that went silent while the API still calls them Ready (node -> why).

    A dead machine stops its kubelet too: for the node-monitor grace (50 s by default) the API
    still shows its pods Running and ready, while their engines stop answering. A crashed
    container on a live node is the opposite: its kubelet reports the death within about a second
    (its pod-lifecycle relist runs every second), as a termination, a waiting reason or a restart.
    So a node is silent when every probed engine on it does not answer and Kubernetes shows no
    death of any lost pod on it. Only meaningful on an observation taken after the kubelet had
    time to report (``RecoveryTimings.kubelet_report_s`` after the loss was confirmed).
    """
    on_node: dict[str, list[PodObservation]] = defaultdict(list)
    for g in lost:
        for pod in g.pods:
            o = pods.get(pod)
            if o is not None and o.node:
                on_node[o.node].append(o)
    every: dict[str, list[PodObservation]] = defaultdict(list)
    for o in pods.values():
        if o.node in on_node:
            every[o.node].append(o)
    silent: dict[str, str] = {}
    for node, mine in sorted(on_node.items()):
        probed = [o for o in every[node] if o.engine_health is not EngineHealth.UNKNOWN]
        unanswered = [o.pod for o in probed if o.engine_health is EngineHealth.UNREACHABLE]
        reported = any(
            not o.exists
            or o.deleting
            or o.phase != "Running"
            or not o.containers_ready
            or o.waiting_reason
            or o.terminated_reason
            for o in mine
        )
        if unanswered and len(unanswered) == len(probed) and not reported:
            silent[node] = (
                f"its engines do not answer ({', '.join(unanswered)}) while Kubernetes still shows "
                "them Running and ready: the machine went silent, not a container"
            )
    return silent


def failed_nodes(
    lost: Iterable[ReplicaGroup],
    snapshot: PoolSnapshot,
    reports: Iterable[LossReport],
    silent: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The nodes of the lost groups that failed themselves, with why (node -> reason).

    A node failed when it is gone or not Ready, when a report is about the node itself
    (``LossReport.points_at_node``), when a report's fault hint names the hardware, or when it went
    silent (``silent``: ``silent_nodes`` of a late enough observation). A pod-level fault (an
    OOM-killed engine, a crashed container) on a Ready node fails no node: the node is not
    cordoned or triaged, and a warm spare on it may still be promoted.
    """
    lost = list(lost)
    reports = list(reports)
    hardware = next(
        (r.fault_hint for r in reports if r.fault_hint and any(k in r.fault_hint for k in HARDWARE_HINTS)),
        None,
    )
    failed: dict[str, str] = {}
    for node in sorted({n for g in lost for n in g.nodes}):
        info = snapshot.node(node)
        if info is None:
            failed[node] = "gone from the API"
        elif info.ready is not True:
            failed[node] = f"Ready={info.ready}"
        elif hardware is not None:
            failed[node] = f"the fault hint names the hardware ({hardware})"
        elif any(r.points_at_node(node) for r in reports):
            failed[node] = "a report is about the node itself"
        elif silent and node in silent:
            failed[node] = silent[node]
    return failed
