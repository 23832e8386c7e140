"""Live measurements for the replica-loss procedure: survivors' load, arrivals, and the ramp-back plan.

Pure functions over engine scrapes (``EngineSnapshot`` pairs taken ``seconds``
apart) and the request journal. The ramp uses the same ``rate_weights`` as the
what-if model in ``fleet.ramp``.

**Measured service rate.** vLLM exports no "requests per second I could serve"
gauge, and throughput alone is no measure (a lightly loaded replica serves what
it is sent). What it does export is each request's end-to-end latency and the
part of it spent queued; their difference is the time the engine spent *serving*
the request (prefill + decode). A replica with a cold prefix cache spends longer
on prefill, a slow or throttled one longer on decode, so ``1 / mean service
time`` over the interval is a per-replica speed that tracks warmth whatever the
load. Weights proportional to it are the runbook's "weight each replica by its
measured service rate"; a replica is **warm** when its speed reaches
``warm_fraction`` of the established replicas' median.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from statistics import median
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_metrics import EngineSnapshot
from fleet.observation import PoolObservation
from fleet.protocol import JournalEntry, Outcome
from fleet.ramp import rate_weights
from fleet.shedding import SurvivorLoad

# A new replica whose TTFT p99 breaks the SLO gets its weight multiplied by this, per interval.
BACKOFF_FACTOR = 0.5
# Each calm interval lets a backed-off replica regain this much of its multiplier (up to 1).
RECOVERY_FACTOR = 1.5
MIN_SHARE = 0.02


def survivor_load(
    group_id: str, before: EngineSnapshot, after: EngineSnapshot, seconds: float
) -> SurvivorLoad:
    """One survivor's pressure figures from two scrapes."""
    preempt = max(0.0, after.preemptions_total - before.preemptions_total) / seconds if seconds > 0 else 0.0
    return SurvivorLoad(
        group_id=group_id,
        waiting=after.waiting,
        running=after.running,
        kv_usage=after.kv_usage,
        preemptions_per_s=preempt,
        waiting_delta=after.waiting - before.waiting,
    )


def completion_rate(before: EngineSnapshot, after: EngineSnapshot, seconds: float) -> float:
    return (
        max(0.0, after.request_success_total - before.request_success_total) / seconds if seconds > 0 else 0.0
    )


def arrival_rate(
    before: PoolObservation, after: PoolObservation, seconds: float, lost_ids: Iterable[str]
) -> float:
    """Requests/s reaching the pool's engines: completions plus queue growth, over the surviving groups."""
    lost = set(lost_ids)
    total = 0.0
    for gid, now in after.engines.items():
        if gid in lost or gid not in before.engines:
            continue
        prev = before.engines[gid]
        total += completion_rate(prev, now, seconds) + max(0.0, now.in_flight - prev.in_flight) / seconds
    return total


def per_group_capacity(
    configured_rps: float | None, before: PoolObservation, after: PoolObservation, seconds: float
) -> tuple[float, str]:
    """Requests/s one warm group sustains: the operator's load-tested figure, else the busiest group seen."""
    if configured_rps:
        return configured_rps, f"configured group capacity {configured_rps:g} req/s"
    rates = [
        completion_rate(before.engines[g], e, seconds)
        for g, e in after.engines.items()
        if g in before.engines
    ]
    best = max(rates, default=0.0)
    return best, f"no configured group capacity; busiest group served {best:.1f} req/s (a lower bound)"


def service_speed(before: EngineSnapshot | None, after: EngineSnapshot) -> float | None:
    """1 / mean service time (end-to-end minus queueing) of the requests finished between two scrapes."""
    e2e, queue = after.e2e, after.queue_time
    if before is not None:
        e2e, queue = e2e.minus(before.e2e), queue.minus(before.queue_time)
    if e2e.count <= 0:
        return None
    mean_service = (e2e.sum - queue.sum) / e2e.count
    return 1.0 / mean_service if mean_service > 1e-6 else None


def window_ttft_p99(before: EngineSnapshot | None, after: EngineSnapshot) -> float | None:
    window = after.ttft.minus(before.ttft) if before is not None else after.ttft
    return window.quantile(0.99) if window.count > 0 else None


class RampPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    weights: dict[str, float]
    rates: dict[str, float | None]
    all_warm: bool
    backoff: dict[str, float] = Field(default_factory=dict)
    reason: str


def plan_weights(
    before: Mapping[str, EngineSnapshot],
    after: Mapping[str, EngineSnapshot],
    new_pods: Sequence[str],
    *,
    ttft_slo_s: float,
    warm_fraction: float,
    backoff: Mapping[str, float] | None = None,
) -> RampPlan:
    """Weights for the routed replicas (keyed by leader pod) from one measurement interval.

    Established replicas with no measurement this interval get the median speed;
    a new replica with none gets the minimum share (it still needs traffic to
    warm its cache). A new replica whose own TTFT p99 exceeds the SLO is backed
    off; once every new replica is warm, weights return to equal (plain routing).
    """
    pods = sorted(after)
    speeds = {p: service_speed(before.get(p), after[p]) for p in pods}
    established = [s for p, s in speeds.items() if p not in new_pods and s is not None]
    ref = median(established) if established else None
    mult = dict(backoff or {})
    notes: list[str] = []
    warm: dict[str, bool] = {}
    rates: dict[str, float] = {}
    for p in pods:
        s = speeds[p]
        if p in new_pods:
            warm[p] = s is not None and ref is not None and s >= warm_fraction * ref
            ttft = window_ttft_p99(before.get(p), after[p])
            m = mult.get(p, 1.0)
            if ttft is not None and ttft > ttft_slo_s:
                m *= BACKOFF_FACTOR
                warm[p] = False
                notes.append(f"{p} TTFT p99 {ttft:.2f}s > SLO {ttft_slo_s:g}s: backing off (x{m:.2f})")
            else:
                m = min(1.0, m * RECOVERY_FACTOR)
            mult[p] = m
            base = s if s is not None else (ref or 0.0) * MIN_SHARE
            rates[p] = base * m
            rel = f"{s / ref:.0%} of warm" if s is not None and ref else "not measured yet"
            notes.append(f"{p} speed {rel}{' (warm)' if warm[p] else ''}")
        else:
            rates[p] = s if s is not None else (ref or 1.0)
    all_warm = bool(new_pods) and all(warm.get(p, False) for p in new_pods if p in after)
    if all_warm:
        weights = dict.fromkeys(pods, 1.0)
        notes.append("every new replica is warm: equal weights")
    else:
        floor = min(MIN_SHARE, 0.5 / max(1, len(pods)))
        weights = {p: round(w, 4) for p, w in rate_weights(rates, floor=floor).items()}
    return RampPlan(
        weights=weights,
        rates={p: (round(v, 4) if v is not None else None) for p, v in speeds.items()},
        all_warm=all_warm,
        backoff=mult,
        reason="; ".join(notes) or "no new replica measured",
    )


def in_flight_record(journal: Iterable[JournalEntry], since: float) -> dict[str, Any]:
    """What happened to the lost replicas' requests, from the gateway's journal."""
    entries = [e for e in journal if e.ended_at >= since]
    counts = {o.value: 0 for o in Outcome}
    effect_ids: set[str] = set()
    for e in entries:
        counts[e.outcome.value] += 1
        effect_ids.update(e.effect_operation_ids)
    return {
        "attempts": len(entries),
        "retried": counts[Outcome.RETRIED.value],
        "terminal_errors": counts[Outcome.TERMINAL_ERROR.value],
        "completed": counts[Outcome.COMPLETED.value] + counts[Outcome.LATE.value],
        "truncated": sum(1 for e in entries if e.truncated),
        "effect_operation_ids": len(effect_ids),
    }


def new_leaders(initial: PoolObservation, now: PoolObservation) -> set[str]:
    """Leader pods that did not exist (same name and uid) when the procedure started."""
    return {
        g.leader_pod
        for g in now.snapshot.groups
        if initial.pod_uids.get(g.leader_pod) != now.pod_uids.get(g.leader_pod)
    }
