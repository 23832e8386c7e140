"""Step 4 of the replica-loss procedure: how much retrying the survivors can absorb.

The lost replica's requests that had not yet sent a byte to their caller may be
retried on a survivor; a request that already streamed is a terminal error,
never a silent replay (``RetryPolicy.retry_before_first_byte`` is always True
here; fleetmend never enables mid-stream retries). The *amount* of retrying is
bounded by a budget drawn from the survivors' queue headroom:

    headroom slots = sum over survivors that are not saturated of
                     (queue_bound - waiting), 0 for a survivor at/over its KV ceiling
    budget_fraction = min(max_fraction, headroom / active requests of the pool)

No headroom disables retries altogether (the gateway answers at once instead
of piling retries onto saturated survivors). ``decide_retry_policy`` returns the
``fleet.gateway.RetryPolicy`` to set in the gateway and the arithmetic as text.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from fleet.gateway import RetryPolicy
from fleet.shedding import SurvivorLoad


class RetryDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    policy: RetryPolicy
    headroom_slots: float
    active_requests: float
    reason: str


def decide_retry_policy(
    survivors: Sequence[SurvivorLoad],
    lost_in_flight: float = 0.0,
    queue_bound: int = 5,
    kv_ceiling: float = 0.8,
    max_fraction: float = 0.2,
    max_attempts: int = 2,
    backoff_base_s: float = 0.05,
    backoff_max_s: float = 1.0,
) -> RetryDecision:
    """Retry budget from the survivors' queue headroom; ``lost_in_flight`` = the lost replica's requests."""
    if queue_bound < 1 or not 0 < kv_ceiling <= 1 or not 0 <= max_fraction <= 1 or lost_in_flight < 0:
        raise ValueError("queue_bound >= 1, 0 < kv_ceiling <= 1, 0 <= max_fraction <= 1, lost_in_flight >= 0")
    per: list[str] = []
    headroom = 0.0
    for s in survivors:
        if s.kv_usage is not None and s.kv_usage >= kv_ceiling:
            per.append(f"{s.group_id} 0 (KV {s.kv_usage:.0%} >= {kv_ceiling:.0%})")
            continue
        free = max(0.0, queue_bound - s.waiting)
        headroom += free
        per.append(f"{s.group_id} {free:g}")
    active = sum(s.running + s.waiting for s in survivors) + lost_in_flight
    fraction = min(max_fraction, headroom / active) if active > 0 else max_fraction
    if headroom <= 0:
        policy = RetryPolicy(
            retry_before_first_byte=False,
            budget_fraction=0.0,
            max_attempts=1,
            backoff_base_s=backoff_base_s,
            backoff_max_s=backoff_max_s,
            jitter=True,
        )
        reason = (
            f"no queue headroom on the survivors ({'; '.join(per) or 'none'}): retries disabled, "
            "failed requests end at once instead of piling onto saturated replicas"
        )
    else:
        policy = RetryPolicy(
            retry_before_first_byte=True,
            budget_fraction=round(fraction, 4),
            max_attempts=max_attempts,
            backoff_base_s=backoff_base_s,
            backoff_max_s=backoff_max_s,
            jitter=True,
        )
        reason = (
            f"queue headroom {headroom:g} slot(s) (bound {queue_bound}: {'; '.join(per)}) over "
            f"{active:g} active request(s) -> retry budget {policy.budget_fraction:.1%} "
            f"(cap {max_fraction:.0%}), {max_attempts} attempts, before the first byte only, "
            f"backoff {backoff_base_s:g}-{backoff_max_s:g} s with jitter"
        )
    return RetryDecision(policy=policy, headroom_slots=headroom, active_requests=active, reason=reason)
