"""Step 6 of the replica-loss runbook as a plan: rebuild the warm floor with absolute replica counts.

A Deployment's lost pods still count as replicas until they are deleted, so the
serving workload first *retires* them (pod-deletion-cost -1000 makes them the ones
the ReplicaSet removes), then grows back by the groups no spare covered. The
promoted spares carry the other slots; the spare workload grows by as many to
restore the warm floor. A warm spare lost with its node is retired and refilled in its own
workload the same way (otherwise its pod holds the slot until Kubernetes' taint eviction,
300 s by default, and the warm floor waits). A LeaderWorkerSet recreates a lost group by itself
(RecreateGroupOnPodRestart), so it gets no scale. Every count is absolute: a
retried scale cannot compound.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from fleet.observation import PodObservation
from fleet.pool import GroupRole, NodeInfo, ReplicaGroup, WorkloadKind


class ScaleStep(BaseModel):
    model_config = ConfigDict(frozen=True)

    step: str = Field(description="Ledger step name: retire-lost / replace-lost / rebuild-warm-floor")
    kind: str
    name: str
    replicas: int = Field(ge=0)
    summary: str


class WorkloadRebuild(BaseModel):
    """One workload's part: mark these pods to go first, then these scales, in order."""

    model_config = ConfigDict(frozen=True)

    retire_pods: tuple[str, ...] = ()
    scales: tuple[ScaleStep, ...] = ()


class RebuildPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    workloads: tuple[WorkloadRebuild, ...] = ()
    unmatched: tuple[str, ...] = Field(default=(), description="Lost serving groups no spare covered")
    expected_new: int = Field(
        0, ge=0, description="Replicas the ramp should see join (spares + replacements)"
    )


def plan_rebuild(
    lost: Sequence[ReplicaGroup],
    promoted: Sequence[ReplicaGroup],
    unmatched_ids: Iterable[str],
    replicas: Mapping[tuple[str, str], int],
    present_pods: Iterable[str] | None = None,
    pool_groups: Sequence[ReplicaGroup] = (),
    *,
    refill_lost_spares: bool = True,
) -> RebuildPlan:
    """The marks and absolute scales that replace what the loss took and the promotion used.

    ``replicas`` is each workload's current ``spec.replicas`` keyed by (kind, name);
    ``present_pods`` the pods that still exist (a force-deleted pod needs no mark: its
    ReplicaSet already replaced it, and the scale still takes that slot back; None = all);
    ``pool_groups`` the pool's groups before the loss, which say which workloads hold the
    warm spares. A spare promoted in an earlier incident keeps serving from the spare
    workload: when it is lost, its replacement grows the *serving* workload (a new pod of
    the spare workload would be an unrouted spare, not serving capacity). A lost spare that was
    still a spare (``refill_lost_spares``) is retired and refilled in its own workload.
    """
    present = None if present_pods is None else set(present_pods)
    unmatched_set = set(unmatched_ids)

    def key(g: ReplicaGroup) -> tuple[str, str]:
        return (g.workload_kind.value, g.workload_name)

    spare_workloads = {key(g) for g in pool_groups if g.role is GroupRole.SPARE} | {key(g) for g in promoted}

    def serving_home(g: ReplicaGroup) -> tuple[str, str]:
        if key(g) not in spare_workloads:
            return key(g)
        homes = Counter(
            key(x)
            for x in pool_groups
            if x.role is GroupRole.SERVING
            and key(x) not in spare_workloads
            and x.workload_kind is WorkloadKind.DEPLOYMENT
            and x.model == g.model
        )
        return homes.most_common(1)[0][0] if homes else key(g)

    lost_serving = [
        g for g in lost if g.role is GroupRole.SERVING and g.workload_kind is WorkloadKind.DEPLOYMENT
    ]
    unmatched = [g for g in lost if g.role is GroupRole.SERVING and g.id in unmatched_set]
    lost_spares = [
        g
        for g in lost
        if refill_lost_spares and g.role is GroupRole.SPARE and g.workload_kind is WorkloadKind.DEPLOYMENT
    ]
    retiring: dict[tuple[str, str], list[ReplicaGroup]] = {}
    for g in [*lost_serving, *lost_spares]:
        retiring.setdefault(key(g), []).append(g)
    regrow = Counter(serving_home(g) for g in unmatched if g.workload_kind is WorkloadKind.DEPLOYMENT)
    refill = Counter(key(g) for g in [*promoted, *lost_spares])
    order = list(dict.fromkeys([*retiring, *regrow, *refill]))
    workloads: list[WorkloadRebuild] = []
    for kind, name in order:
        current = replicas.get((kind, name), 0)
        gone = retiring.get((kind, name), [])
        retired = max(0, current - len(gone))
        grow, spares = regrow.get((kind, name), 0), refill.get((kind, name), 0)
        target = retired + grow + spares
        scales: list[ScaleStep] = []
        if gone:
            scales.append(
                ScaleStep(
                    step=f"retire-lost-{name}",
                    kind=kind,
                    name=name,
                    replicas=retired,
                    summary=f"{kind} {name} → {retired}: lost pods leave",
                )
            )
        if target != (retired if gone else current):
            why = " + ".join(w for w, n in (("replacements", grow), ("new warm spare", spares)) if n)
            step = (
                "replace-lost"
                if grow and not spares
                else "rebuild-warm-floor"
                if spares and not grow
                else "rebuild"
            )
            scales.append(
                ScaleStep(
                    step=f"{step}-{name}",
                    kind=kind,
                    name=name,
                    replicas=target,
                    summary=f"{kind} {name} → {target}: {why}",
                )
            )
        marks = tuple(p for g in gone for p in g.pods if present is None or p in present)
        workloads.append(WorkloadRebuild(retire_pods=marks, scales=tuple(scales)))
    return RebuildPlan(
        workloads=tuple(workloads),
        unmatched=tuple(g.id for g in unmatched),
        expected_new=len(promoted) + len(unmatched),
    )


