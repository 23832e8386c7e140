"""FleetIncident: one durable incident per serving pool.

Every alert about the pool arrives here as a ``report_loss`` signal
(signal-with-start, workflow id from the pool), so an alert storm reaches one
workflow. The incident:

1. absorbs repeats (by alert fingerprint and by the entity reported);
2. starts a ReplicaLossRecovery child for the first loss at once — derouting a
   dead replica must not wait for a correlation window;
3. folds further losses reported within the correlation window into that same
   child (``add_losses``), which treats the set as one correlated incident and
   decides whether it has a common cause (bad rollout, failure domain);
4. after the child finishes, stays open for a cool-down that absorbs late
   repeats, then completes. A loss after the window starts a new child.
5. a recovery that *failed* (its workflow ended in error) keeps the incident open
   in ``awaiting-operator`` - status, search attribute, incident channel - until an
   operator answers with the ``resolve`` Update (new losses still start recoveries).

6. continues-as-new between recoveries (never while one runs) when the history grows long or
   a newer worker version became the target; ``IncidentCarry`` takes everything along
   (pending reports, fingerprints, entities, children, failed recoveries awaiting ``resolve``,
   the status). Each run is pinned to its worker version; the next run starts on the current
   one (upgrade on continue-as-new), so a worker roll never replays a run on new code.

Each recovery's id carries the incident's first run id
(``incident/<ns>/<pool>/<run>/recovery-<n>``), and each recovery scopes its ledger
operation ids by its own first run: the pool's next incident never meets this one's rows.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel, ConfigDict, Field
from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from activities.observe import ObserveActivities
    from fleet import search_attributes as sa
    from fleet.incident import AlertStatus, LossReport, PoolRef
    from fleet.recovery import (
        IncidentCause,
        IncidentInput,
        OperatorAction,
        Phase,
        ProcedureStatus,
        RecoveryInput,
        RetryBudget,
    )
    from workflows.procedure import (
        Record,
        describe_failure,
        is_cancellation,
        run_bounded,
        should_continue_as_new,
    )
    from workflows.replica_loss import ReplicaLossRecovery


def entity_key(report: LossReport) -> str:
    """What a report is about: the same entity reported twice is one loss."""
    if report.replica_group:
        return f"group:{report.replica_group}"
    if report.pod:
        return f"pod:{report.pod}"
    if report.node:
        return f"node:{report.node}"
    return f"alert:{report.fingerprint}"


class IncidentCarry(BaseModel):
    """Everything a FleetIncident run hands to the next one at continue-as-new."""

    model_config = ConfigDict(extra="forbid")

    config: IncidentInput
    status: ProcedureStatus
    pending: list[LossReport] = Field(default_factory=list)
    fingerprints: list[str] = Field(default_factory=list)
    entities: list[str] = Field(default_factory=list)
    resolved: list[str] = Field(default_factory=list)
    absorbed: int = 0
    children: list[str] = Field(default_factory=list)
    failed: dict[str, str] = Field(default_factory=dict)
    runs: int = Field(1, description="Runs of this incident so far (this one included)")


@workflow.defn(name="FleetIncident")
class FleetIncident(Record):
    """The toolkit's ``Record``: the same record, incident channel and operation-id scope
    (``<workflow id>@<first run id>``) as the procedures. Its one effect - the channel message
    about a failed recovery - is posted even in a dry run: an operator must hear of it."""

    @workflow.init
    def __init__(self, pool: PoolRef | IncidentInput | IncidentCarry) -> None:
        self._pending: list[LossReport] = []
        self._seen: set[str] = set()  # alert fingerprints
        self._entities: set[str] = set()
        self._resolved: set[str] = set()
        self._absorbed = 0
        ref = pool.config.pool if isinstance(pool, IncidentCarry) else pool
        ref = ref.pool if isinstance(ref, IncidentInput) else ref
        status = ProcedureStatus(workflow=workflow.info().workflow_id, pool=ref, phase=Phase.CORRELATING)
        self._children: list[str] = []
        self._failed: dict[str, str] = {}  # failed recovery -> why, until an operator resolves it
        self._runs = 1
        if isinstance(pool, IncidentCarry):
            self._pending = list(pool.pending)
            self._seen = set(pool.fingerprints)
            self._entities = set(pool.entities)
            self._resolved = set(pool.resolved)
            self._absorbed = pool.absorbed
            status = pool.status
            self._children = list(pool.children)
            self._failed = dict(pool.failed)
            self._runs = pool.runs + 1
        super().__init__(status, budget=RetryBudget(), dry_run=False)

    @workflow.signal(name="report_loss", description="An alert says a replica of this pool may be lost")
    def report_loss(self, report: LossReport) -> None:
        if report.status == AlertStatus.RESOLVED:
            # Recorded, never used to abort a half-done step: the procedure verifies for itself.
            self._resolved.add(report.fingerprint)
            return
        if report.fingerprint in self._seen or entity_key(report) in self._entities:
            self._absorbed += 1
            self._seen.add(report.fingerprint)
            return
        self._seen.add(report.fingerprint)
        self._entities.add(entity_key(report))
        self._pending.append(report)

    @workflow.update(
        name="resolve",
        description="Close out failed recoveries (after handling them by hand): the incident can then end",
    )
    def resolve(self, action: OperatorAction) -> ProcedureStatus:
        failed, self._failed = self._failed, {}
        self.decide(f"resolved by {action.operator}: {action.reason} (failed: {', '.join(sorted(failed))})")
        self._status.awaiting = None
        return self._status

    @resolve.validator
    def _validate_resolve(self, action: OperatorAction) -> None:
        if not self._failed:
            raise ValueError("no failed recovery is waiting to be resolved (see the status query)")
        if not action.reason:
            raise ValueError("resolving needs a reason (what was done about the failed recovery)")

    @workflow.query(name="status", description="Phase, children and figures of this incident")
    def status(self) -> ProcedureStatus:
        self._status.figures.update(
            {
                "alerts_seen": len(self._seen) + self._absorbed,
                "alerts_absorbed": self._absorbed,
                "resolved_alerts": len(self._resolved),
                "entities": sorted(self._entities),
            }
        )
        self._status.children = list(self._children)
        self._status.figures["runs"] = self._runs
        return self._status

    @workflow.run
    async def run(self, pool: PoolRef | IncidentInput | IncidentCarry) -> ProcedureStatus:
        """``pool`` alone (what the webhook sends: the worker's policy applies) or an ``IncidentInput``
        naming the pool with its own timings, objectives and dry-run (tests, the demo, operators);
        ``IncidentCarry`` only from this workflow's own continue-as-new."""
        config: IncidentInput | None = None
        if isinstance(pool, IncidentCarry):
            config, pool = pool.config, pool.config.pool
        if isinstance(pool, IncidentInput):
            config, pool = pool, pool.pool
        if config is None:
            config = await self._load_config(pool)
        self._status.dry_run = config.dry_run
        self.begin("incident", pool)
        timings = config.timings
        while True:
            if should_continue_as_new():
                await self._continue_as_new(config)
            self.set_details(f"Waiting for loss reports on **{pool.key}**")
            try:
                await workflow.wait_condition(
                    lambda: bool(self._pending) or should_continue_as_new(),
                    timeout=timedelta(seconds=max(timings.cooldown_s, 0.001)),
                    timeout_summary="cool-down: absorbing late repeats",
                )
            except TimeoutError:
                if not self._failed:
                    break
                await self._await_resolution(pool)
                continue
            if self._pending:
                await self._run_recovery(pool, config)

        self.set_phase(Phase.DONE)
        self.set_details(f"Incident on **{pool.key}** closed after {len(self._children)} recoveries")
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self._status

    async def _load_config(self, pool: PoolRef) -> IncidentInput:
        """The worker's incident policy, within the toolkit's bounded budget.

        A spent budget (the worker cannot read its own configuration) is not retried silently
        forever: the incident says so - phase, ``awaiting``, the incident channel - and reads
        again after another budget's time, until the worker is fixed.
        """
        told = False
        while True:
            try:
                config: IncidentInput = await run_bounded(
                    ObserveActivities.load_incident_config,
                    pool,
                    budget=self._budget,
                    summary=f"load incident policy for {pool.key}",
                )
            except ActivityError as err:
                if is_cancellation(err):
                    raise
                what = f"the worker cannot read its incident policy for {pool.key}: {describe_failure(err)}"
                if not told:
                    told = True
                    self.set_phase(Phase.AWAITING_OPERATOR)
                    self._status.awaiting = f"{what}; fix the worker's configuration (read again every "
                    self._status.awaiting += f"{self._budget.budget_s:.0f} s)"
                    self.set_details(f"**Awaiting operator**: {self._status.awaiting}")
                    self.decide(f"stopped: {what}")
                    await self.notify(
                        "incident-policy",
                        f"[fleetmend] {pool.key}: {what}. No recovery can start until the worker reads it.",
                    )
                await workflow.sleep(self._budget.budget_s, summary="read the incident policy again")
                continue
            if told:
                self._status.awaiting = None
                self.set_phase(Phase.CORRELATING)
                self.decide(f"incident policy for {pool.key} read")
            return config

    async def _continue_as_new(self, config: IncidentInput) -> None:
        """Hand everything to a fresh run on the current worker version (no recovery is running here)."""
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(
            IncidentCarry(
                config=config,
                status=self._status,
                pending=self._pending,
                fingerprints=sorted(self._seen),
                entities=sorted(self._entities),
                resolved=sorted(self._resolved),
                absorbed=self._absorbed,
                children=self._children,
                failed=self._failed,
                runs=self._runs,
            ),
            initial_versioning_behavior=workflow.ContinueAsNewVersioningBehavior.AUTO_UPGRADE,
        )

    async def _await_resolution(self, pool: PoolRef) -> None:
        """A failed recovery keeps the incident open and visible until ``resolve`` (or a new loss)."""
        what = "; ".join(f"{c}: {why}" for c, why in sorted(self._failed.items()))
        self.set_phase(Phase.AWAITING_OPERATOR)
        self._status.awaiting = f"failed recovery needs an operator — {what}; answer with `resolve`"
        self.set_details(f"**Awaiting operator**: {self._status.awaiting}")
        await self.notify(
            f"failed-{len(self._children)}",
            f"[fleetmend] {pool.key}: recovery failed and the incident stays open — {what}. "
            f"Handle it, then `fleetmend resolve {workflow.info().workflow_id} --reason ...`.",
        )
        await workflow.wait_condition(
            lambda: not self._failed or bool(self._pending) or should_continue_as_new()
        )
        if self._failed and not self._pending:
            return  # continue-as-new: the next run picks the wait up again, still awaiting the operator
        self.set_phase(Phase.CORRELATING)

    def _absorb_handled(self, child_id: str, result: ProcedureStatus) -> None:
        """Reports that came in while ``child_id`` ran and name a loss it handled (its lost groups and
        pods: the fast path and alerts keep naming a dead node's terminating pods) are absorbed, not
        a new recovery."""
        figures = result.figures
        handled = {f"group:{g}" for g in figures.get("lost_groups") or []}
        handled |= {f"pod:{p}" for p in figures.get("lost_pods") or []} | {
            f"group:{p}" for p in figures.get("lost_pods") or []
        }
        self._entities |= handled
        late = [r for r in self._pending if entity_key(r) in handled]
        if late:
            self._pending = [r for r in self._pending if entity_key(r) not in handled]
            self._absorbed += len(late)
            self.decide(
                f"{len(late)} report(s) that came in while {child_id} ran name losses it handled: absorbed",
                {"entities": sorted({entity_key(r) for r in late})},
            )

    async def _run_recovery(self, pool: PoolRef, config: IncidentInput) -> None:
        first = self._pending.pop(0)
        now = self.now()
        n = len(self._children) + 1
        info = workflow.info()
        child_id = f"{info.workflow_id}/{info.first_execution_run_id[:8]}/recovery-{n}"
        child_input = RecoveryInput(
            pool=pool,
            incident_id=workflow.info().workflow_id,
            cause=IncidentCause.SINGLE_LOSS,
            reports=[first],
            severity=first.severity,
            dry_run=config.dry_run,
            timings=config.timings,
            objectives=config.objectives,
            first_signal_at=now,
        )
        self._children.append(child_id)
        self._status.phase = Phase.CORRELATING
        self.decide(f"recovery {child_id} started for {entity_key(first)} ({first.alert_name})")
        self.set_details(f"Recovery **{child_id}** running for {entity_key(first)}")
        handle = await workflow.start_child_workflow(
            ReplicaLossRecovery.run,
            child_input,
            id=child_id,
            task_queue=workflow.info().task_queue,
            static_summary=f"Replica loss on {pool.key}: {entity_key(first)}",
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(sa.FLEETMEND_KIND, "replica-loss"),
                    SearchAttributePair(sa.FLEETMEND_NAMESPACE, pool.namespace),
                    SearchAttributePair(sa.FLEETMEND_POOL, pool.key),
                    SearchAttributePair(sa.FLEETMEND_SEVERITY, first.severity.value),
                    SearchAttributePair(sa.FLEETMEND_DRY_RUN, config.dry_run),
                ]
            ),
        )
        window_end = now + config.timings.correlation_window_s
        # Losses within the window join this recovery as one correlated incident.
        while True:
            remaining = window_end - self.now()
            if self._pending and remaining > 0:
                batch, self._pending = self._pending, []
                await handle.signal(ReplicaLossRecovery.add_losses, batch)
                self.decide(
                    f"{len(batch)} more loss(es) within the correlation window joined {child_id}",
                    {"entities": [entity_key(r) for r in batch]},
                    phase=Phase.CORRELATING,
                )
                continue
            if remaining <= 0:
                break
            try:
                await workflow.wait_condition(
                    lambda: bool(self._pending) or handle.done(),
                    timeout=timedelta(seconds=remaining),
                    timeout_summary="correlation window",
                )
            except TimeoutError:
                break
            if handle.done():
                break
        try:
            result: ProcedureStatus = await handle
            # patched: an incident that started a recovery for a late report of a handled loss replays as it ran.
            if workflow.patched("absorb-handled-reports"):
                self._absorb_handled(child_id, result)
            if result.phase is Phase.FAILED:
                self._failed[child_id] = "ended in phase failed"
            self.decide(
                f"{child_id} ended in phase {result.phase.value}",
                {"verification_passed": result.verification.passed if result.verification else None},
                phase=result.phase,
            )
        except ChildWorkflowError as err:
            self._failed[child_id] = str(err.cause or err)[:500]
            self.decide(f"{child_id} failed: {err.cause or err}", phase=Phase.FAILED)
