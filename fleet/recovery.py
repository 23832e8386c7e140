"""Inputs, phases and the operator-visible state of fleetmend's procedures.

Pure pydantic models shared by the workflows (which fill them), the CLI
(``fleetmend status``), the demo report and the tests. Durations are inputs so
tests and the demo run the same procedure in seconds (there is no
time-skipping server offline).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet.incident import LossReport, PoolRef, Severity
from fleet.vocabulary import Tier


class Phase(StrEnum):
    """Named phases; the search attribute ``FleetmendPhase`` carries the current one."""

    CORRELATING = "correlating"
    CONFIRMING = "confirming"
    DEROUTING = "derouting"
    PROTECTING = "protecting-survivors"
    IN_FLIGHT = "in-flight"
    PROMOTING = "promoting"
    REBUILDING = "rebuilding-warm-floor"
    # beyond the fleet-wide cap on recoveries rebuilding at once (fleet.slots.rebuild_slot)
    QUEUED_FOR_REBUILD = "queued-for-rebuild"
    PLACING = "placing"
    TRIAGING = "triaging"
    # a lost node's fence at detection (NodeFence), before any incident looks
    FENCING = "fencing"
    # a failed node's own workflow (NodeQualification), after triage and quarantine
    QUALIFYING = "qualifying"
    AWAITING_REPAIR = "awaiting-repair"
    RAMPING = "ramping"
    VERIFYING = "verifying"
    ROLLING_BACK = "rolling-back"
    AWAITING_OPERATOR = "awaiting-operator"
    PAUSED = "paused"
    # scale-down
    CHOOSING_VICTIMS = "choosing-victims"
    MARKING_NOT_READY = "marking-not-ready"
    DRAINING = "draining"
    TERMINATING = "terminating"
    YIELDING = "yielding-to-incident"
    # terminal
    NOT_A_LOSS = "not-a-loss"
    BAD_ROLLOUT = "bad-rollout"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"


TERMINAL_PHASES = frozenset({Phase.NOT_A_LOSS, Phase.BAD_ROLLOUT, Phase.DONE, Phase.ABORTED, Phase.FAILED})


class RetryBudget(BaseModel):
    """How hard a procedure retries one activity before it stops and asks an operator.

    Bounded in attempts *and* time: a persistent 409, 429 or 5xx from the world
    ends in an operator escalation (retry / skip / abort), never in a phase that
    spins silently on a pending activity.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    attempts: int = Field(8, ge=1, description="Attempts of one activity, the first included")
    budget_s: float = Field(120.0, gt=0, description="Time one activity may take over all its attempts")
    initial_interval_s: float = Field(0.2, gt=0)
    max_interval_s: float = Field(5.0, gt=0)
    call_timeout_s: float = Field(30.0, gt=0, description="One attempt's start-to-close timeout")
    read_patience_s: float = Field(
        300.0,
        ge=0,
        description="A read-only look (a list, a scrape) that keeps failing or finds nothing readable is "
        "tried again with backoff for this long, from its first try, before an operator is asked: a slow "
        "world delays a step, only a persistent failure stops it",
    )
    operator_reminder_s: float = Field(
        900.0, gt=0, description="While an operator is awaited, the incident channel is reminded this often"
    )


