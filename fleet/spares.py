"""Step 5 of the replica-loss procedure: promote warm capacity before scaling anything.

A **warm spare** is a replica group with role ``spare`` that is loaded, Ready,
registered - and serves the same model **and the same revision** as the group
it replaces. Another revision is never a substitute: promoting it would turn a
capacity incident into a silent rollout (or rollback).

``pick_spares(snapshot, lost_group_ids)`` matches each lost serving group to at most one
spare and says, for every spare it did not take, why. A spare that is itself among the
lost groups (its engine stopped answering with the serving ones, often before its node
turns NotReady) and spares on nodes that are lost, NotReady, cordoned or quarantined are
not warm capacity. Among eligible
spares it prefers one outside the lost group's failure domain (a correlated
fault may take the neighbour next), then the lowest id (deterministic).
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from fleet.pool import GroupRole, PoolSnapshot, ReplicaGroup
from fleet.vocabulary import NVLINK_DOMAIN_LABEL


class SparePick(BaseModel):
    model_config = ConfigDict(frozen=True)

    promotions: dict[str, str] = Field(default_factory=dict, description="lost group id -> spare group id")
    unmatched: tuple[str, ...] = Field(
        default=(), description="Lost groups with no warm spare of their revision"
    )
    rejected: dict[str, str] = Field(
        default_factory=dict,
        description="spare id -> why it is not warm capacity (and, when a loss went unmatched, why it did not fit)",
    )
    reason: str


def _spare_problem(spare: ReplicaGroup, snapshot: PoolSnapshot, excluded: set[str]) -> str | None:
    if spare.role is not GroupRole.SPARE:
        return "not a spare"
    if not spare.ready:
        return "not Ready (not warm)"
    for name in spare.nodes:
        if name in excluded:
            return f"runs on failed node {name}"
        node = snapshot.node(name)
        if node is None:
            continue
        if node.ready is not True:
            return f"node {name} is not Ready"
        if node.quarantined:
            return f"node {name} is quarantined"
        if node.unschedulable:
            return f"node {name} is cordoned"
    return None


def _domains(group: ReplicaGroup, snapshot: PoolSnapshot, label: str) -> set[str]:
    return {d for n in group.nodes if (node := snapshot.node(n)) and (d := node.labels.get(label))}


def pick_spares(
    snapshot: PoolSnapshot,
    lost_group_ids: Iterable[str],
    excluded_nodes: Iterable[str] | None = None,
    domain_label: str = NVLINK_DOMAIN_LABEL,
    lost_spares: Iterable[str] = (),
) -> SparePick:
    """``lost_group_ids``: the lost serving groups to match (a promoted spare that was serving is one,
    whatever its role label). ``lost_spares``: spares lost with them (never promoted).
    ``excluded_nodes``: nodes whose spares are not warm capacity (the nodes that failed,
    ``fleet.loss.failed_nodes``); None = every node of the lost groups, for a caller that does not
    know which of them failed."""
    lost = [snapshot.group(gid) for gid in dict.fromkeys(lost_group_ids)]
    excluded = set(excluded_nodes) if excluded_nodes is not None else {n for g in lost for n in g.nodes}
    lost_ids = {g.id for g in lost}
    gone = set(lost_spares)
    rejected: dict[str, str] = {}
    eligible: list[ReplicaGroup] = []
    for spare in snapshot.spares:
        if spare.id in lost_ids:
            continue
        if spare.id in gone:
            rejected[spare.id] = "lost itself (its engine stopped answering with the loss)"
            continue
        problem = _spare_problem(spare, snapshot, excluded)
        if problem:
            rejected[spare.id] = problem
        else:
            eligible.append(spare)

    promotions: dict[str, str] = {}
    unmatched: list[str] = []
    taken: set[str] = set()
    for group in lost:
        lost_domains = _domains(group, snapshot, domain_label)
        candidates = [
            s
            for s in eligible
            if s.id not in taken and s.model == group.model and s.revision == group.revision
        ]
        if not candidates:
            unmatched.append(group.id)
            continue
        best = min(candidates, key=lambda s: (bool(_domains(s, snapshot, domain_label) & lost_domains), s.id))
        promotions[group.id] = best.id
        taken.add(best.id)
    if unmatched:
        # Say why the spares that exist could not stand in (e.g. another revision): that is the question
        # an operator asks when a loss finds "no warm spare".
        wanted = {(g.model, g.revision) for g in lost}
        for spare in eligible:
            if spare.id not in taken and (spare.model, spare.revision) not in wanted:
                rejected[spare.id] = (
                    f"serves {spare.model}@{spare.revision}, not a lost group's model and revision"
                )
    parts = [f"promote {s} for {g}" for g, s in promotions.items()]
    if unmatched:
        parts.append(
            "no warm spare of the same model and revision for "
            + ", ".join(f"{g} ({snapshot.group(g).model}@{snapshot.group(g).revision})" for g in unmatched)
        )
    return SparePick(
        promotions=promotions,
        unmatched=tuple(unmatched),
        rejected=rejected,
        reason="; ".join(parts) or "nothing lost",
    )
