"""Step 10: verify before rolling back the emergency measures - as a structured checklist.

``verify_recovery(observations, objectives)`` turns what the activities
observed after a replica-loss recovery into a ``VerificationReport`` (from
``fleet.recovery``): one ``CheckResult`` per item of the runbook's step 10,
each with what was observed and what was expected, so the report reads the
same in the ``status`` query, the incident channel and the audit trail:

1. ready replica groups back to target - by the workload's status **and** by
   EndpointSlice conditions (serving, not terminating), never by scrape ``up``;
2. survivors' queues back to their baseline;
3. preemption rate zero on every replica;
4. TTFT p99 under the SLO **per replica** (the fleet average hides a cold one);
5. ledger reconciliation: no duplicate, no orphan, no unresolved intent;
6. warm floor restored;
7. failed nodes quarantined (cordoned + tainted + labelled);
8. no replacement landed in the wrong pool.

(Engines that serve by deadline, ``ServingObjectives.engine_queue_order``, change 3 and 4: vLLM's
priority scheduler preempts a running request for one due sooner by design, and the lowest tier
waits in the queue up to the wait budget, its deadline. So 3 is recorded, not judged, and 4 is
judged against the wait budget; the queues must still come back to their baseline.)

Shedding is lifted only after the report passes. ``verify_scale_down`` is the
planned scale-down's step 5 (remaining groups ready, no cut stream, ledger clean).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from fleet.recovery import CheckResult, ServingObjectives, VerificationReport


class LedgerReconcile(BaseModel):
    model_config = ConfigDict(frozen=True)

    duplicates: int = Field(default=0, ge=0)
    orphans: int = Field(default=0, ge=0)
    unresolved: int = Field(default=0, ge=0)


class ReplicaObservation(BaseModel):
    model_config = ConfigDict(frozen=True)

    group_id: str
    waiting: float = Field(default=0.0, ge=0)
    baseline_waiting: float = Field(default=0.0, ge=0, description="Waiting queue before the incident")
    preemptions_per_s: float = Field(default=0.0, ge=0)
    ttft_p99_s: float | None = Field(default=None, ge=0)


class NodeQuarantine(BaseModel):
    model_config = ConfigDict(frozen=True)

    cordoned: bool = False
    tainted: bool = False
    labelled: bool = False

    @property
    def complete(self) -> bool:
        return self.cordoned and self.tainted and self.labelled


class RecoveryObservations(BaseModel):
    model_config = ConfigDict(frozen=True)

    target_groups: int = Field(ge=0)
    workload_ready_groups: int = Field(ge=0)
    endpoint_serving_groups: int = Field(
        ge=0, description="Groups whose endpoints are serving and not terminating"
    )
    replicas: tuple[ReplicaObservation, ...] = ()
    ledger: LedgerReconcile = Field(default_factory=LedgerReconcile)
    warm_groups: int = Field(default=0, ge=0, description="Ready groups (serving or spare)")
    failed_nodes: dict[str, NodeQuarantine] = Field(default_factory=dict)
    wrong_pool_pods: tuple[str, ...] = Field(
        default=(), description="Replacements that landed outside the pool"
    )


def verify_recovery(
    obs: RecoveryObservations,
    objectives: ServingObjectives | None = None,
    warm_floor: int | None = None,
    queue_tolerance: float = 1.0,
) -> VerificationReport:
    """``warm_floor`` defaults to target groups + the objectives' warm spare floor."""
    o = objectives or ServingObjectives.model_validate({})
    floor = warm_floor if warm_floor is not None else obs.target_groups + o.warm_floor
    checks = [
        CheckResult(
            name="ready replica groups (workload status)",
            passed=obs.workload_ready_groups >= obs.target_groups,
            observed=obs.workload_ready_groups,
            expected=f">= {obs.target_groups}",
        ),
        CheckResult(
            name="ready replica groups (EndpointSlice serving)",
            passed=obs.endpoint_serving_groups >= obs.target_groups,
            observed=obs.endpoint_serving_groups,
            expected=f">= {obs.target_groups}",
        ),
    ]
    high = {r.group_id: r.waiting for r in obs.replicas if r.waiting > r.baseline_waiting + queue_tolerance}
    checks.append(
        CheckResult(
            name="survivor queues back to baseline",
            passed=not high,
            observed=high or "all at baseline",
            expected=f"waiting <= baseline + {queue_tolerance:g}",
        )
    )
    by_deadline = o.engine_queue_order == "deadline"
    preempting = {r.group_id: r.preemptions_per_s for r in obs.replicas if r.preemptions_per_s > 0}
    checks.append(
        CheckResult(
            name="preemption rate zero",
            passed=by_deadline or not preempting,
            observed=preempting or 0.0,
            expected="recorded, not judged: engines serving by deadline preempt for sooner deadlines"
            if by_deadline
            else "0 preemptions/s on every replica",
        )
    )
    ttft_limit = o.wait_budget_s if by_deadline else o.ttft_p99_slo_s
    slow = {
        r.group_id: r.ttft_p99_s
        for r in obs.replicas
        if r.ttft_p99_s is not None and r.ttft_p99_s > ttft_limit
    }
    unmeasured = [r.group_id for r in obs.replicas if r.ttft_p99_s is None]
    checks.append(
        CheckResult(
            name="TTFT p99 under SLO per replica",
            passed=not slow,
            observed=slow or ({"unmeasured (no requests)": unmeasured} if unmeasured else "all under SLO"),
            expected=f"<= {ttft_limit:g} s on every replica"
            + (" (deadline order: the wait budget, the longest tier deadline)" if by_deadline else ""),
        )
    )
    ledger = obs.ledger
    checks.append(
        CheckResult(
            name="ledger reconciliation",
            passed=ledger.duplicates == 0 and ledger.orphans == 0 and ledger.unresolved == 0,
            observed=ledger.model_dump(),
            expected={"duplicates": 0, "orphans": 0, "unresolved": 0},
        )
    )
    checks.append(
        CheckResult(
            name="warm floor restored",
            passed=obs.warm_groups >= floor,
            observed=obs.warm_groups,
            expected=f">= {floor}",
        )
    )
    not_quarantined = {n: q.model_dump() for n, q in obs.failed_nodes.items() if not q.complete}
    checks.append(
        CheckResult(
            name="failed nodes quarantined",
            passed=not not_quarantined,
            observed=not_quarantined or sorted(obs.failed_nodes) or "no failed node",
            expected="cordoned + tainted + labelled",
        )
    )
    checks.append(
        CheckResult(
            name="no replacement in the wrong pool",
            passed=not obs.wrong_pool_pods,
            observed=list(obs.wrong_pool_pods) or "none",
            expected="none",
        )
    )
    return VerificationReport(passed=all(c.passed for c in checks), checks=checks)