class RecoveryTimings(BaseModel):
    """Every wait of the procedure, in seconds (production defaults; tests pass short ones)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    correlation_window_s: float = Field(60.0, gt=0)
    poll_interval_s: float = Field(2.0, gt=0)
    deroute_timeout_s: float = Field(60.0, gt=0)
    replacement_timeout_s: float = Field(1800.0, gt=0)
    ramp_interval_s: float = Field(30.0, gt=0)
    admission_interval_s: float = Field(
        2.0,
        gt=0,
        description="While short of the warm floor, the survivors' queues are re-read this often and the "
        "refused share recomputed (the queues absorb what they can of the gap first)",
    )
    admission_max_interval_s: float = Field(
        30.0,
        gt=0,
        description="While admission is steady (nothing moved, queues empty) the keeper's interval doubles "
        "up to this; any movement brings it back to admission_interval_s",
    )
    admission_watch_s: float = Field(
        3600.0,
        gt=0,
        description="While the recovery waits on an operator after step 3, the keeper's looks run inside "
        "one activity that returns when admission would move, or after this long: the wait's history "
        "grows by one watch per this period, not by one look per interval",
    )
    ramp_max_s: float = Field(1800.0, gt=0)
    warm_fraction: float = Field(0.9, gt=0, le=1.0)
    qualification_timeout_s: float = Field(1800.0, gt=0)
    approval_timeout_s: float = Field(3600.0, gt=0)
    verify_timeout_s: float = Field(600.0, gt=0)
    cooldown_s: float = Field(300.0, ge=0)
    repeat_fault_window_s: float = Field(
        7 * 24 * 3600.0, gt=0, description="The remediation loop cap's window (NVSentinel's 7 days)"
    )
    remediation_cap: int = Field(
        2,
        ge=1,
        description="Quarantines of one machine inside the window fleetmend runs by itself; the next one "
        "waits for an operator",
    )
    qualification_attempts: int = Field(
        3, ge=1, description="Qualification Jobs per incident (a failed one is retried only after a repair)"
    )
    repair_wait_s: float = Field(
        0.0,
        ge=0,
        description="After a failed qualification, how long to watch for a repair (Xid cleared, every GPU "
        "offered again, the node free) before qualifying again. 0 (default) = do not wait: the recovery "
        "ends with the node quarantined and the follow-up named, because verification and lifting the "
        "shedding wait for step 8",
    )
    drain_deadline_s: float = Field(600.0, gt=0)
    kubelet_report_s: float = Field(
        2.0,
        gt=0,
        description="How long after a loss is confirmed a live kubelet has reported a container's death "
        "(its pod-lifecycle relist runs every second): a lost pod still Running and ready past it, whose "
        "engine does not answer, is on a machine that went silent, and its node is fenced",
    )
    reappear_timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long a reported pod that is in no group (its controller deleting and recreating "
        "the group) is looked for before the report is called not-a-loss",
    )
    retry: RetryBudget = Field(default_factory=RetryBudget)
    device_quarantine: bool = Field(
        True,
        description="A fault of one GPU fences that GPU, not the node: the node stays schedulable and its "
        "other replicas keep serving (fleet.device_fault). false: every hardware fault quarantines the node",
    )
    device_fence_max_fraction: float = Field(
        0.5,
        gt=0,
        le=1.0,
        description="A node whose fenced GPUs would exceed this share of its GPUs takes the node path",
    )


class ServingObjectives(BaseModel):
    """What "serving well" means for the pool; verification checks against it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_p99_slo_s: float = Field(2.0, gt=0)
    queue_wait_budget_s: float | None = Field(
        None,
        ge=0,
        description="How long a request may wait in a survivor's queue during a capacity gap and still meet "
        "its objective: the queues absorb the gap up to it before anything is refused. None = the TTFT SLO "
        "(a queued request's wait is part of its TTFT); 0 = refuse the gap at once",
    )
    engine_queue_order: Literal["arrival", "deadline"] = Field(
        "arrival",
        description="How the pool's engines order the requests waiting in their queues: arrival (vLLM's "
        "default, --scheduling-policy fcfs), or deadline (--scheduling-policy priority, the clients sending "
        "each request's deadline as its priority). In deadline order a queued request waits only behind "
        "those due sooner, so the survivors' queues can hold a tier until its own deadline",
    )
    tier_deadlines_s: dict[Tier, float] = Field(
        default_factory=dict,
        description="Each tier's end-to-end deadline as its clients hold it (seconds). Needed with "
        "engine_queue_order deadline: the queue wait budget is then the longest of them",
    )
    target_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="During a capacity gap, admit at most this share of the routed replicas' capacity (the "
        "rest is headroom for their queues; every share of headroom is arrivals refused that the capacity "
        "could have served)",
    )
    warm_floor: int = Field(1, ge=0, description="Warm spare groups to keep")
    min_serving_groups: int = Field(1, ge=0, description="Capacity floor the guard protects")
    group_capacity_rps: float | None = Field(
        None,
        gt=0,
        description="Requests/s one warm replica group sustains (from load tests); None = estimate",
    )
    max_concurrent_destructive: int = Field(1, ge=1, description="Rate limit per pool")

    @model_validator(mode="after")
    def _deadlines_for_deadline_order(self) -> ServingObjectives:
        if (
            self.engine_queue_order == "deadline"
            and self.queue_wait_budget_s is None
            and not self.tier_deadlines_s
        ):
            raise ValueError(
                "engine_queue_order 'deadline' needs tier_deadlines_s (each tier's deadline, e.g. "
                "{'critical': 5, 'standard': 10, 'sheddable': 20}) or an explicit queue_wait_budget_s"
            )
        if any(d <= 0 for d in self.tier_deadlines_s.values()):
            raise ValueError(f"tier_deadlines_s must be positive seconds, got {self.tier_deadlines_s}")
        return self

    @property
    def wait_budget_s(self) -> float:
        """The queue wait budget in effect: ``queue_wait_budget_s`` when set; else, when the engines
        serve by deadline, the longest tier deadline (the lowest tier is refused first, and in deadline
        order its requests wait behind every sooner one: the queues may hold them that long); else the
        TTFT SLO (in arrival order a queued request's wait is part of every later request's TTFT)."""
        if self.queue_wait_budget_s is not None:
            return self.queue_wait_budget_s
        if self.engine_queue_order == "deadline":
            return max(self.tier_deadlines_s.values())
        return self.ttft_p99_slo_s