def pods_held_by_lost_nodes(
    lost: Sequence[ReplicaGroup], pods_on: Mapping[str, str], nodes: Iterable[NodeInfo]
) -> list[str]:
    """Pods of lost LeaderWorkerSet groups that sit on a node that is not Ready.

    A LeaderWorkerSet recreates a group only once its pods are gone, and its pod names are
    stable, so a pod on an unreachable node (which no kubelet will ever confirm deleted)
    holds the whole group back until Kubernetes' taint eviction removes it -
    ``tolerationSeconds``, 300 s by default. Removing them sooner is a force delete, which
    needs an operator's approval (DESIGN.md §3 step 2).
    """
    not_ready = {n.name for n in nodes if n.ready is not True}
    return sorted(
        p
        for g in lost
        if g.workload_kind is WorkloadKind.LEADER_WORKER_SET
        for p in g.pods
        if pods_on.get(p) in not_ready
    )


def awaiting_recreation(
    lost: Sequence[ReplicaGroup], uids_before: Mapping[str, str], uids_now: Mapping[str, str]
) -> list[str]:
    """Lost LeaderWorkerSet groups not recreated yet: some pod still is the same object as before the loss."""
    return [
        g.id
        for g in lost
        if g.workload_kind is WorkloadKind.LEADER_WORKER_SET
        and any(p in uids_now and uids_now[p] == uids_before.get(p) for p in g.pods)
    ]


def uids_at_loss(
    lost: Sequence[ReplicaGroup], first_look: Mapping[str, str], confirmed: Mapping[str, str]
) -> dict[str, str]:
    """The pods' uids to tell a re-created pod by: the lost groups' pods as the procedure first saw them.

    Confirmation may look again for a while, and a LeaderWorkerSet re-creates a group under the same
    pod names meanwhile (an OOM-killed leader restarts its whole group). Judged against the confirmed
    look, the re-created pods would be "the same objects as at the loss": placement would wait for a
    re-creation that already happened, and the ramp would find no new replica. A lost group's pod
    that the first look did not see at all was already being re-created, so it has no uid at the loss.
    Every other pod keeps its confirmed uid.
    """
    lost_pods = {p for g in lost for p in g.pods}
    out = {p: uid for p, uid in confirmed.items() if p not in lost_pods}
    out.update({p: first_look[p] for p in lost_pods if p in first_look})
    return out


def still_counted(retire_pods: Iterable[str], pods: Mapping[str, PodObservation]) -> list[str]:
    """Lost pods a scale-down should have retired that their controller still counts: present and not
    being deleted.

    The rebuild scales a workload down by its lost pods (marked to go first), then up by the
    replacements. A controller that sees only the second of two quick updates (its informer
    coalesces them, as Kubernetes' ReplicaSet controller may) removes one pod where two were
    lost, and keeps counting the other - on a dead node - as a replica, so no replacement is
    created for it. The scale-up waits until this list is empty.
    """
    return sorted(p for p in retire_pods if p in pods and not pods[p].deleting)
