"""Step 3 of the replica-loss procedure: protect the survivors by tightening admission.

The pool lost service rate but keeps its arrival rate. ``decide_shedding``
compares what the survivors can carry with what arrives and refuses **exactly
the gap**: ``(arrivals - usable capacity) / arrivals`` of the arrivals, taken
from the lowest tiers first (``fleet.vocabulary.SHED_ORDER``; critical traffic
is never shed) and partially within a tier (``Admission.partial_shed``), so a
32 % gap refuses 32 % of arrivals rather than every request of the tiers it
touches. The arithmetic is written out in ``ShedDecision.reason`` so the
incident record says *why* each share was refused.

**Queues absorb a gap first.** A gap shorter than the requests' patience needs no refusal:
the survivors' queues hold the excess and serve it once capacity returns (a spare promoted in
seconds, a group its controller re-creates). ``QueueRoom`` says how many more requests the
survivors' queues can take before a queued request would wait longer than the wait budget
(``usable capacity x budget - backlog``); spread over the time until the admission is next
recomputed, that room is an arrival rate the queues absorb, and only the rest of the gap is
refused. Recomputed as the backlog grows, the refused share rises to the gap exactly when the
queues are full, so nothing is refused that the fleet could serve within the budget, and
nothing queues that would wait past it. Without a ``QueueRoom`` the gap is refused at once.

``decide_readmission`` recomputes the same arithmetic at every capacity change
(spare promoted, replacement ready, each ramp step, survivors' measured rate):
the refused share follows the gap down and is zero once capacity covers the
arrivals, while the queue bound stays armed until the warm floor is restored
(the gateway can still reject excess at once). ``admission_changed`` says when a
new decision is worth re-applying (a shed level moved by at least
``REAPPLY_STEP`` of arrivals, or protection was armed/disarmed), so the gateway
is not rewritten at every measurement wobble.

Pressure rules (defaults in line with the gateway inference extension's
saturation detector, reference/peers.md): a survivor's saturation is
``max(waiting / queue_bound, kv_usage / kv_ceiling)``; the pool is saturated when
the mean is >= 1. **Thrash** is a rising queue with KV near its ceiling and a
climbing preemption count: the engine evicts and recomputes instead of serving.
Saturation or thrash arms the queue bound even when the capacity arithmetic
says the survivors fit: the excess is rejected at once by the bound, but no
tier is refused for it (at zero gap nothing is refused).

``can_lift_shedding`` says when the emergency admission may be lifted: only once
the warm floor is restored, the replacement is warm and the survivors are calm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from fleet.gateway import Admission
from fleet.vocabulary import SHED_ORDER, Tier

DEFAULT_TIER_MIX: dict[Tier, float] = {Tier.CRITICAL: 0.2, Tier.STANDARD: 0.5, Tier.SHEDDABLE: 0.3}
# Partial shares are rounded to this many decimals (the gateway's runtime fraction resolution).
SHARE_DECIMALS = 4
# A recomputed admission is re-applied when the refused share of arrivals moved at least this much.
REAPPLY_STEP = 0.01


class SurvivorLoad(BaseModel):
    """One surviving replica group's engine figures (from two consecutive scrapes)."""

    model_config = ConfigDict(frozen=True)

    group_id: str
    waiting: float = Field(ge=0)
    running: float = Field(default=0.0, ge=0)
    kv_usage: float | None = Field(
        default=None, ge=0, description="0..1; None when the engine exports no KV metric"
    )
    preemptions_per_s: float = Field(default=0.0, ge=0)
    waiting_delta: float = Field(
        default=0.0, description="Change of the waiting queue since the previous scrape"
    )
    capacity_rps: float | None = Field(
        default=None, ge=0, description="Requests/s this group sustains when warm"
    )


class PressureThresholds(BaseModel):
    model_config = ConfigDict(frozen=True)

    queue_bound: int = Field(default=5, ge=1)
    kv_ceiling: float = Field(default=0.8, gt=0, le=1)
    kv_thrash: float = Field(default=0.9, gt=0, le=1, description="KV usage 'near the ceiling' for thrash")
    target_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Plan survivors to run at most this busy"
    )


class SurvivorPressure(BaseModel):
    model_config = ConfigDict(frozen=True)

    group_id: str
    saturation: float
    thrashing: bool


