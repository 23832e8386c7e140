"""Wire models of the simulated world's HTTP APIs and the request records fleetmend reads.

fleetmend's adapters (``activities/``) speak real interfaces: Kubernetes, Envoy (xDS and its
admin API), Prometheus text, Slack-compatible webhooks. The models here are the shapes those
adapters hand the procedures (``RoutingSet``, ``JournalEntry`` - one request as Envoy's access
log records it - ``RouterState``, the policy as applied) and the simulator's own control API.

The simulator's router (``sim/serving``) serves the ``/router/v1`` paths below for the
simulator's own tests and cost benches only: no fleetmend adapter calls them, and on every
path fleetmend runs (dev, demo, tests, benches) user traffic goes through Envoy.

Paths (all JSON; the sim serves them on its one port):

Simulator router, per pool (``{namespace}/{service}``; sim tests only):
  GET  /router/v1/pools/{ns}/{svc}/state           -> RouterState
  PUT  /router/v1/pools/{ns}/{svc}/weights         <- WeightsChange      (409 if stale)
  PUT  /router/v1/pools/{ns}/{svc}/admission       <- AdmissionChange    (409 if stale)
  PUT  /router/v1/pools/{ns}/{svc}/retry-policy    <- RetryPolicyChange  (409 if stale)
  GET  /router/v1/pools/{ns}/{svc}/routing-set     -> RoutingSet
  GET  /router/v1/journal?pool=&replica=&since=&until=&outcome=  -> JournalPage
  POST /v1/completions                             OpenAI-compatible, SSE when stream=true;
                                                   the tier in the x-fleetmend-tier header

Engines, each at its own pod IP as in a cluster (``http://{podIP}:8000``, the port configurable):
  POST /v1/completions  GET /v1/models  GET /metrics (vLLM Prometheus text)  GET /health

Nodes (in production: the node exporter's own port):
  GET  /nodes/{node}/metrics      DCGM-exporter text

Simulator control (test and demo only):
  GET  /sim/v1/clock -> SimClock      POST /sim/v1/faults <- FaultRequest
  GET  /sim/v1/actions?since_seq=     -> list[ActionLogEntry]
  POST /sim/v1/notify <- NotifyMessage (Slack-compatible: {"text": ...})
  GET  /sim/v1/notify -> list[NotifyMessage]
  POST /sim/v1/tickets  (header Idempotency-Key) <- {"title","body"} -> {"id","idempotency_key",...}
  GET  /sim/v1/tickets?idempotency_key=K -> list of tickets (the probe for unknown outcomes)
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleet.vocabulary import FaultKind, Tier


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
    """The router's versioned configuration for one pool. Absolute values only."""

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


class WeightsChange(_Wire):
    replaces_version: int
    weights: dict[str, float]


class AdmissionChange(_Wire):
    replaces_version: int
    admission: Admission


class RetryPolicyChange(_Wire):
    replaces_version: int
    retry: RetryPolicy


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
    """One attempt's outcome as the gateway journaled it."""

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
    effect_operation_ids: list[str] = Field(default_factory=list)
    detail: str = ""


class JournalPage(_Wire):
    entries: list[JournalEntry]
    next_since: float | None = None


class SimClock(_Wire):
    now: float
    speed: float


class FaultRequest(_Wire):
    kind: FaultKind
    target: str
    params: dict[str, Any] = Field(default_factory=dict)
    at: float | None = None  # sim time; None = now


class ActionLogEntry(_Wire):
    """A mutating request the simulated API received: the world's own record."""

    seq: int
    time: float
    verb: str
    path: str
    body_digest: str
    client: str
    status: int


class NotifyMessage(_Wire):
    model_config = ConfigDict(extra="allow")
    text: str


class QualificationState(StrEnum):
    RUNNING = "running"
    PASSED = "passed"
    FAILED = "failed"
