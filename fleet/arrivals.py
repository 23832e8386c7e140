"""Requests arriving at the pool: counted by the gateway, or estimated from the engines.

A loss takes service rate away, never arrivals, so the protect step needs the
arrival rate as it was: ``arrival_rate`` from two observations (the gateway's
admitted counter when it keeps one, else the survivors' completions plus queue
growth), ``ArrivalTally`` counted across an incident one reading after another,
and ``admitted_rate``, what the routed engines took in over one ramp interval.
``arrivals_before`` is the rate the gateway counted before a loss was detected, from readings
of its counter kept ahead of any incident (the fast path's): the rate the pool keeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_metrics import EngineSnapshot
from fleet.gateway import RouterState
from fleet.incident import LossReport, PreLossArrivals
from fleet.observation import PoolObservation
from fleet.service_rate import completion_rate


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


# The window ``arrivals_before`` counts: it ends at least PRE_LOSS_GAP_S before the first sign of the
# loss (a fault cuts streams, and their clients retry, before Envoy's health check or the fast path
# notices: on the shipped 1 s health check within about 2 s) and at most PRE_LOSS_STALE_S after that
# (older readings say nothing about now: the history had a hole), spans up to PRE_LOSS_WINDOW_S, and
# counts for nothing under PRE_LOSS_MIN_S (an open-loop load's count over a shorter window is noise).
# ``planned_arrivals`` takes a count no older than PRE_LOSS_MAX_AGE_S when the recovery first looks.
PRE_LOSS_GAP_S = 2.0
PRE_LOSS_STALE_S = 3.0
PRE_LOSS_WINDOW_S = 8.0
PRE_LOSS_MIN_S = 3.0
PRE_LOSS_MAX_AGE_S = 30.0


class CounterReading(BaseModel):
    """One reading of a pool's admitted-requests counter, summed over every gateway (unix seconds)."""

    model_config = ConfigDict(frozen=True)

    at: float
    total: int = Field(ge=0)


def arrivals_before(
    readings: Sequence[CounterReading],
    detected_at: float,
    *,
    gap_s: float = PRE_LOSS_GAP_S,
    window_s: float = PRE_LOSS_WINDOW_S,
    min_s: float = PRE_LOSS_MIN_S,
    stale_s: float = PRE_LOSS_STALE_S,
) -> PreLossArrivals | None:
    """The rate over readings (oldest first) in a window that ends ``gap_s`` (at most ``gap_s +
    stale_s``) before ``detected_at``, the loss's first sign, and spans at most ``window_s``; None
    when there is no such reading or it spans less than ``min_s``. A counter that went backwards (a
    gateway restarted) starts the window anew after the drop, and readings before the counter first
    moved in the window are left out: a load that began inside it (a pool just put in service, a
    bench's users starting) is counted from its start, not diluted by the idle seconds before."""
    kept = [r for r in readings if r.at <= detected_at - gap_s]
    if not kept or detected_at - kept[-1].at > gap_s + stale_s:
        return None
    end = kept[-1]
    start = end
    window = [end]
    for r in reversed(kept[:-1]):
        if r.total > window[-1].total or end.at - r.at > window_s:
            break
        window.append(r)
    window.reverse()
    while len(window) > 1 and window[1].total == window[0].total:
        window.pop(0)
    start = window[0]
    seconds = end.at - start.at
    if seconds <= 0 or seconds < min_s:
        return None
    return PreLossArrivals(
        rps=(end.total - start.total) / seconds,
        seconds=seconds,
        ended_at=end.at,
        ended_before_s=detected_at - end.at,
    )


def planned_arrivals(
    reports: Iterable[LossReport],
    router: RouterState | None,
    looked_at: float,
    max_age_s: float = PRE_LOSS_MAX_AGE_S,
) -> PreLossArrivals | None:
    """The arrivals to plan the first shed on: the pre-loss count of the earliest report that carries
    one, when its window ended at most ``max_age_s`` before the recovery's first look (``looked_at``)
    and the gateway refused nothing at that look. Then its counter counted every arrival: a report
    that waited in the incident behind another recovery is older, and its window may have been
    shed; a pool still shedding let through less than arrived. Otherwise the short count since the
    loss, scaled by the refused share, is used, as before."""
    if router is not None and (router.admission.shed_tiers or router.admission.partial_shed):
        return None
    carrying = [r.arrivals_before for r in reports if r.arrivals_before is not None]
    fresh = [p for p in carrying if looked_at - p.ended_at <= max_age_s]
    return min(fresh, key=lambda p: p.ended_at) if fresh else None


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

    @classmethod
    def counted_before(cls, pre: PreLossArrivals) -> ArrivalTally:
        """A tally that starts with the window counted before the loss: the requests a burst after
        the loss adds (the cut streams sent again) weigh against the whole count, not a second of it."""
        return cls(requests=pre.rps * pre.seconds, seconds=pre.seconds)

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