class IncidentInput(BaseModel):
    """Start argument of ``FleetIncident`` (one per pool). Loss reports arrive as signals."""

    model_config = ConfigDict(extra="forbid")

    pool: PoolRef
    dry_run: bool = False
    timings: RecoveryTimings = Field(default_factory=RecoveryTimings)
    objectives: ServingObjectives = Field(default_factory=ServingObjectives)


class IncidentCause(StrEnum):
    SINGLE_LOSS = "single-loss"
    CORRELATED_LOSS = "correlated-loss"
    DOMAIN_LOSS = "domain-loss"
    BAD_ROLLOUT = "bad-rollout"


class RecoveryInput(BaseModel):
    """Start argument of one ``ReplicaLossRecovery`` child."""

    model_config = ConfigDict(extra="forbid")

    pool: PoolRef
    incident_id: str
    cause: IncidentCause
    reports: list[LossReport]
    severity: Severity = Severity.CRITICAL
    dry_run: bool = False
    timings: RecoveryTimings = Field(default_factory=RecoveryTimings)
    objectives: ServingObjectives = Field(default_factory=ServingObjectives)
    first_signal_at: float | None = None


class Decision(BaseModel):
    """One decision of the procedure, with the reason an SRE would want to read."""

    phase: Phase
    summary: str
    figures: dict[str, Any] = Field(default_factory=dict)
    at: float


class PhaseSpan(BaseModel):
    name: Phase
    start: float
    end: float | None = None


class CheckResult(BaseModel):
    name: str
    passed: bool
    observed: Any = None
    expected: Any = None


class VerificationReport(BaseModel):
    passed: bool
    checks: list[CheckResult]


class ProcedureStatus(BaseModel):
    """What the ``status`` query returns: phase, decisions and figures."""

    workflow: str
    pool: PoolRef
    phase: Phase
    dry_run: bool = False
    paused: bool = False
    awaiting: str | None = Field(None, description="Which operator Update the procedure waits for, and why")
    refusal: Refusal | None = Field(None, description="The refused effect awaiting retry / skip / abort")
    decisions: list[Decision] = Field(default_factory=list)
    phases: list[PhaseSpan] = Field(default_factory=list)
    figures: dict[str, Any] = Field(default_factory=dict)
    verification: VerificationReport | None = None
    children: list[str] = Field(default_factory=list)


class Refusal(BaseModel):
    """An effect the world refused (or a step whose retry budget is spent), waiting for an operator."""

    step: str
    what: str = Field(description="The action, as the activity summary names it")
    error: str = Field(description="The world's own error text")
    can_skip: bool = True
    attempt: int = 0


class OperatorAction(BaseModel):
    """Payload of the operator Updates (approve/pause/resume/abort/extend/accept_cut)."""

    model_config = ConfigDict(extra="forbid")

    operator: str = Field(min_length=1, max_length=100)
    reason: str = Field("", max_length=1000)
    extend_s: float | None = Field(None, gt=0, description="For extend: how much longer to drain")