def verify_scale_down(
    target_groups: int,
    ready_groups: int,
    cut_streams: int,
    victims_in_flight: int,
    ledger: LedgerReconcile,
    accepted_cut: bool = False,
) -> VerificationReport:
    """Planned scale-down step 5. A cut accepted by an operator passes, and is still reported."""
    checks = [
        CheckResult(
            name="remaining replica groups ready",
            passed=ready_groups >= target_groups,
            observed=ready_groups,
            expected=f">= {target_groups}",
        ),
        CheckResult(
            name="no cut stream",
            passed=cut_streams == 0 or accepted_cut,
            observed=cut_streams,
            expected="0" + (" (operator accepted cutting)" if accepted_cut else ""),
        ),
        CheckResult(
            name="victims drained",
            passed=victims_in_flight == 0 or accepted_cut,
            observed=victims_in_flight,
            expected="0 requests running or waiting on the victims",
        ),
        CheckResult(
            name="ledger reconciliation",
            passed=ledger.duplicates == 0 and ledger.orphans == 0 and ledger.unresolved == 0,
            observed=ledger.model_dump(),
            expected={"duplicates": 0, "orphans": 0, "unresolved": 0},
        ),
    ]
    return VerificationReport(passed=all(c.passed for c in checks), checks=checks)
