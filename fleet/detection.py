"""The fast path's loss detection: evidence about one entity in, loss / not-a-loss / wait out.

The alert path learns of a loss after the node-monitor grace, a Prometheus scrape
and rule ``for:``, and Alertmanager's ``group_wait``. The fast path watches the
same world directly (Nodes, Pods and EndpointSlices of the managed pools, the
gateway's own view of every engine's health) and feeds what it sees here, one
``Evidence`` at a time, per entity (a pod or a node). ``observe`` is pure: the
caller keeps the ``EntityState`` and acts on the ``Detection``; when the state says
``confirming``, the caller checks the engine's ``/health`` itself and feeds the
answers back (``HEALTH_OK`` / ``HEALTH_FAILED``) until it no longer does.

Policy (``DetectionPolicy``):

* a node whose Ready condition is Unknown or False is lost at once (the node
  controller already waited its grace period);
* a GPU problem condition on a node serving a managed pool (``GpuXid``, an ECC or
  NVLink condition a node problem detector sets, ``fleet.qualification.gpu_problem_conditions``)
  is a loss of that node at once once the caller has seen an engine there fail its own
  ``/health`` twice, an interval apart (the fast path checks the node's routed engines first,
  once per spell of the condition): the incident's recovery confirms, replica by replica, which groups on it are lost.
  While every engine there answers, the condition is a signal about the node, not a lost
  replica: nothing is opened (the node's fence asks the removal breaker), so a bad health
  check on most of the fleet opens no incident;
* a pod that is gone while it was still routed (force-deleted with the router-only
  label on: nobody derouted it first) is lost at once;
* a worker rank of a multi-node group whose container restarted is a loss of the
  group's routed leader at once (its communicator is broken; the leader's own
  ``/health`` may answer a moment longer, and a LeaderWorkerSet re-creating the
  group terminates the leader gracefully, which alone would read as planned);
* a pod *terminated gracefully* (its EndpointSlice endpoint says ``terminating``, or it
  was deleted with a grace period) is a disruption somebody planned — a rollout, a
  scale-down, ``kubectl delete pod`` — and its controller replaces it: not a loss,
  unless it was already failing checks (then its controller is replacing a broken
  replica, as a LeaderWorkerSet re-creates a group whose rank died: a loss);
* the gateway taking an engine out of rotation (Envoy's active health check failing
  it, or its outlier detection ejecting it: ``GATEWAY_UNHEALTHY``) makes it a
  *suspect*: no failure is counted on the gateway's word alone (an outlier ejection
  can hit a replica that is only slow), the entity is ``confirming`` and its own
  ``/health`` checks decide; an EndpointSlice endpoint turning not-ready counts as one
  failure and is confirmed the same way. The gateway's health check passing
  (``GATEWAY_HEALTHY``) says the engine is present and has answered;
* an engine is lost after ``failures_to_confirm`` consecutive failed health checks
  (an EndpointSlice endpoint turning not-ready counts as one failure) — once it has
  answered a health check at all: a replica still starting is not lost;
* a health check that answers, however slowly, resets the failure count: a slow
  but present replica is **not a loss** (recorded once per slow spell, so the
  record says why nothing was opened);
* **hysteresis**: once a loss is reported for an entity, further failures report
  nothing (the incident is open and absorbs them); the entity is re-armed only
  after ``successes_to_clear`` consecutive good checks (the gateway's health check
  passing again counts as one and sets ``confirming``, so the direct checks supply
  the rest). A flapping check
  (fail, ok, fail, ok, ...) never reaches two consecutive failures, so it opens
  nothing; one that flaps after a confirmed loss does not report it again.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

# How many pieces of evidence a state keeps for the record (the most recent ones).
EVIDENCE_KEPT = 6


class EvidenceKind(StrEnum):
    HEALTH_OK = "health-ok"
    HEALTH_FAILED = "health-failed"
    ENDPOINT_NOT_READY = "endpoint-not-ready"
    NODE_NOT_READY = "node-not-ready"
    NODE_READY = "node-ready"
    NODE_GPU_FAULT = "node-gpu-fault"  # a node problem detector's GPU condition (GpuXid...) is True
    RANK_FAILED = "rank-failed"  # a worker rank of the entity's multi-node group restarted its container
    POD_GONE = "pod-gone"
    POD_TERMINATED = "pod-terminated"  # gracefully: a terminating endpoint, a deletion with a grace period
    # The gateway (Envoy) took the engine out of rotation: its active health check fails it, or its
    # outlier detection ejected it. A suspect, confirmed by the engine's own /health.
    GATEWAY_UNHEALTHY = "gateway-unhealthy"
    GATEWAY_HEALTHY = "gateway-healthy"  # the gateway's health check passes: present, and it has answered


# Evidence that is a loss on its own, without a second check.
_AT_ONCE = {
    EvidenceKind.NODE_NOT_READY: "node Ready is not True",
    EvidenceKind.NODE_GPU_FAULT: "GPU fault on a serving node",
    EvidenceKind.POD_GONE: "pod gone while routed",
    EvidenceKind.RANK_FAILED: "a rank of its multi-node group failed",
}


# Evidence that the entity is there and answering: it ends a spell of failing evidence.
_PRESENT = {EvidenceKind.HEALTH_OK, EvidenceKind.GATEWAY_HEALTHY, EvidenceKind.NODE_READY}


class Verdict(StrEnum):
    LOSS = "loss"
    NOT_A_LOSS = "not-a-loss"
    WAIT = "wait"


class Evidence(BaseModel):
    """One observation about one entity (``pod:<ns>/<name>`` or ``node:<name>``)."""

    model_config = ConfigDict(frozen=True)

    entity: str = Field(min_length=1)
    kind: EvidenceKind
    at: float = Field(description="Unix seconds it was observed")
    latency_s: float | None = Field(None, ge=0, description="Health check round trip, when it answered")
    detail: str = ""

    def describe(self) -> str:
        took = f" in {self.latency_s:.2f} s" if self.latency_s is not None else ""
        return f"{self.kind.value}{took}" + (f" ({self.detail})" if self.detail else "")


class DetectionPolicy(BaseModel):
    model_config = ConfigDict(frozen=True)

    failures_to_confirm: int = Field(default=2, ge=1, description="Consecutive failed health checks = loss")
    successes_to_clear: int = Field(
        default=3, ge=1, description="Consecutive good checks before a reported entity can be reported again"
    )
    slow_health_s: float = Field(
        default=0.5, gt=0, description="A health check answering slower than this is 'slow but present'"
    )


class EntityState(BaseModel):
    model_config = ConfigDict(frozen=True)

    entity: str
    failures: int = 0
    successes: int = 0
    reported: bool = Field(default=False, description="A loss was reported and not yet cleared")
    slow: bool = Field(default=False, description="In a slow spell (not-a-loss already recorded)")
    answered: bool = Field(default=False, description="Its health check has answered at least once")
    confirming: bool = Field(
        default=False,
        description="A suspect (or a reported entity to re-arm): check its /health directly until this clears",
    )
    evidence: tuple[Evidence, ...] = ()


class Detection(BaseModel):
    model_config = ConfigDict(frozen=True)

    entity: str
    verdict: Verdict
    reason: str
    evidence: tuple[Evidence, ...] = ()

    @property
    def loss(self) -> bool:
        return self.verdict is Verdict.LOSS

    @property
    def spell_started_at(self) -> float | None:
        """When the evidence of this spell began: the first evidence kept after the last that the entity
        answered (the kept evidence may reach back to healthy readings long before the loss)."""
        spell: list[Evidence] = []
        for e in self.evidence:
            spell = [] if e.kind in _PRESENT else [*spell, e]
        return spell[0].at if spell else None


def observe(
    state: EntityState | None, evidence: Evidence, policy: DetectionPolicy | None = None
) -> tuple[EntityState, Detection]:
    """Fold one piece of evidence into the entity's state; say whether it is a loss now."""
    p = policy or DetectionPolicy()
    s = state or EntityState(entity=evidence.entity)
    if s.entity != evidence.entity:
        raise ValueError(f"evidence about {evidence.entity} given to the state of {s.entity}")
    kept = (*s.evidence, evidence)[-EVIDENCE_KEPT:]
    kind = evidence.kind

    def wait(new: EntityState, reason: str) -> tuple[EntityState, Detection]:
        return new, Detection(entity=s.entity, verdict=Verdict.WAIT, reason=reason, evidence=kept)

    def lost(new: EntityState, reason: str) -> tuple[EntityState, Detection]:
        if s.reported:
            return wait(new, f"{reason}; already reported (the open incident absorbs it)")
        return new.model_copy(update={"reported": True, "confirming": False}), Detection(
            entity=s.entity, verdict=Verdict.LOSS, reason=reason, evidence=kept
        )

    if kind in _AT_ONCE:
        what = _AT_ONCE[kind]
        return lost(
            s.model_copy(update={"failures": s.failures + 1, "successes": 0, "evidence": kept}),
            f"{s.entity}: {what} ({evidence.describe()})",
        )
    if kind is EvidenceKind.POD_TERMINATED:
        if s.failures > 0:
            return lost(
                s.model_copy(update={"evidence": kept}),
                f"{s.entity}: terminated after {s.failures} failed check(s) ({evidence.describe()}): "
                "its controller is replacing a broken replica",
            )
        return wait(
            s.model_copy(update={"evidence": kept, "confirming": False}),
            f"{s.entity}: terminated gracefully while healthy (rollout, scale-down, delete): planned, not a loss",
        )
    if kind is EvidenceKind.GATEWAY_UNHEALTHY:
        if s.reported:
            return wait(
                s.model_copy(update={"evidence": kept, "confirming": False}),
                f"{s.entity}: out of the gateway's rotation ({evidence.describe()}); already reported "
                "(the open incident absorbs it)",
            )
        return wait(
            s.model_copy(update={"evidence": kept, "confirming": True}),
            f"{s.entity}: suspect, the gateway took it out of rotation ({evidence.describe()}); "
            "confirming with its own /health",
        )
    if kind in (EvidenceKind.HEALTH_FAILED, EvidenceKind.ENDPOINT_NOT_READY):
        if not s.answered:
            # A replica that never answered is starting, not lost (its controller and the
            # alert path own a start-up that fails).
            return wait(
                s.model_copy(update={"evidence": kept, "confirming": False}),
                f"{s.entity}: has not answered a health check yet (starting), not counted",
            )
        failures = s.failures + 1
        new = s.model_copy(
            update={
                "failures": failures,
                "successes": 0,
                "slow": False,
                "evidence": kept,
                # Keep checking until confirmed; a reported entity failing again needs nothing more.
                "confirming": not s.reported,
            }
        )
        if failures >= p.failures_to_confirm:
            failed = [
                e for e in kept if e.kind in (EvidenceKind.HEALTH_FAILED, EvidenceKind.ENDPOINT_NOT_READY)
            ]
            checks = ", ".join(e.describe() for e in failed[-failures:])
            return lost(new, f"{s.entity}: {failures} consecutive failed checks ({checks})")
        return wait(new, f"{s.entity}: {failures} of {p.failures_to_confirm} failed checks to confirm")
    # HEALTH_OK / GATEWAY_HEALTHY / NODE_READY: present.
    successes = s.successes + 1
    reported = s.reported and successes < p.successes_to_clear
    new = s.model_copy(
        update={
            "failures": 0,
            "successes": successes,
            "reported": reported,
            "evidence": kept,
            "answered": s.answered or kind in (EvidenceKind.HEALTH_OK, EvidenceKind.GATEWAY_HEALTHY),
            # A suspect that answers is cleared; a reported entity is checked until it is re-armed.
            "confirming": reported and kind is not EvidenceKind.NODE_READY,
        }
    )
    slow = kind is EvidenceKind.HEALTH_OK and (evidence.latency_s or 0.0) >= p.slow_health_s
    if slow and not s.slow and not s.reported:
        return new.model_copy(update={"slow": True}), Detection(
            entity=s.entity,
            verdict=Verdict.NOT_A_LOSS,
            reason=f"{s.entity}: slow but present — {evidence.describe()} "
            f"(>= {p.slow_health_s:g} s); not a loss, nothing opened",
            evidence=kept,
        )
    new = new.model_copy(update={"slow": slow and s.slow})
    if s.reported and not reported:
        return wait(new, f"{s.entity}: {successes} consecutive good checks: re-armed")
    return wait(new, f"{s.entity}: present ({evidence.describe()})")
