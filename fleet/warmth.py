"""How warm the new replicas are, measured, and the ramp-back weights that follow (replica-loss step 9).

Pure functions over engine scrapes (``EngineSnapshot`` pairs taken an interval
apart). The ramp uses the same ``rate_weights`` as the what-if model in
``fleet.ramp``.

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

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_metrics import EngineSnapshot
from fleet.observation import PoolObservation
from fleet.ramp import rate_weights
from fleet.service_rate import window_ttft_p99

# A new replica whose TTFT p99 breaks the SLO gets its weight multiplied by this, per interval.
BACKOFF_FACTOR = 0.5
# Each calm interval lets a backed-off replica regain this much of its multiplier (up to 1).
RECOVERY_FACTOR = 1.5
MIN_SHARE = 0.02


def new_leaders(initial: PoolObservation, now: PoolObservation) -> set[str]:
    """Leader pods that did not exist (same name and uid) when the procedure started."""
    return {
        g.leader_pod
        for g in now.snapshot.groups
        if initial.pod_uids.get(g.leader_pod) != now.pod_uids.get(g.leader_pod)
    }


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
    by_deadline: bool = False,
) -> RampPlan:
    """Weights for the routed replicas (keyed by leader pod) from one measurement interval.

    A new replica whose own TTFT p99 exceeds the SLO, and the established replicas' median p99, is
    backed off (its rate is multiplied down) until it recovers. One over the SLO but no slower than
    the established replicas is not: the whole pool is overloaded (a gap's backlog), and backing the
    new replica off would only hand its share to replicas that are as late. Once every new replica
    is warm, weights return to equal (plain routing).

    ``by_deadline``: the engines serve their queues earliest deadline first
    (``ServingObjectives.engine_queue_order``). Then, while the established replicas are over the SLO,
    a new replica that answers no slower than they do is weighted at their rate, not at its cache's
    warmth: a measured share would keep the gap's backlog on the later replicas, and a deadline-ordered
    queue on the new one only defers what can wait. (In arrival order the same full share measured
    worse: the cold replica's own batch then made all of its requests late; README "Graded by the
    world".)
    """
    pods = sorted(after)
    # A replica read now but not at the interval's start (its scrape failed then, on a busy node) has
    # no rate for this interval: unknown, not idle. Counted as 0, one such established replica made a
    # loaded pool read as idle and handed a cold replacement an equal share.
    known = {
        p: max(0.0, after[p].generation_tokens_total - before[p].generation_tokens_total) / seconds
        for p in pods
        if p in before and seconds > 0
    }
    throughput = {p: known.get(p, 0.0) for p in pods}
    hits = {p: hit_ratio(before.get(p), after[p]) for p in pods}
    established = [p for p in pods if p not in new_pods]
    measured = [known[p] for p in established if p in known]
    ref_tokens = median(measured) if measured else 0.0
    ref_hits = [h for p in established if (h := hits[p]) is not None]
    ref_hit = median(ref_hits) if ref_hits else None
    mult = dict(backoff or {})
    # The established replicas' own TTFT p99 over the interval: a new replica is backed off for being
    # slower than they are, not for an overloaded pool (see the backoff below).
    peer_ttfts = [t for p in established if (t := window_ttft_p99(before.get(p), after[p])) is not None]
    peer_ttft = median(peer_ttfts) if peer_ttfts else None
    notes: list[str] = []
    warm: dict[str, bool] = {}
    rates: dict[str, float] = {}
    # An idle pool (its established replicas served nothing this interval) has no rate to match:
    # a new replica that is not slower than nothing is as warm as the traffic needs.
    idle = bool(measured) and ref_tokens == 0.0
    for p in pods:
        if p not in new_pods:
            rates[p] = throughput[p] or ref_tokens or 1.0
            continue
        h = hits[p]
        if idle:
            warmth = 1.0
            warm[p] = True
        elif ref_hit and h is not None:
            warmth = min(1.0, h / ref_hit)
            warm[p] = warmth >= warm_fraction
        else:  # no prefix-cache counters: judge by throughput alone
            warmth = min(1.0, throughput[p] / ref_tokens) if ref_tokens else 0.0
            warm[p] = warmth >= warm_fraction
        ttft = window_ttft_p99(before.get(p), after[p])
        m = mult.get(p, 1.0)
        backed_off = ttft is not None and ttft > ttft_slo_s and (peer_ttft is None or ttft > peer_ttft)
        # In deadline order, with the established replicas over the SLO (a gap's backlog), a replica not
        # backed off is no slower than they are: it takes their rate and drains that backlog.
        helps_backlog = by_deadline and not backed_off and peer_ttft is not None and peer_ttft > ttft_slo_s
        if backed_off:
            m *= BACKOFF_FACTOR
            warm[p] = False
            notes.append(f"{p} TTFT p99 {ttft:.2f}s > SLO {ttft_slo_s:g}s: backing off (x{m:.2f})")
        else:
            if ttft is not None and ttft > ttft_slo_s and peer_ttft is not None:
                # Over the SLO but no slower than the established replicas: the pool is overloaded, not
                # this replica cold. Backing it off would move its share onto replicas as late as it.
                notes.append(
                    f"{p} TTFT p99 {ttft:.2f}s > SLO {ttft_slo_s:g}s, no slower than the established "
                    f"replicas' {peer_ttft:.2f}s: the pool is overloaded, not this replica cold (no backoff)"
                )
            m = min(1.0, m * RECOVERY_FACTOR)
        mult[p] = m
        rates[p] = max(throughput[p], ref_tokens * (1.0 if helps_backlog else warmth)) * m
        notes.append(
            f"{p} idle pool: no traffic to ramp"
            if idle
            else f"{p} cache {warmth:.0%} warm, serving {throughput[p]:.0f} tok/s vs {ref_tokens:.0f} established"
            + (" (warm)" if warm[p] else "")
            + (
                f"; weighted at the established rate: they are over the SLO ({peer_ttft:.2f}s) and it is not slower"
                if helps_backlog and peer_ttft is not None
                else ""
            )
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
