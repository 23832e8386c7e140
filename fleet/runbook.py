"""Decisions the replica-loss runbook takes between its looks, as pure functions.

Each takes what a step observed and returns what to do; the workflow only observes and acts
(``workflows/replica_loss.py``). No I/O, no clock: safe inside workflows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from fleet.incident import LossReport
from fleet.leadtime import LeadTimeEstimate
from fleet.loss import GroupVerdict
from fleet.observation import PoolObservation
from fleet.placement import GroupShape, PlacementResult, place_group
from fleet.pool import NodeInfo, PoolSnapshot, ReplicaGroup
from fleet.recovery import VerificationReport
from fleet.triage import PodFault

# A Pending replacement is judged unplaceable only after this many looks (the scheduler needs a moment).
PLACEMENT_LOOKS = 3
# The scheduler has not looked at the pod yet: nothing to judge.
NOT_YET_SCHEDULED = "Pending (no scheduling event"


def pods_to_deroute(
    lost: Iterable[ReplicaGroup], verdicts: Iterable[GroupVerdict], routed_pods: Iterable[str]
) -> list[str]:
    """Step 2: every routed pod of a lost group (one lost rank takes the whole group), and every
    lost pod the router can still reach (dead but routed), sorted."""
    groups = list(lost)
    lost_ids = {g.id for g in groups}
    routed = set(routed_pods)
    dead_routed = {p for v in verdicts if v.group_id in lost_ids for p in v.dead_but_routed}
    return sorted({p for g in groups for p in g.pods if p in routed} | dead_routed)


class Unplaceable(BaseModel):
    """A replacement the scheduler has had time for, with no admissible allocation of its whole shape."""

    model_config = ConfigDict(frozen=True)

    pod: str
    message: str  # the scheduler's own words
    result: PlacementResult


class PendingJudgement(BaseModel):
    """One look at the Pending replacements: the looks counted so far and what newly cannot land."""

    looks: dict[str, int] = Field(default_factory=dict)
    unplaceable: list[Unplaceable] = Field(default_factory=list)
    stuck: bool = Field(
        False, description="Every Pending replacement is reported unplaceable: ask an operator"
    )


def judge_pending(
    pending: Mapping[str, str],
    looks: Mapping[str, int],
    reported: Iterable[str],
    snapshot: PoolSnapshot,
    excluded_nodes: Iterable[str],
) -> PendingJudgement:
    """Step 7: a replacement Pending for ``PLACEMENT_LOOKS`` looks is judged by the whole-shape placement
    check; one with an admissible allocation is given time, one without is reported (once). A pod the
    scheduler has not looked at yet is not judged."""
    counted = dict(looks)
    told = set(reported)
    excluded = set(excluded_nodes)
    found: list[Unplaceable] = []
    for pod, message in pending.items():
        counted[pod] = counted.get(pod, 0) + 1
        if pod in told or counted[pod] < PLACEMENT_LOOKS or message.startswith(NOT_YET_SCHEDULED):
            continue
        group = snapshot.group_of_pod(pod)
        shape = GroupShape(
            pods=len(group.pods) if group else 1, gpus_per_pod=max(1, group.gpus_per_pod if group else 1)
        )
        result = place_group(shape, snapshot.nodes, exclude=excluded)
        if result.admissible:
            continue  # the scheduler has somewhere to put it: give it time
        found.append(Unplaceable(pod=pod, message=message, result=result))
    told |= {u.pod for u in found}
    stuck = bool(told) and all(p in told for p in pending)
    return PendingJudgement(looks=counted, unplaceable=found, stuck=stuck)


def pod_faults(pod_reasons: Mapping[str, str]) -> list[PodFault]:
    """Step 8: a node's pods' status reasons, sorted into the fields triage reads (terminated,
    waiting, pod status)."""
    return [
        PodFault(
            pod=p,
            terminated_reason=r if r in ("OOMKilled", "Error") else None,
            waiting_reason=r if r.endswith("BackOff") else None,
            status_reason=r if r in ("NodeLost", "Evicted") else None,
        )
        for p, r in pod_reasons.items()
    ]


class TriageScope(BaseModel):
    """Step 8: the nodes whose hardware is triaged, and the lost groups' nodes kept in service."""

    model_config = ConfigDict(frozen=True)

    triage: tuple[str, ...] = ()
    kept: tuple[str, ...] = Field(
        default=(), description="Ready, and no report about them: a pod-level fault"
    )


def nodes_to_triage(lost: Sequence[ReplicaGroup], failed: Iterable[str], hint: str | None) -> TriageScope:
    """A lost group's node is triaged when it failed itself (the fence's verdict) or a report carries a
    fault hint; a Ready node no report is about only hosted a crashed pod and stays in service."""
    failed_set = set(failed)
    nodes = sorted({n for g in lost for n in g.nodes})
    triage = tuple(n for n in nodes if n in failed_set or hint)
    return TriageScope(triage=triage, kept=tuple(n for n in nodes if n not in triage))


def with_lost(obs: PoolObservation, lost: Sequence[ReplicaGroup]) -> PoolObservation:
    """The observation with the lost groups as confirmed (a deleted pod no longer shows up)."""
    present = {g.id for g in obs.snapshot.groups}
    missing = tuple(g for g in lost if g.id not in present)
    if not missing:
        return obs
    return obs.model_copy(
        update={"snapshot": obs.snapshot.model_copy(update={"groups": obs.snapshot.groups + missing})}
    )


def room_for(group: ReplicaGroup, nodes: Iterable[NodeInfo], lost: Iterable[ReplicaGroup]) -> bool:
    """Step 6: could the group's whole shape land on a node the lost groups did not run on (no new node)?"""
    shape = GroupShape(pods=len(group.pods), gpus_per_pod=max(1, group.gpus_per_pod))
    return place_group(shape, nodes, exclude={n for g in lost for n in g.nodes}).admissible


def fast_path_evidence(report: LossReport) -> str:
    """Step 1's record of the evidence the fast path opened the incident on."""
    entity = report.replica_group or report.pod or report.node
    evidence = report.labels.get("fleetmend_evidence", "no evidence given")
    return f"reported by the fast path ({report.alert_name}, {entity}): {evidence}"


def reports_text(reports: Iterable[LossReport]) -> str:
    return "; ".join(f"{r.alert_name} node={r.node} pod={r.pod} group={r.replica_group}" for r in reports)


def lead_time_notice(pool_key: str, unmatched: Iterable[ReplicaGroup], estimate: LeadTimeEstimate) -> str:
    """Step 6's post to the incident channel when no warm spare replaced a lost group."""
    return (
        f"[fleetmend] {pool_key}: no warm spare for {', '.join(g.id for g in unmatched)}. "
        f"{estimate.text}. Shedding stays on until capacity returns."
    )


def failing_checks(
    report: VerificationReport,
    each: str = "{name} (observed {observed}, expected {expected})",
    sep: str = "; ",
) -> str:
    """Step 10: the failing checks of a verification, each formatted with ``each``."""
    return sep.join(
        each.format(name=c.name, observed=c.observed, expected=c.expected)
        for c in report.checks
        if not c.passed
    )


def bad_rollout_notice(pool_key: str, groups: int, revision: str | None) -> str:
    """Losses during a new revision's rollout: the revert path, never a replacement of that revision."""
    return (
        f"[fleetmend] {pool_key}: {groups} replica group(s) of revision {revision} failed during "
        "its rollout. The failing groups are derouted; no replacement of that revision will be created. "
        "Revert the rollout (e.g. `kubectl rollout undo`) — fleetmend does not roll back on its own."
    )
