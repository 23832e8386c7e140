"""Ramp-back by measured rate: the runbook's validation model and the live weighting function.

After a replica loss the replacement comes up *ready before it is fast*: its
prefix cache is cold, so it serves only a fraction ``c`` of a warm replica's
rate ``R`` and warms up linearly over ``T`` seconds. If the router splits
traffic equally, the replacement's queue grows while it is cold and its
requests miss the deadline; if the router weights each replica by its measured
rate (``rate_weights``), nothing queues. This module is

* ``rate_weights(rates)`` - the one weighting function: each replica's weight is
  its measured rate over the sum of rates. The live ramp-back (replica-loss
  step 9) sets router weights with it; the model below uses it for its
  ``rate`` policy, so the planning tool and the product cannot drift apart.
* ``simulate_ramp(params, policy)`` - the runbook's discrete-time model,
  implemented exactly as published (issue 6), so its figures can be checked
  against the runbook's table. ``fleetmend model ramp`` is its command line.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

K = TypeVar("K")


def rate_weights(rates: Mapping[K, float], floor: float = 0.0) -> dict[K, float]:
    """Weights proportional to each replica's measured service rate, summing to 1.

    ``floor`` (0 <= floor < 1/len(rates)) gives every replica at least that share,
    so a replacement whose rate has not been measured yet still gets a trickle of
    traffic to warm its cache with. When no replica has a measured rate (all
    zero), traffic is split equally - there is nothing better to go on.
    Raises ``ValueError`` for a negative or non-finite rate, or an impossible floor.
    """
    if not rates:
        return {}
    for key, rate in rates.items():
        if not (rate >= 0.0 and rate != float("inf")):
            raise ValueError(f"measured rate of {key!r} must be a finite number >= 0, got {rate!r}")
    n = len(rates)
    if not 0.0 <= floor < 1.0 / n:
        raise ValueError(f"floor must be in [0, 1/{n}) for {n} replicas, got {floor!r}")
    total = sum(rates.values())
    if total <= 0.0:
        return dict.fromkeys(rates, 1.0 / n)
    raw = {key: rate / total for key, rate in rates.items()}
    if floor <= 0.0:
        return raw
    # Lift the replicas below the floor to it and scale the others down to keep the sum at 1.
    lifted = {key: w for key, w in raw.items() if w < floor}
    if not lifted:
        return raw
    rest_total = sum(w for key, w in raw.items() if key not in lifted)
    budget = 1.0 - floor * len(lifted)
    return {key: (floor if key in lifted else w * budget / rest_total) for key, w in raw.items()}


class RampPolicy(StrEnum):
    """How the router splits arrivals while the replacement warms up."""

    EQUAL = "equal"  # 1/(W+1) each: what a plain round-robin / least-request router does
    RATE = "rate"  # proportional to measured service rate: rate_weights()


class RampParams(BaseModel):
    """One scenario of the ramp-back model. Defaults are the runbook's published case."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    warm_rate: float = Field(
        default=20.0, gt=0, allow_inf_nan=False, description="R: requests/s a warm replica serves"
    )
    cold_fraction: float = Field(
        default=0.25, gt=0, le=1, description="c: the replacement's rate at start, as a fraction of R"
    )
    warmup_s: float = Field(
        default=120.0, ge=0, allow_inf_nan=False, description="T: seconds until the replacement is warm"
    )
    deadline_s: float = Field(
        default=30.0, gt=0, allow_inf_nan=False, description="D: queue wait beyond this is late"
    )
    warm_replicas: int = Field(default=3, ge=1, le=10_000, description="W: warm survivors")
    seconds: int = Field(
        default=600, gt=0, le=604_800, description="S: horizon in 1-second steps (at most a week)"
    )
    arrival: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="A: arrivals/s; default W x R (the survivors carry the load, the replacement is headroom)",
    )

    @property
    def arrival_rate(self) -> float:
        return self.warm_replicas * self.warm_rate if self.arrival is None else self.arrival

    def replacement_rate(self, t: float) -> float:
        """The replacement's service rate at second ``t``: cold at c x R, linear to R over T."""
        if self.warmup_s <= 0:
            return self.warm_rate
        c = self.cold_fraction
        return self.warm_rate * (c + (1.0 - c) * min(t, self.warmup_s) / self.warmup_s)


class RampResult(BaseModel):
    """The model's figures; ``--json`` prints exactly these five keys."""

    model_config = ConfigDict(frozen=True)

    served: float
    late: float
    goodput: float
    peak_wait_new: float
    final_depth_new: float


class RampTrace(BaseModel):
    """A run's figures plus the replacement's queue wait at every second (for the plot)."""

    model_config = ConfigDict(frozen=True)

    policy: RampPolicy
    params: RampParams
    result: RampResult
    wait_new: list[float]


def simulate_ramp_trace(params: RampParams, policy: RampPolicy) -> RampTrace:
    """Run the model second by second, exactly as the runbook specifies it.

    Each step: rates (W warm at R, then the replacement last), shares by policy,
    then for each replica in order: queue update, wait = queue/rate, done =
    min(queue + arrivals, rate) with the queue just updated, late if wait > D.
    """
    w = params.warm_replicas
    arrivals = params.arrival_rate
    deadline = params.deadline_s
    new = w  # the replacement is the last replica
    queues = [0.0] * (w + 1)
    served = late = peak_wait = 0.0
    waits: list[float] = []
    for t in range(params.seconds):
        rates = [params.warm_rate] * w + [params.replacement_rate(t)]
        if policy is RampPolicy.EQUAL:
            shares = [1.0 / (w + 1)] * (w + 1)
        else:
            weights = rate_weights(dict(enumerate(rates)))
            shares = [weights[i] for i in range(w + 1)]
        for i, rate in enumerate(rates):
            offered = arrivals * shares[i]
            queues[i] = max(0.0, queues[i] + offered - rate)
            wait = queues[i] / rate
            if i == new:
                peak_wait = max(peak_wait, wait)
                waits.append(wait)
            done = min(queues[i] + offered, rate)
            served += done
            if wait > deadline:
                late += done
    result = RampResult(
        served=served,
        late=late,
        goodput=served - late,
        peak_wait_new=peak_wait,
        final_depth_new=queues[new],
    )
    return RampTrace(policy=policy, params=params, result=result, wait_new=waits)


def simulate_ramp(params: RampParams, policy: RampPolicy) -> RampResult:
    """The model's five figures for one policy."""
    return simulate_ramp_trace(params, policy).result
