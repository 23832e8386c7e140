"""Readiness is not liveness: a replica is *ready* only if it can take more work.

* **live**  - the engine process answers (``/health`` 200). Liveness failures
  restart containers; fleetmend never touches liveness.
* **ready** - live AND the engine accepts traffic AND its KV-cache usage is under
  a ceiling AND its waiting queue is under a bound. A replica at 98 % KV is live
  but not ready: sending it more requests only makes it preempt and recompute.

Defaults follow the gateway inference extension's saturation detector
(reference/peers.md): KV ceiling 0.8, queue bound 5. fleetmend writes the
verdict into the pod readiness gate ``fleetmend.io/serving-ready`` so that
Kubernetes itself (EndpointSlice ``serving``/``ready``) stops routing to a
saturated replica.

**Hysteresis** keeps the gate from flapping: a ready replica turns not-ready as
soon as it reaches the ceiling or the bound, but a not-ready one turns ready
again only once KV usage is below ``kv_release`` and the queue at most
``queue_release`` for ``stable_samples`` consecutive samples. Missing metrics
keep the previous verdict (a scrape hiccup must not deroute a whole pool);
a replica never seen before with no metrics is not ready.

``next_readiness(state, sample, thresholds)`` is the whole policy: it returns
the new ``ReadinessState`` with a reason. The activity loop stores the state per
pod and patches the gate only when ``changed`` is True.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ReadinessThresholds(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_ceiling: float = Field(default=0.8, gt=0, le=1, description="Not ready at or above this KV usage")
    queue_bound: int = Field(default=5, ge=1, description="Not ready at or above this many waiting requests")
    kv_release: float = Field(default=0.7, gt=0, le=1, description="Ready again only below this KV usage")
    queue_release: int = Field(default=2, ge=0, description="Ready again only at or below this queue")
    stable_samples: int = Field(default=2, ge=1, description="Consecutive calm samples before ready again")

    @model_validator(mode="after")
    def _bands(self) -> ReadinessThresholds:
        if self.kv_release > self.kv_ceiling:
            raise ValueError(f"kv_release {self.kv_release} must not exceed kv_ceiling {self.kv_ceiling}")
        if self.queue_release >= self.queue_bound:
            raise ValueError(
                f"queue_release {self.queue_release} must be below queue_bound {self.queue_bound}"
            )
        return self


class EngineSample(BaseModel):
    """One observation of a replica. ``kv_usage``/``waiting`` None = metrics could not be read."""

    model_config = ConfigDict(frozen=True)

    live: bool
    accepting: bool = Field(
        default=True, description="Engine takes new requests (not shutting down / draining)"
    )
    kv_usage: float | None = Field(default=None, ge=0)
    waiting: float | None = Field(default=None, ge=0)


class ReadinessState(BaseModel):
    model_config = ConfigDict(frozen=True)

    ready: bool = False
    live: bool = False
    calm_streak: int = Field(default=0, ge=0)
    changed: bool = False
    reason: str = "not observed yet"


def next_readiness(
    state: ReadinessState | None, sample: EngineSample, thresholds: ReadinessThresholds | None = None
) -> ReadinessState:
    t = thresholds or ReadinessThresholds()
    prev = state or ReadinessState()

    def result(ready: bool, streak: int, reason: str) -> ReadinessState:
        changed = ready != prev.ready or state is None
        return ReadinessState(
            ready=ready, live=sample.live, calm_streak=streak, changed=changed, reason=reason
        )

    if not sample.live:
        return result(False, 0, "engine does not answer /health (not live)")
    if not sample.accepting:
        return result(False, 0, "engine is not accepting new requests (draining or shutting down)")
    if sample.kv_usage is None or sample.waiting is None:
        if state is None:
            return result(False, 0, "no engine metrics yet")
        return result(
            prev.ready,
            prev.calm_streak,
            f"engine metrics unavailable; keeping {'ready' if prev.ready else 'not ready'}",
        )
    kv, waiting = sample.kv_usage, sample.waiting
    figures = f"KV {kv:.0%}, {waiting:g} waiting"
    if kv >= t.kv_ceiling or waiting >= t.queue_bound:
        which = []
        if kv >= t.kv_ceiling:
            which.append(f"KV {kv:.0%} >= ceiling {t.kv_ceiling:.0%}")
        if waiting >= t.queue_bound:
            which.append(f"{waiting:g} waiting >= bound {t.queue_bound}")
        return result(False, 0, "saturated: " + " and ".join(which))
    if state is None or prev.ready:
        return result(True, prev.calm_streak + 1, f"has headroom ({figures})")
    calm = kv < t.kv_release and waiting <= t.queue_release
    if not calm:
        return result(
            False,
            0,
            f"recovering but not below the release band yet ({figures}; needs KV < {t.kv_release:.0%} "
            f"and <= {t.queue_release} waiting)",
        )
    streak = prev.calm_streak + 1
    if streak >= t.stable_samples:
        return result(True, streak, f"has headroom ({figures})")
    return result(False, streak, f"calm for {streak} of {t.stable_samples} samples ({figures})")
