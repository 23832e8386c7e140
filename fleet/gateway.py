"""What fleetmend sets in the gateway and reads back from it: policy, routing set, request outcomes.

fleetmend's gateway is Envoy, driven over xDS by its control plane (``gateway/``); the adapters in
``activities/`` hand the procedures these shapes: the policy as applied (``GatewayPolicy``, and
``RouterState`` for an observation), the engines a new request can reach (``RoutingSet``), and
one request's outcome as Envoy's access log records it (``JournalEntry``).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleet.vocabulary import Tier


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Admission(_Wire):
    """Gateway admission: tiers refused outright, part of one tier refused, and the queue bound.

    ``shed_tiers`` are refused whole. ``partial_shed`` refuses that share (0..1) of one more tier's
    requests, so the gateway can refuse exactly the capacity gap instead of a whole tier (on
    Envoy: a direct-response route taken for a runtime fraction of the tier's requests).
    """

    shed_tiers: list[Tier] = Field(default_factory=list)
    partial_shed: dict[Tier, float] = Field(
        default_factory=dict, description="tier -> share of its requests refused (0 < share < 1)"
    )
    queue_bound: int | None = Field(default=None, ge=0)

    @field_validator("partial_shed")
    @classmethod
    def _shares_are_partial(cls, value: dict[Tier, float]) -> dict[Tier, float]:
        bad = {tier: share for tier, share in value.items() if not 0.0 < share < 1.0}
        if bad:
            raise ValueError(
                f"partial_shed shares must lie strictly between 0 and 1 (got {bad}); "
                "list a tier refused whole in shed_tiers, and leave out a tier not shed at all"
            )
        return value

    def shed_share(self, tier: Tier) -> float:
        """The share of ``tier``'s requests this admission refuses (1.0 for a whole shed tier)."""
        if tier in self.shed_tiers:
            return 1.0
        return self.partial_shed.get(tier, 0.0)


class RetryPolicy(_Wire):
    """How the gateway retries a request whose replica failed.

    A retry is only ever allowed before the first byte reached the caller;
    ``retry_before_first_byte=False`` disables retries altogether.
    """

    retry_before_first_byte: bool = True
    budget_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    max_attempts: int = Field(default=2, ge=1, le=10)
    backoff_base_s: float = Field(default=0.05, ge=0.0)
    backoff_max_s: float = Field(default=1.0, ge=0.0)
    jitter: bool = True


class RouterState(_Wire):
    """The gateway's policy for one pool as an observation sees it. Absolute values only."""

    pool: str
    version: int
    weights: dict[str, float] = Field(default_factory=dict)
    admission: Admission = Field(default_factory=Admission)
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    admitted_requests_total: int = Field(
        0, description="A counter, not configuration: requests past admission (first attempts), ever"
    )


class GatewayPolicy(_Wire):
    """What fleetmend sets in the gateway for one pool: ramp weights, admission, retry policy.

    Absolute values, replaced whole: re-applying the same policy is a no-op, so a retried write
    cannot compound. A pod the weights do not name gets the mean of the named ones.
    """

    weights: dict[str, float] = Field(default_factory=dict)
    admission: Admission = Field(default_factory=Admission)
    retry: RetryPolicy = Field(default_factory=RetryPolicy)


class RoutedEndpoint(_Wire):
    pod: str
    address: str
    node: str | None = None
    weight: float = 1.0


class RoutingSet(_Wire):
    """EndpointSlice-ready endpoints of the pool's Service that carry the router-only label."""

    pool: str
    version: int
    endpoints: list[RoutedEndpoint]


class Outcome(StrEnum):
    COMPLETED = "completed"
    LATE = "late"
    RETRIED = "retried"
    TERMINAL_ERROR = "terminal_error"
    SHED = "shed"
    REJECTED = "rejected"


class JournalEntry(_Wire):
    """One attempt's outcome as the gateway recorded it (Envoy: one access-log line)."""

    request_id: str
    pool: str
    tier: Tier
    outcome: Outcome
    replica: str | None = None
    attempt: int = 1
    started_at: float
    ended_at: float
    ttft_s: float | None = None
    tokens_streamed: int = 0
    bytes_sent: int = Field(default=0, ge=0, description="response body bytes the caller got")
    truncated: bool = False
    # Operation ids of the effects the request proposed (``fleet.recovery_observations`` counts them among
    # the requests in flight at a loss): the ledger's rows under ``request_operation_ids(request_id)``,
    # joined to Envoy's access log by the request id Envoy preserves across its retries (gateway.store).
    effect_operation_ids: list[str] = Field(default_factory=list)
    detail: str = ""


# A request proposes its effects under ``<request id>/<n>``, n = 0 .. REQUEST_EFFECT_SLOTS - 1 (an agent's
# tool calls in order; the effect API's ``request_id`` defaults to the id before the last '/'). The
# journal reads them back by these exact keys, so the lookup is the ledger's primary key, never a scan.
REQUEST_EFFECT_SLOTS = 8


def request_operation_ids(request_id: str) -> list[str]:
    return [f"{request_id}/{n}" for n in range(REQUEST_EFFECT_SLOTS)]
