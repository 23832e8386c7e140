"""Live measurements for the replica-loss procedure: survivors' load, arrivals, and the ramp-back plan.

Pure functions over engine scrapes (``EngineSnapshot`` pairs taken an interval
apart) and the request journal. The ramp uses the same ``rate_weights`` as the
what-if model in ``fleet.ramp``.

**Measured service rate.** vLLM exports no "tokens per second I could serve"
gauge, so each replica's rate is estimated from two things it does export:

* its generation throughput over the interval - what it demonstrably served,
  a hard lower bound of its rate;
* its prefix-cache hit ratio over the interval (hits / queries), against the
  established replicas' ratio - how warm its cache is. A replacement starts at
  zero hits and climbs as its cache fills, which is exactly the cold start the
  runbook warns about ("ready before it is fast").

``rate = max(throughput, established median throughput x warmth)``. An
unmeasured replica still gets a small floor share (it needs traffic to warm).
A replica is **warm** once its hit ratio reaches ``warm_fraction`` of the
established replicas'. Engines that export no prefix-cache counters fall back
to throughput alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from statistics import median
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_metrics import EngineSnapshot
from fleet.gateway import JournalEntry, Outcome
from fleet.observation import PoolObservation
from fleet.ramp import rate_weights
from fleet.shedding import SurvivorLoad
from fleet.verification import (
    LedgerReconcile,
    NodeQuarantine,
    RecoveryObservations,
    ReplicaObservation,
)
from fleet.vocabulary import QUARANTINE_LABEL, QUARANTINE_TAINT_KEY

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
    before: PoolObservation,
    after: PoolObservation,
    seconds: float,
    lost_ids: Iterable[str],
    *,
    refused_share: float = 0.0,
    counted_since: PoolObservation | None = None,
) -> tuple[float, str]:
    """Requests/s arriving at the pool, and where the figure comes from.

    Counted by the gateway when it keeps a count: requests past admission between two readings
    of its counter (over the time between the readings, not ``seconds``: an observation reads the
    gateway first and probes its engines after), scaled back up by the share admission refused.
    That is where requests arrive. ``counted_since`` is an earlier observation to count from (a
    longer window, less noise: arrivals do not change with a loss); a counter that went backwards
    (an Envoy restarted in between) says nothing, and the next window is tried.

    Otherwise estimated from the surviving engines between ``before`` and ``after``: completions
    plus queue growth. That estimate runs high just after a loss, when the lost replicas' retried
    requests land on the survivors' queues at once and a one-off backlog reads as a rate.
    """
    for start in (counted_since, before):
        counted = _counted_window(start, after) if start is not None else None
        if counted is not None:
            kept = max(1e-6, 1.0 - min(refused_share, 1.0))
            return counted[0] / counted[1] / kept, "counted by the gateway"
    lost = set(lost_ids)
    total = 0.0
    for gid, now in after.engines.items():
        if gid in lost or gid not in before.engines:
            continue
        prev = before.engines[gid]
        total += completion_rate(prev, now, seconds) + max(0.0, now.in_flight - prev.in_flight) / seconds
    return total, "survivors' completions + queue growth (the gateway keeps no count)"


class ArrivalTally(BaseModel):
    """Arrivals at the gateway counted across an incident, one reading of its counter after another.

    Each stretch between two readings adds the requests admission let through, scaled up by
    the share admission refused during it (the refused share changes as the incident goes on,
    so one long window could not be scaled by one share). The rate is over every counted
    stretch: arrivals do not change with a loss, and a long count is steadier than the first
    second or two after the fault (open-loop clients arrive in bursts). A counter that went
    backwards (the gateway restarted) starts a new stretch; the time in between is not counted.
    """

    model_config = ConfigDict(frozen=True)

    requests: float = Field(default=0.0, ge=0)
    seconds: float = Field(default=0.0, ge=0)
    last_total: int | None = None
    last_at: float | None = None

    def add(self, obs: PoolObservation, refused_share: float) -> ArrivalTally:
        """The tally after one more observation (admission refused ``refused_share`` since the last one)."""
        total = obs.gateway_admitted_total
        if total is None:
            return self
        at = obs.snapshot.observed_at if obs.gateway_counted_at is None else obs.gateway_counted_at
        if self.last_total is None or self.last_at is None or total < self.last_total or at <= self.last_at:
            return self.model_copy(update={"last_total": total, "last_at": max(at, self.last_at or at)})
        kept = max(1e-6, 1.0 - min(max(refused_share, 0.0), 1.0))
        return ArrivalTally(
            requests=self.requests + (total - self.last_total) / kept,
            seconds=self.seconds + (at - self.last_at),
            last_total=total,
            last_at=at,
        )

    def rate(self, min_seconds: float) -> float | None:
        """Arrivals/s over what was counted, once at least ``min_seconds`` were."""
        return self.requests / self.seconds if self.seconds >= min_seconds and self.seconds > 0 else None


def _counted_window(before: PoolObservation, after: PoolObservation) -> tuple[int, float] | None:
    """(requests the gateway admitted, seconds) between two observations' readings of its counter;
    None without two readings, or when the counter went backwards (the gateway restarted)."""
    if before.gateway_admitted_total is None or after.gateway_admitted_total is None:
        return None
    start = before.snapshot.observed_at if before.gateway_counted_at is None else before.gateway_counted_at
    end = after.snapshot.observed_at if after.gateway_counted_at is None else after.gateway_counted_at
    admitted = after.gateway_admitted_total - before.gateway_admitted_total
    if end - start <= 0 or admitted < 0:
        return None
    return admitted, end - start


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


def window_ttft_p99(before: EngineSnapshot | None, after: EngineSnapshot) -> float | None:
    window = after.ttft.minus(before.ttft) if before is not None else after.ttft
    return window.quantile(0.99) if window.count > 0 else None


class RampPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    weights: dict[str, float]
    rates: dict[str, float]
    all_warm: bool
    backoff: dict[str, float] = Field(default_factory=dict)
    reason: str


def hit_ratio(before: EngineSnapshot | None, after: EngineSnapshot) -> float | None:
    """Prefix-cache hits / queries between two scrapes (None when nothing was looked up)."""
    queries = after.prefix_queries_total - (before.prefix_queries_total if before else 0.0)
    hits = after.prefix_hits_total - (before.prefix_hits_total if before else 0.0)
    if queries <= 0 or hits < 0:
        return None
    return hits / queries


def plan_weights(
    before: Mapping[str, EngineSnapshot],
    after: Mapping[str, EngineSnapshot],
    seconds: float,
    new_pods: Sequence[str],
    *,
    ttft_slo_s: float,
    warm_fraction: float,
    backoff: Mapping[str, float] | None = None,
) -> RampPlan:
    """Weights for the routed replicas (keyed by leader pod) from one measurement interval.

    A new replica whose own TTFT p99 exceeds the SLO is backed off (its rate is
    multiplied down) until it recovers; once every new replica is warm, weights
    return to equal (plain routing).
    """
    pods = sorted(after)
    throughput = {
        p: max(0.0, after[p].generation_tokens_total - before[p].generation_tokens_total) / seconds
        if p in before and seconds > 0
        else 0.0
        for p in pods
    }
    hits = {p: hit_ratio(before.get(p), after[p]) for p in pods}
    established = [p for p in pods if p not in new_pods]
    ref_tokens = median([throughput[p] for p in established]) if established else 0.0
    ref_hits = [h for p in established if (h := hits[p]) is not None]
    ref_hit = median(ref_hits) if ref_hits else None
    mult = dict(backoff or {})
    notes: list[str] = []
    warm: dict[str, bool] = {}
    rates: dict[str, float] = {}
    for p in pods:
        if p not in new_pods:
            rates[p] = throughput[p] or ref_tokens or 1.0
            continue
        h = hits[p]
        if ref_hit and h is not None:
            warmth = min(1.0, h / ref_hit)
            warm[p] = warmth >= warm_fraction
        else:  # no prefix-cache counters: judge by throughput alone
            warmth = min(1.0, throughput[p] / ref_tokens) if ref_tokens else 0.0
            warm[p] = warmth >= warm_fraction
        ttft = window_ttft_p99(before.get(p), after[p])
        m = mult.get(p, 1.0)
        if ttft is not None and ttft > ttft_slo_s:
            m *= BACKOFF_FACTOR
            warm[p] = False
            notes.append(f"{p} TTFT p99 {ttft:.2f}s > SLO {ttft_slo_s:g}s: backing off (x{m:.2f})")
        else:
            m = min(1.0, m * RECOVERY_FACTOR)
        mult[p] = m
        rates[p] = max(throughput[p], ref_tokens * warmth) * m
        notes.append(
            f"{p} cache {warmth:.0%} warm, serving {throughput[p]:.0f} tok/s vs {ref_tokens:.0f} established"
            + (" (warm)" if warm[p] else "")
        )
    all_warm = bool(warm) and all(warm.values())
    if all_warm:
        weights = dict.fromkeys(pods, 1.0)
        notes.append("every new replica is warm: equal weights")
    else:
        floor = min(MIN_SHARE, 0.5 / max(1, len(pods)))
        weights = {p: round(w, 4) for p, w in rate_weights(rates, floor=floor).items()}
    return RampPlan(
        weights=weights,
        rates={p: round(v, 2) for p, v in rates.items()},
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


# ---------------------------------------------------------------- the pool, from two observations


def survivor_loads(before: PoolObservation, after: PoolObservation, lost_ids: set[str]) -> list[SurvivorLoad]:
    """Pressure on every routed serving group that survived (queues, KV, preemptions/s)."""
    seconds = max(1e-3, after.snapshot.observed_at - before.snapshot.observed_at)
    loads = []
    for g in after.snapshot.serving:
        if g.id in lost_ids or not g.routed or g.id not in after.engines:
            continue
        now_e = after.engines[g.id]
        loads.append(survivor_load(g.id, before.engines.get(g.id, now_e), now_e, seconds))
    return loads


def routed_backlog(obs: PoolObservation, lost_ids: Iterable[str] = ()) -> float:
    """Requests waiting in the queues of the routed serving groups (the survivors and what came back)."""
    lost = set(lost_ids)
    return sum(
        obs.engines[g.id].waiting
        for g in obs.snapshot.groups
        if g.routed and g.id not in lost and g.id in obs.engines
    )


def routed_served_rate(
    before: PoolObservation, after: PoolObservation, lost_ids: Iterable[str] = ()
) -> float:
    """Requests/s the routed serving groups completed between two observations.

    A lower bound on what they can serve (they may have had nothing more to do), and the
    capacity itself while their queues are not empty: what the protect step may count on
    when it is more than the configured or estimated figure.
    """
    lost = set(lost_ids)
    seconds = after.snapshot.observed_at - before.snapshot.observed_at
    if seconds <= 0:
        return 0.0
    return sum(
        completion_rate(before.engines[g.id], after.engines[g.id], seconds)
        for g in after.snapshot.groups
        if g.routed and g.id not in lost and g.id in after.engines and g.id in before.engines
    )


def smoothed(previous: float | None, now: float, weight: float = 0.5) -> float:
    """An exponentially weighted mean: ``now`` with ``weight``, the previous mean with the rest."""
    return now if previous is None else weight * now + (1.0 - weight) * previous


def capacity_to_count_on(estimated_rps: float, served_rps: float | None) -> tuple[float, str]:
    """The capacity the admission keeper counts on, and a note when it is not the estimate.

    What the routed replicas served is a floor under their capacity: when it is more than the
    configured or estimated figure, it is the better number.
    """
    if served_rps is None or served_rps <= estimated_rps:
        return estimated_rps, ""
    return served_rps, f"they served {served_rps:.1f} req/s (more than the {estimated_rps:.1f} estimated)"


# Once Temporal suggests continuing as new (the history is thousands of events long), the keeper looks
# this many times its steady interval apart: a recovery stuck for days cannot reach the server's hard
# history limit (51,200 events) through the keeper's looks.
PARKED_FACTOR = 10.0


def next_admission_look(
    current_s: float,
    base_s: float,
    max_s: float,
    *,
    admission_moved: bool,
    backlog: float,
    awaiting_operator: bool = False,
    history_large: bool = False,
) -> float:
    """How long the admission keeper waits before its next look at the queues.

    A look that moved admission, or found requests waiting (the queues absorbing a gap, so the
    refused share is about to move), keeps the base interval; a steady look (nothing moved, queues
    empty) doubles the wait up to ``max_s``. While the procedure awaits an operator, waiting
    requests alone do not hold the base interval (nothing the procedure does will change capacity
    until somebody answers; only a moving admission does). Once the workflow's history is large
    (``history_large``: Temporal's continue-as-new suggestion), the keeper looks every
    ``PARKED_FACTOR`` x ``max_s`` whatever happens: about 130 history events an hour, so days of
    waiting stay far below the server's history limit. Capacity changes re-admit at once whatever
    the keeper's interval.
    """
    if history_large:
        return max(base_s, PARKED_FACTOR * max_s)
    if admission_moved or (backlog >= 1.0 and not awaiting_operator):
        return base_s
    return max(base_s, min(max_s, 2.0 * current_s))


def warm_groups_before(initial: PoolObservation) -> int:
    """The warm floor a recovery restores: the ready groups (serving + spare) before the loss."""
    return len([g for g in initial.snapshot.groups if g.ready])


def recovery_observations(
    initial: PoolObservation,
    before: PoolObservation,
    after: PoolObservation,
    lost_ids: set[str],
    *,
    baseline_waiting: Mapping[str, float],
    quarantined: Iterable[str],
    reconcile: LedgerReconcile,
) -> RecoveryObservations:
    """What step 10's verification checks, from the pool before the loss and two scrapes now."""
    seconds = max(1e-3, after.snapshot.observed_at - before.snapshot.observed_at)
    target = len([g for g in initial.snapshot.serving if g.routed or g.id in lost_ids])
    serving_now = [g for g in after.snapshot.serving if g.id not in lost_ids or g.ready]
    routed_ready = [g for g in serving_now if g.ready and g.routed]
    # The routed endpoint is the group's leader (a Service may select only leaders).
    endpoint_ok = [
        g
        for g in routed_ready
        if (o := after.pods.get(g.leader_pod)) is not None
        and o.endpoint is not None
        and o.endpoint.serving is not False
        and o.endpoint.terminating is not True
    ]
    replicas = []
    for g in routed_ready:
        if g.id not in after.engines:
            continue
        now_e = after.engines[g.id]
        load = survivor_load(g.id, before.engines.get(g.id, now_e), now_e, seconds)
        replicas.append(
            ReplicaObservation(
                group_id=g.id,
                waiting=load.waiting,
                baseline_waiting=baseline_waiting.get(g.id, 0.0),
                preemptions_per_s=load.preemptions_per_s,
                ttft_p99_s=window_ttft_p99(before.engines.get(g.id), now_e),
            )
        )
    failed_nodes = {}
    for node in quarantined:
        info = after.snapshot.node(node)
        failed_nodes[node] = NodeQuarantine(
            cordoned=bool(info and info.unschedulable),
            tainted=bool(info and any(t.key == QUARANTINE_TAINT_KEY for t in info.taints)),
            labelled=bool(info and QUARANTINE_LABEL in info.labels),
        )
    return RecoveryObservations(
        target_groups=target,
        workload_ready_groups=len(routed_ready),
        endpoint_serving_groups=len(endpoint_ok),
        replicas=tuple(replicas),
        ledger=reconcile,
        warm_groups=sum(1 for g in after.snapshot.groups if g.ready),
        failed_nodes=failed_nodes,
    )


def admitted_rate(
    before: Mapping[str, EngineSnapshot], after: Mapping[str, EngineSnapshot], seconds: float
) -> float:
    """Requests/s the routed engines took in over the interval: completions plus in-flight growth."""
    total = 0.0
    for pod, now in after.items():
        prev = before.get(pod)
        if prev is None or seconds <= 0:
            continue
        total += completion_rate(prev, now, seconds) + max(0.0, now.in_flight - prev.in_flight) / seconds
    return total


def ramp_capacity_shape(plan: RampPlan, new_pods: Iterable[str]) -> tuple[int, dict[str, float]]:
    """(established groups, new replica -> warmth 0..1) from a ramp plan's measured rates.

    Warmth is a new replica's measured rate against the established replicas' median rate.
    """
    new = set(new_pods)
    established = [r for p, r in plan.rates.items() if p not in new]
    ref = median(established) if established else 0.0
    warmth = {
        p: (min(1.0, r / ref) if ref > 0 else (1.0 if plan.all_warm else 0.0))
        for p, r in plan.rates.items()
        if p in new
    }
    return len(established), warmth