def survivor_pressure(load: SurvivorLoad, t: PressureThresholds) -> SurvivorPressure:
    kv = load.kv_usage or 0.0
    saturation = max(load.waiting / t.queue_bound, kv / t.kv_ceiling)
    thrashing = kv >= t.kv_thrash and load.preemptions_per_s > 0 and load.waiting_delta > 0
    return SurvivorPressure(group_id=load.group_id, saturation=saturation, thrashing=thrashing)


class QueueRoom(BaseModel):
    """How much of a gap the survivors' queues can absorb before the next look (see the module doc)."""

    model_config = ConfigDict(frozen=True)

    wait_budget_s: float = Field(
        ge=0, description="Longest a request may wait in a survivor's queue and still meet its objective"
    )
    backlog: float = Field(ge=0, description="Requests waiting in the routed replicas' queues now")
    horizon_s: float = Field(gt=0, description="Until the admission is next recomputed")

    def room(self, capacity_rps: float) -> float:
        """Requests the queues can still take: what ``capacity_rps`` serves within the budget, less the backlog."""
        return max(0.0, capacity_rps * self.wait_budget_s - self.backlog)

    def absorbable_rps(self, capacity_rps: float) -> float:
        """The room as an arrival rate over the horizon."""
        return self.room(capacity_rps) / self.horizon_s


class ShedDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    shed_tiers: tuple[Tier, ...] = Field(description="Tiers refused whole")
    partial_shed: dict[Tier, float] = Field(
        default_factory=dict, description="Tier -> share of its requests refused (0 < share < 1)"
    )
    admission: Admission
    arrival_rps: float
    survivor_capacity_rps: float = Field(description="Capacity the pool has now (survivors + what came back)")
    deficit_fraction: float = Field(description="Share of arrivals the pool cannot carry (the gap)")
    shed_fraction: float = Field(description="Share of arrivals refused by admission")
    residual_shortfall_rps: float = Field(
        description="Excess still arriving after shedding (bounded queue rejects it)"
    )
    absorbed_rps: float = Field(
        default=0.0, ge=0, description="Part of the gap the survivors' queues take until the next look"
    )
    mean_saturation: float = 0.0
    thrashing: tuple[str, ...] = ()
    reason: str

    @property
    def shedding(self) -> bool:
        """Admission refuses some share of some tier."""
        return bool(self.shed_tiers or self.partial_shed)

    @property
    def tiers_touched(self) -> tuple[Tier, ...]:
        """Every tier admission refuses any of, lowest first."""
        return tuple(t for t in SHED_ORDER if t in self.shed_tiers or t in self.partial_shed)


class GapShares(BaseModel):
    """How a gap is taken out of the tiers: whole tiers, one partial tier, and the share refused."""

    model_config = ConfigDict(frozen=True)

    whole: tuple[Tier, ...]
    partial: dict[Tier, float]
    refused_fraction: float


