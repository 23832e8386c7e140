"""What the routed replicas serve, measured from two engine scrapes, and the capacity counted on.

vLLM exports counters, so every rate here is a difference of two scrapes over
the time between them: ``completion_rate`` (requests/s one engine completed),
``window_ttft_p99`` (its TTFT p99 over the interval, not since start),
``routed_served_rate`` (what the routed groups completed together: a floor
under their capacity). ``per_group_capacity`` is what one warm group sustains
(the operator's load-tested figure, else the busiest group seen) and
``capacity_to_count_on`` what the admission keeper counts on.
"""

from __future__ import annotations

from collections.abc import Iterable

from fleet.engine_metrics import EngineSnapshot
from fleet.observation import PoolObservation


def completion_rate(before: EngineSnapshot, after: EngineSnapshot, seconds: float) -> float:
    return (
        max(0.0, after.request_success_total - before.request_success_total) / seconds if seconds > 0 else 0.0
    )


def window_ttft_p99(before: EngineSnapshot | None, after: EngineSnapshot) -> float | None:
    window = after.ttft.minus(before.ttft) if before is not None else after.ttft
    return window.quantile(0.99) if window.count > 0 else None


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
