"""Step 3 of the replica-loss procedure: protect the survivors by tightening admission.

The pool lost service rate but keeps its arrival rate. ``decide_shedding``
compares what the survivors can carry with what arrives, reads the survivors'
pressure (queue, KV-cache usage, preemptions), and picks the gateway tiers to
refuse, lowest first (``fleet.vocabulary.SHED_ORDER``; critical traffic is never
shed). The arithmetic is written out in ``ShedDecision.reason`` so the incident
record says *why* a tier was dropped.

Pressure rules (defaults in line with the gateway inference extension's
saturation detector, reference/peers.md): a survivor's saturation is
``max(waiting / queue_bound, kv_usage / kv_ceiling)``; the pool is saturated when
the mean is >= 1. **Thrash** is a rising queue with KV near its ceiling and a
climbing preemption count: the engine evicts and recomputes instead of serving.
Saturation or any thrash sheds at least the lowest tier even when the capacity
arithmetic alone would not; thrash on most survivors sheds one tier more.

``can_lift_shedding`` says when the emergency admission may be lifted: only once
the warm floor is restored, the replacement is warm and the survivors are calm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from fleet.protocol import Admission
from fleet.vocabulary import SHED_ORDER, Tier

DEFAULT_TIER_MIX: dict[Tier, float] = {Tier.CRITICAL: 0.2, Tier.STANDARD: 0.5, Tier.SHEDDABLE: 0.3}


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


class ShedDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    shed_tiers: tuple[Tier, ...]
    admission: Admission
    arrival_rps: float
    survivor_capacity_rps: float
    deficit_fraction: float = Field(description="Share of arrivals the survivors cannot carry")
    shed_fraction: float = Field(description="Share of arrivals in the shed tiers")
    residual_shortfall_rps: float = Field(
        description="Excess still arriving after shedding (bounded queue rejects it)"
    )
    mean_saturation: float
    thrashing: tuple[str, ...]
    reason: str

    @property
    def shedding(self) -> bool:
        return bool(self.shed_tiers)


def decide_shedding(
    arrival_rps: float,
    survivors: Sequence[SurvivorLoad],
    lost_capacity_rps: float,
    per_group_capacity_rps: float,
    tier_mix: Mapping[Tier, float] | None = None,
    thresholds: PressureThresholds | None = None,
) -> ShedDecision:
    """Which tiers to refuse so the survivors carry the load (``per_group_capacity_rps`` fills unknown capacities)."""
    t = thresholds or PressureThresholds()
    mix = dict(tier_mix or DEFAULT_TIER_MIX)
    if arrival_rps < 0 or lost_capacity_rps < 0 or per_group_capacity_rps < 0:
        raise ValueError("arrival rate and capacities must be >= 0")
    if any(v < 0 for v in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError(f"tier mix must be non-negative shares with a positive sum, got {mix}")
    total = sum(mix.values())
    mix = {tier: share / total for tier, share in mix.items()}

    capacity = sum(
        s.capacity_rps if s.capacity_rps is not None else per_group_capacity_rps for s in survivors
    )
    usable = capacity * t.target_utilization
    deficit = max(0.0, 1.0 - usable / arrival_rps) if arrival_rps > 0 else 0.0

    pressures = [survivor_pressure(s, t) for s in survivors]
    mean_sat = sum(p.saturation for p in pressures) / len(pressures) if pressures else 0.0
    thrashing = tuple(p.group_id for p in pressures if p.thrashing)
    min_tiers = 0
    if mean_sat >= 1.0 or thrashing:
        min_tiers = 1
    if pressures and len(thrashing) * 2 > len(pressures):
        min_tiers = 2

    shed: list[Tier] = []
    shed_fraction = 0.0
    for tier in SHED_ORDER:
        if shed_fraction >= deficit and len(shed) >= min_tiers:
            break
        shed.append(tier)
        shed_fraction += mix.get(tier, 0.0)
    if deficit == 0.0 and min_tiers == 0:
        shed, shed_fraction = [], 0.0
    residual = max(0.0, arrival_rps * (1.0 - shed_fraction) - usable)

    parts = [
        f"lost {lost_capacity_rps:.1f} req/s of capacity; arrivals {arrival_rps:.1f} req/s vs "
        f"{len(survivors)} survivor(s) x capacity = {capacity:.1f} req/s at {t.target_utilization:.0%} "
        f"= {usable:.1f} req/s -> {deficit:.1%} of arrivals cannot be carried"
    ]
    parts.append(
        f"survivor saturation {mean_sat:.2f} (max(waiting/{t.queue_bound}, KV/{t.kv_ceiling:g}))"
        + (f"; thrashing: {', '.join(thrashing)}" if thrashing else "")
    )
    if shed:
        mix_text = " + ".join(f"{tier.value} {mix.get(tier, 0.0):.0%}" for tier in shed)
        parts.append(f"shed {mix_text} = {shed_fraction:.0%} of arrivals")
        if residual > 0:
            parts.append(
                f"still {residual:.1f} req/s over capacity after shedding every sheddable tier: "
                f"critical traffic is not shed; the per-replica queue bound of {t.queue_bound} rejects the excess"
            )
    else:
        parts.append("no shedding needed")
    return ShedDecision(
        shed_tiers=tuple(shed),
        admission=Admission(shed_tiers=list(shed), queue_bound=t.queue_bound if shed else None),
        arrival_rps=arrival_rps,
        survivor_capacity_rps=capacity,
        deficit_fraction=deficit,
        shed_fraction=shed_fraction,
        residual_shortfall_rps=residual,
        mean_saturation=mean_sat,
        thrashing=thrashing,
        reason="; ".join(parts),
    )


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