def normalised_mix(tier_mix: Mapping[Tier, float] | None) -> dict[Tier, float]:
    mix = dict(tier_mix or DEFAULT_TIER_MIX)
    if any(v < 0 for v in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError(f"tier mix must be non-negative shares with a positive sum, got {mix}")
    total = sum(mix.values())
    return {tier: share / total for tier, share in mix.items()}


def shares_for_gap(gap: float, mix: Mapping[Tier, float]) -> GapShares:
    """Refuse ``gap`` (a share of arrivals) from the lowest tiers first, the last one partially.

    ``mix`` is the tier mix of arrivals (normalised). Critical is never refused: a gap
    bigger than the non-critical share refuses every non-critical tier and no more.
    """
    if gap < 0:
        raise ValueError(f"gap must be >= 0, got {gap}")
    whole: list[Tier] = []
    partial: dict[Tier, float] = {}
    remaining = gap
    refused = 0.0
    for tier in SHED_ORDER:
        weight = mix.get(tier, 0.0)
        if remaining <= 0 or weight <= 0:
            continue
        if remaining >= weight:
            whole.append(tier)
            refused += weight
            remaining -= weight
            continue
        share = round(remaining / weight, SHARE_DECIMALS)
        if share >= 1.0:
            whole.append(tier)
            refused += weight
        elif share > 0.0:
            partial[tier] = share
            refused += share * weight
        remaining = 0.0
    return GapShares(whole=tuple(whole), partial=partial, refused_fraction=refused)


def _pressure(survivors: Sequence[SurvivorLoad], t: PressureThresholds) -> tuple[float, tuple[str, ...]]:
    pressures = [survivor_pressure(s, t) for s in survivors]
    mean_sat = sum(p.saturation for p in pressures) / len(pressures) if pressures else 0.0
    return mean_sat, tuple(p.group_id for p in pressures if p.thrashing)


def _decide(
    *,
    arrival_rps: float,
    capacity_rps: float,
    head: str,
    mix: dict[Tier, float],
    t: PressureThresholds,
    keep_armed: bool,
    survivors: Sequence[SurvivorLoad] = (),
    queues: QueueRoom | None = None,
) -> ShedDecision:
    usable = capacity_rps * t.target_utilization
    deficit = max(0.0, 1.0 - usable / arrival_rps) if arrival_rps > 0 else 0.0
    mean_sat, thrashing = _pressure(survivors, t)
    pressured = mean_sat >= 1.0 or bool(thrashing)
    absorbed = min(arrival_rps * deficit, queues.absorbable_rps(usable)) if queues and deficit > 0 else 0.0
    to_refuse = max(0.0, deficit - absorbed / arrival_rps) if arrival_rps > 0 else 0.0
    shares = shares_for_gap(to_refuse, mix)
    refused = shares.refused_fraction
    residual = max(0.0, arrival_rps * (1.0 - refused) - usable - absorbed)
    armed = keep_armed or pressured or bool(shares.whole or shares.partial)

    parts = [
        f"{head}; arrivals {arrival_rps:.1f} req/s vs capacity {capacity_rps:.1f} req/s at "
        f"{t.target_utilization:.0%} = {usable:.1f} req/s -> {deficit:.1%} of arrivals cannot be carried"
    ]
    if queues is not None and deficit > 0:
        room = queues.room(usable)
        parts.append(
            f"the queues hold {queues.backlog:.0f} request(s) with room for {room:.0f} more within the "
            f"{queues.wait_budget_s:g} s wait budget: they absorb {absorbed:.1f} req/s of the gap until the "
            f"next look in {queues.horizon_s:g} s, {to_refuse:.1%} of arrivals is left to refuse"
        )
    if survivors:
        parts.append(
            f"survivor saturation {mean_sat:.2f} (max(waiting/{t.queue_bound}, KV/{t.kv_ceiling:g}))"
            + (f"; thrashing: {', '.join(thrashing)}" if thrashing else "")
        )
    if shares.whole or shares.partial:
        terms = [f"{tier.value} {mix.get(tier, 0.0):.0%} whole" for tier in shares.whole]
        terms += [
            f"{share:.1%} of {tier.value} ({mix.get(tier, 0.0):.0%} of arrivals)"
            for tier, share in shares.partial.items()
        ]
        what = "the gap" if absorbed <= 1e-9 else "the gap the queues cannot absorb"
        parts.append(f"refuse {' + '.join(terms)} = {refused:.1%} of arrivals ({what}, lowest tiers first)")
        if residual > 1e-9:
            parts.append(
                f"still {residual:.1f} req/s over capacity after shedding every sheddable tier: "
                f"critical traffic is not shed; the per-replica queue bound of {t.queue_bound} rejects the excess"
            )
    elif armed:
        why = "survivors are saturated/thrashing" if pressured else "the warm floor is not restored yet"
        gap = "the queues absorb the gap" if deficit > 0 else "no capacity gap"
        parts.append(f"nothing refused ({gap}); queue bound {t.queue_bound} stays armed because {why}")
    else:
        parts.append("no shedding needed")
    return ShedDecision(
        shed_tiers=shares.whole,
        partial_shed=shares.partial,
        admission=Admission(
            shed_tiers=list(shares.whole),
            partial_shed=dict(shares.partial),
            queue_bound=t.queue_bound if armed else None,
        ),
        arrival_rps=arrival_rps,
        survivor_capacity_rps=capacity_rps,
        deficit_fraction=deficit,
        shed_fraction=refused,
        residual_shortfall_rps=residual,
        absorbed_rps=absorbed,
        mean_saturation=mean_sat,
        thrashing=thrashing,
        reason="; ".join(parts),
    )


def decide_shedding(
    arrival_rps: float,
    survivors: Sequence[SurvivorLoad],
    lost_capacity_rps: float,
    per_group_capacity_rps: float,
    tier_mix: Mapping[Tier, float] | None = None,
    thresholds: PressureThresholds | None = None,
    *,
    keep_armed: bool = False,
    queues: QueueRoom | None = None,
    unread_survivors: Mapping[str, str] | None = None,
) -> ShedDecision:
    """What share of which tiers to refuse so the survivors carry the load (the gap, exactly).

    ``per_group_capacity_rps`` fills the survivors' unknown capacities. ``keep_armed`` keeps the
    queue bound on even with no gap (a recovery passes True: its warm floor is not restored).
    ``queues`` lets the survivors' queues absorb what they can of the gap first.
    ``unread_survivors`` (group id -> why): survivors whose engines did not answer the look. Each
    counts for ``per_group_capacity_rps`` (it still serves: never counted dead), and the pressure
    is judged on the survivors read (never counted idle); the reason names them.
    """
    t = thresholds or PressureThresholds()
    mix = normalised_mix(tier_mix)
    if arrival_rps < 0 or lost_capacity_rps < 0 or per_group_capacity_rps < 0:
        raise ValueError("arrival rate and capacities must be >= 0")
    unread = dict(unread_survivors or {})
    overlap = sorted(set(unread) & {s.group_id for s in survivors})
    if overlap:
        raise ValueError(f"a survivor is either read or unread, not both: {', '.join(overlap)}")
    capacity = sum(
        s.capacity_rps if s.capacity_rps is not None else per_group_capacity_rps for s in survivors
    ) + per_group_capacity_rps * len(unread)
    head = f"lost {lost_capacity_rps:.1f} req/s of capacity; {len(survivors) + len(unread)} survivor(s)"
    if unread:
        head += (
            f" ({len(unread)} not read: {', '.join(sorted(unread))}; each counted at "
            f"{per_group_capacity_rps:.1f} req/s, pressure judged on the {len(survivors)} read)"
        )
    return _decide(
        arrival_rps=arrival_rps,
        capacity_rps=capacity,
        head=head,
        mix=mix,
        t=t,
        keep_armed=keep_armed,
        survivors=survivors,
        queues=queues,
    )


def decide_readmission(
    arrival_rps: float,
    capacity_rps: float,
    change: str,
    *,
    warm_floor_restored: bool,
    tier_mix: Mapping[Tier, float] | None = None,
    thresholds: PressureThresholds | None = None,
    queues: QueueRoom | None = None,
) -> ShedDecision:
    """The admission after a capacity change (or a new look at the queues): refuse the gap the
    queues cannot absorb; keep the queue bound until the floor is back."""
    t = thresholds or PressureThresholds()
    mix = normalised_mix(tier_mix)
    if arrival_rps < 0 or capacity_rps < 0:
        raise ValueError("arrival rate and capacity must be >= 0")
    return _decide(
        arrival_rps=arrival_rps,
        capacity_rps=capacity_rps,
        head=change,
        mix=mix,
        t=t,
        keep_armed=not warm_floor_restored,
        queues=queues,
    )


def refused_fraction(admission: Admission, tier_mix: Mapping[Tier, float] | None = None) -> float:
    """The share of arrivals ``admission`` refuses, given the tier mix."""
    mix = normalised_mix(tier_mix)
    return sum(admission.shed_share(tier) * share for tier, share in mix.items())


def admission_changed(
    current: Admission, new: Admission, tier_mix: Mapping[Tier, float] | None = None
) -> bool:
    """Re-apply ``new``? When protection is armed/disarmed, shedding starts/stops, or the level moves enough."""
    if (current.queue_bound is None) != (new.queue_bound is None):
        return True
    was, now = refused_fraction(current, tier_mix), refused_fraction(new, tier_mix)
    if (was > 0) != (now > 0):
        return True
    return abs(was - now) >= REAPPLY_STEP


def pool_capacity_rps(
    per_group_rps: float, established: int, warmth: Mapping[str, float] | None = None
) -> float:
    """Capacity of the routed pool: ``established`` warm groups plus new ones at their measured warmth (0..1)."""
    if per_group_rps < 0 or established < 0:
        raise ValueError("capacity and group count must be >= 0")
    return per_group_rps * (established + sum(min(1.0, max(0.0, w)) for w in (warmth or {}).values()))


def ramp_capacity_rps(
    per_group_rps: float, established: int, warmth: Mapping[str, float], serving_groups: int
) -> tuple[float, str]:
    """The capacity a ramp step plans on, and a note when the floor applied: the established groups
    the step measured plus the new ones at their warmth, never less than the ``serving_groups``
    that served warm before the ramp (survivors and promoted spares). A ramp only adds capacity; a
    step that could not read an established engine (a scrape timed out on a busy node) must not plan
    as if that group were gone: one such step planned 30 req/s for four warm groups of 15 and
    refused 48 % of arrivals."""
    measured = pool_capacity_rps(per_group_rps, established, warmth)
    floor = pool_capacity_rps(per_group_rps, serving_groups)
    if measured >= floor:
        return measured, ""
    return floor, f" (at least the {serving_groups} group(s) that served warm before the ramp)"


class LiftDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    lift: bool
    reason: str


def can_lift_shedding(
    warm_groups: int,
    warm_floor: int,
    replacement_warm: bool,
    survivors: Sequence[SurvivorLoad],
    thresholds: PressureThresholds | None = None,
) -> LiftDecision:
    """Shedding stays on until the warm floor is restored, the replacement is warm and nobody is saturated."""
    t = thresholds or PressureThresholds()
    if warm_groups < warm_floor:
        return LiftDecision(
            lift=False, reason=f"warm floor not restored: {warm_groups} of {warm_floor} warm group(s)"
        )
    if not replacement_warm:
        return LiftDecision(lift=False, reason="replacement is ready but not yet warm (cold prefix cache)")
    hot = [
        p.group_id for p in (survivor_pressure(s, t) for s in survivors) if p.saturation >= 1.0 or p.thrashing
    ]
    if hot:
        return LiftDecision(lift=False, reason=f"still saturated: {', '.join(hot)}")
    return LiftDecision(
        lift=True,
        reason=f"warm floor restored ({warm_groups}/{warm_floor}), replacement warm, survivors calm",
    )


def lift_after_verification(
    verification_passed: bool,
    warm_groups: int,
    warm_floor: int,
    survivors: Sequence[SurvivorLoad],
    thresholds: PressureThresholds | None = None,
) -> LiftDecision:
    """Step 10's one lift rule: shedding is lifted only when verification passed (the replacement is
    warm), the warm floor is restored and no survivor is saturated or thrashing.

    A passed verification alone does not lift it: survivors still saturated keep shedding on, and
    the recovery says what it leaves in place.
    """
    return can_lift_shedding(warm_groups, warm_floor, verification_passed, survivors, thresholds)


def estimate_arrivals(
    admitted_rps: float,
    admission: Admission,
    previous_rps: float | None,
    tier_mix: Mapping[Tier, float] | None = None,
    smoothing: float = 0.5,
) -> float:
    """Arrivals at the gateway from what the engines admitted under ``admission`` (EWMA with the last estimate).

    The engines see only what admission let through: arrivals = admitted / (1 - refused share).
    """
    if admitted_rps < 0 or not 0.0 < smoothing <= 1.0:
        raise ValueError("admitted rate must be >= 0 and smoothing in (0, 1]")
    kept = 1.0 - refused_fraction(admission, tier_mix)
    if kept <= 1e-6:
        return previous_rps if previous_rps is not None else admitted_rps
    measured = admitted_rps / kept
    if previous_rps is None:
        return measured
    return smoothing * measured + (1.0 - smoothing) * previous_rps


class ShedLevel(BaseModel):
    """One shed level as the incident recorded it: from ``at`` on, ``refused`` of arrivals (the ``gap``)."""

    model_config = ConfigDict(frozen=True)

    at: float
    gap: float = Field(ge=0)
    refused: float = Field(ge=0, le=1)


class SheddingAccount(BaseModel):
    """What users were refused against what the capacity gap called for, as shares of all arrivals."""

    model_config = ConfigDict(frozen=True)

    arrivals: int
    shed: int
    refused_share: float
    gap_share: float = Field(description="Arrivals the recorded gap called for refusing, over all arrivals")
    over_shed_share: float = Field(description="(shed - gap's refusals) / arrivals, >= 0")


def account_shedding(
    levels: Sequence[ShedLevel], *, arrivals: int, shed: int, arrival_rps: float, until: float
) -> SheddingAccount:
    """Compare the users' shed count with the gap the incident recorded (levels held until the next one)."""
    if arrivals < 0 or shed < 0 or arrival_rps < 0:
        raise ValueError("counts and rates must be >= 0")
    ordered = sorted(levels, key=lambda lv: lv.at)
    called_for = 0.0
    for level, nxt in zip(ordered, [*ordered[1:], None], strict=True):
        end = nxt.at if nxt is not None else until
        called_for += min(level.gap, 1.0) * max(0.0, end - level.at) * arrival_rps

    def share(n: float) -> float:
        return n / arrivals if arrivals else 0.0

    return SheddingAccount(
        arrivals=arrivals,
        shed=shed,
        refused_share=share(shed),
        gap_share=share(called_for),
        over_shed_share=max(0.0, share(shed - called_for)),
    )
