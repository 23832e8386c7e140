"""The capacity-aware guard run before every destructive step (DESIGN.md §6a).

Peers gate remediation on a *count* of unhealthy nodes; fleetmend asks the
question that matters to the people being served: **after this step, can the
remaining serving capacity still carry the demand?** ``check_capacity`` takes
each serving group's current contribution (tokens/s and requests/s it serves
when warm; a dead group contributes 0), the groups the step would take out of
service, and the current demand, and answers *allow* or *refuse, because ...*.
A refusal is not an error: the workflow stops and asks an operator (an Update),
quoting the reason.

The guard is always on - there is no "off unless configured": with no explicit
floor it still refuses to take the pool to zero serving groups or below demand.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field

from fleet.observation import PoolObservation


class GroupCapacity(BaseModel):
    model_config = ConfigDict(frozen=True)

    tokens_per_s: float = Field(ge=0)
    requests_per_s: float = Field(default=0.0, ge=0)
    ready: bool = Field(
        default=False,
        description="Ready now although it generated nothing in the window (idle, not dead): it counts "
        "toward the group floor",
    )


class Demand(BaseModel):
    model_config = ConfigDict(frozen=True)

    tokens_per_s: float = Field(ge=0)
    requests_per_s: float = Field(default=0.0, ge=0)


class GuardDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    allowed: bool
    action: str
    remaining_groups: int
    min_groups: int
    remaining_tokens_per_s: float
    required_tokens_per_s: float
    remaining_requests_per_s: float
    required_requests_per_s: float
    reason: str


def check_capacity(
    action: str,
    capacity: Mapping[str, GroupCapacity],
    removing: Iterable[str],
    demand: Demand,
    min_groups: int = 1,
    headroom: float = 1.1,
) -> GuardDecision:
    """Would the serving groups left after ``action`` (removing ``removing``) still carry ``demand x headroom``?

    ``capacity`` lists every serving group with what it contributes now; groups
    already lost contribute zero and do not count as remaining replicas.
    """
    if min_groups < 0 or headroom < 1.0:
        raise ValueError(f"min_groups must be >= 0 and headroom >= 1.0, got {min_groups}, {headroom}")
    gone = set(removing)
    unknown = gone - set(capacity)
    if unknown:
        raise ValueError(f"{action}: groups {sorted(unknown)} are not in the capacity map")
    remaining = {g: c for g, c in capacity.items() if g not in gone and (c.tokens_per_s > 0 or c.ready)}
    tokens = sum(c.tokens_per_s for c in remaining.values())
    requests = sum(c.requests_per_s for c in remaining.values())
    need_tokens = demand.tokens_per_s * headroom
    need_requests = demand.requests_per_s * headroom
    floor = max(min_groups, 1)
    problems = []
    if len(remaining) < floor:
        problems.append(f"{len(remaining)} serving group(s) would remain, the floor is {floor}")
    if tokens < need_tokens:
        problems.append(
            f"remaining {tokens:,.0f} tokens/s < demand {demand.tokens_per_s:,.0f} x {headroom:g} = {need_tokens:,.0f}"
        )
    if demand.requests_per_s > 0 and requests < need_requests:
        problems.append(
            f"remaining {requests:,.1f} req/s < demand {demand.requests_per_s:,.1f} x {headroom:g} = {need_requests:,.1f}"
        )
    if problems:
        reason = (
            f"refuse {action}: " + "; ".join(problems) + " - an operator must approve or add capacity first"
        )
    else:
        reason = (
            f"allow {action}: {len(remaining)} serving group(s) remain (floor {floor}) with {tokens:,.0f} tokens/s "
            f"for a demand of {demand.tokens_per_s:,.0f} tokens/s x {headroom:g}"
        )
    return GuardDecision(
        allowed=not problems,
        action=action,
        remaining_groups=len(remaining),
        min_groups=floor,
        remaining_tokens_per_s=tokens,
        required_tokens_per_s=need_tokens,
        remaining_requests_per_s=requests,
        required_requests_per_s=need_requests,
        reason=reason,
    )


# ---------------------------------------------------------------- the guard from two observations


def measured_token_rates(before: PoolObservation, after: PoolObservation) -> dict[str, float]:
    """Tokens/s each serving group generated between two observations (0 for a group not ready now)."""
    seconds = max(1e-3, after.snapshot.observed_at - before.snapshot.observed_at)
    rates: dict[str, float] = {}
    for g in after.snapshot.serving:
        now, then = after.engines.get(g.id), before.engines.get(g.id)
        rates[g.id] = (
            max(0.0, now.generation_tokens_total - then.generation_tokens_total) / seconds
            if now is not None and then is not None and g.ready
            else 0.0
        )
    return rates


def recovery_guard(
    action: str, before: PoolObservation, after: PoolObservation, removing: Iterable[str], min_groups: int
) -> GuardDecision:
    """Before a destructive recovery step: each group counts for what it serves now, the demand is
    what the pool serves now (no headroom: the loss already took some)."""
    rates = measured_token_rates(before, after)
    # A group whose engine did not answer either look serves what it serves unmeasured. It is neither
    # dead nor idle: it counts for the group floor, and the mean rate of the groups read (1 token/s when
    # none served) is added both to what it carries and to the demand - neutral while it stays, its load
    # carried by the others when it is the one removed.
    unread = {
        g: after.unread_engines.get(g) or before.unread_engines[g]
        for g in rates
        if g in after.unread_engines or g in before.unread_engines
    }
    measured = [r for g, r in rates.items() if g not in unread and r > 0]
    estimate = sum(measured) / len(measured) if measured else 1.0
    rates.update({g: estimate for g in unread})
    # A group ready now that generated nothing in the window is idle, not dead (a quiet pool, or a
    # short window on a busy machine): it counts toward the group floor, and carries nothing measured.
    ready_now = {g.id for g in after.snapshot.serving if g.ready}
    capacity = {gid: GroupCapacity(tokens_per_s=r, ready=gid in ready_now) for gid, r in rates.items()}
    gone = [g for g in removing if g in capacity]
    demand = Demand(tokens_per_s=sum(rates.values()))
    decision = check_capacity(action, capacity, gone, demand, min_groups=min_groups, headroom=1.0)
    if not unread:
        return decision
    named = "; ".join(f"{g} ({why})" for g, why in sorted(unread.items()))
    note = (
        f"; not read: {named} - each counted in the group floor at the {estimate:,.0f} tokens/s mean of "
        "those read, in what it carries and in the demand alike"
    )
    return decision.model_copy(update={"reason": decision.reason + note})


def scale_down_guard(
    before: PoolObservation,
    after: PoolObservation,
    removing: Iterable[str],
    *,
    min_groups: int,
    headroom: float,
    group_capacity_tokens_per_s: float | None,
) -> tuple[GuardDecision, float]:
    """Can the groups left after a scale-down carry today's demand x headroom? Returns (decision, demand).

    What a remaining group can carry: the operator's load-test figure, else the busiest
    group's rate now (a conservative lower bound). An idle pool counts every group as able.
    """
    measured = measured_token_rates(before, after)
    demand = sum(measured.values())
    per_group = group_capacity_tokens_per_s or max(measured.values(), default=0.0)
    if demand == 0:
        capacity = {gid: GroupCapacity(tokens_per_s=per_group or 1.0) for gid in measured}
    else:
        capacity = {
            gid: GroupCapacity(tokens_per_s=per_group if rate > 0 else 0.0) for gid, rate in measured.items()
        }
    gone = [g for g in removing if g in capacity]
    decision = check_capacity(
        f"scale-down removing {', '.join(gone)}",
        capacity,
        gone,
        Demand(tokens_per_s=demand),
        min_groups=min_groups,
        headroom=headroom,
    )
    return decision, demand
