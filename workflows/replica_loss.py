"""ReplicaLossRecovery: the replica-loss runbook (DESIGN.md §3) as a durable workflow.

Order is the product: **stop routing to it → protect the survivors → decide
the in-flight requests → recover capacity → triage → ramp back → verify**.
"Kubernetes will reschedule it" is never the first step.

Every step observes the world, decides with a pure policy from ``fleet/`` and acts
through the procedure toolkit (``workflows/procedure.py``): every effect goes through
the ledger under an operation id unique to this recovery, and a refused effect stops
the step and asks an operator (``retry`` / ``skip`` / ``abort``) - the recovery never
carries on as if it had happened. Operators watch the phase (search attribute
``FleetmendPhase``), the current details and the activity summaries in the Temporal
UI, and steer with the ``pause``, ``resume``, ``abort``, ``approve``, ``retry`` and
``skip`` Updates.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.act import (
        ActActivities,
        AdmissionChangeRequest,
        NodeCordon,
        NodeTaint,
        PodDeletion,
        RetryPolicyChangeRequest,
        ScaleChange,
        WeightsChangeRequest,
    )
    from activities.audit import AuditActivities, ReconcileRequest
    from activities.observe import JournalRequest, ObserveActivities, ObserveRequest, ScrapeRequest
    from activities.qualification import (
        MachineQuery,
        NodeReturn,
        QualificationActivities,
        QualificationJobRef,
        QualificationJobRequest,
        QualificationRead,
    )
    from fleet import search_attributes as sa
    from fleet.arrivals import ArrivalTally, admitted_rate, arrival_rate
    from fleet.capacity import recovery_guard
    from fleet.engine_metrics import EngineSnapshot
    from fleet.gateway import Admission
    from fleet.incident import LossReport
    from fleet.leadtime import estimate_lead_time
    from fleet.loss import (
        Correlation,
        GroupVerdict,
        LossEvent,
        confirm_group,
        correlate,
        failed_nodes,
        groups_being_recreated,
        match_reports,
        silent_nodes,
        size_loss,
    )
    from fleet.observation import PoolObservation
    from fleet.placement import GroupShape, place_group
    from fleet.pool import GroupRole, ReplicaGroup
    from fleet.qualification import (
        MACHINE_ANNOTATION,
        GpuHolder,
        Identity,
        QualificationState,
        Verdict,
        clear_for_qualification,
        identity,
        remediation_gate,
        repaired,
    )
    from fleet.rebuild import (
        awaiting_recreation,
        plan_rebuild,
        pods_held_by_lost_nodes,
        still_counted,
        uids_at_loss,
    )
    from fleet.recovery import (
        CheckResult,
        IncidentCause,
        Phase,
        ProcedureStatus,
        RecoveryInput,
        Refusal,
        VerificationReport,
    )
    from fleet.recovery_observations import in_flight_record, recovery_observations, warm_groups_before
    from fleet.retry_budget import decide_retry_policy
    from fleet.service_rate import capacity_to_count_on, per_group_capacity, routed_served_rate, smoothed
    from fleet.shedding import (
        QueueRoom,
        ShedDecision,
        admission_changed,
        can_lift_shedding,
        decide_readmission,
        decide_shedding,
        estimate_arrivals,
        pool_capacity_rps,
        refused_fraction,
    )
    from fleet.spares import pick_spares
    from fleet.survivor_load import PARKED_FACTOR, next_admission_look, routed_backlog, survivor_loads
    from fleet.triage import PodFault, triage_node
    from fleet.verification import verify_recovery
    from fleet.vocabulary import (
        FAULT_CLASS_ANNOTATION,
        QUARANTINE_LABEL,
        QUARANTINE_TAINT_KEY,
        REMEDIATED_AT_ANNOTATION,
        SHED_ORDER,
    )
    from fleet.warmth import RampPlan, new_leaders, plan_weights, ramp_capacity_shape
    from workflows.procedure import Aborted, Procedure

# A Pending replacement is judged unplaceable only after this many looks (the scheduler needs a moment).
PLACEMENT_LOOKS = 3
# Arrivals the gateway counted over at least this long replace the first estimate (open-loop clients
# arrive in bursts; the protect step's first window is a second or two).
ARRIVALS_COUNTED_S = 5.0


@workflow.defn(name="ReplicaLossRecovery")
class ReplicaLossRecovery(Procedure):
    @workflow.init
    def __init__(self, inp: RecoveryInput) -> None:
        # State exists before the first task: an Update sent right after the start is accepted.
        status = ProcedureStatus(
            workflow=workflow.info().workflow_id, pool=inp.pool, phase=Phase.CONFIRMING, dry_run=inp.dry_run
        )
        status.figures.update({"cause_hint": inp.cause.value, "dry_run": inp.dry_run})
        super().__init__(
            status,
            budget=inp.timings.retry,
            dry_run=inp.dry_run,
            operator_wait_s=inp.timings.approval_timeout_s,
        )
        self._inp = inp
        self._reports: list[LossReport] = list(inp.reports)
        self._new_reports: list[LossReport] = []
        self._verdicts: list[GroupVerdict] = []
        self._correlation: Correlation | None = None
        self._initial_obs: PoolObservation | None = None
        self._confirmed_at = 0.0
        self._failed_nodes: dict[str, str] = {}  # node -> why, as the fence decided
        self._baseline: dict[str, float] = {}
        self._shed: ShedDecision | None = None
        # The admission the gateway has now (as this procedure set it), and what it is computed from.
        self._admission = Admission()
        self._arrival_rps = 0.0
        self._arrivals = ArrivalTally()  # the gateway's count, from the first look on
        self._per_group_rps = 0.0
        self._serving_groups = 0
        self._readmissions = 0
        self._capacity_rps = 0.0
        self._backlog = 0.0
        # The admission keeper re-reads the survivors' queues from step 3 until verification.
        self._admission_lock = asyncio.Lock()
        self._keeping_admission = False
        self._admission_keeper: asyncio.Task[None] | None = None
        self._admission_look_s = inp.timings.admission_interval_s
        self._keeper_parked = False  # the keeper looks PARKED_FACTOR x its max interval apart
        self._by_pod_name = False  # LeaderWorkerSet pods matched by name (set by the confirm step's patch)
        self._unmatched: list[str] = []
        self._expected_new = 0
        self._quarantined: list[str] = []
        self._lost_ids: set[str] = set()  # groups this recovery confirmed lost (and handles)
        self._lost_groups: list[ReplicaGroup] = []
        self._started_at = workflow.now().timestamp()
        self.set_fingerprints([r.fingerprint for r in self._reports])

    # ================================================================ the runbook

    @workflow.run
    async def run(self, inp: RecoveryInput) -> ProcedureStatus:
        self.begin("replica-loss", inp.pool, severity=inp.severity.value)
        try:
            # 1. Confirm and size: lost, or merely slow?
            obs, lost = await self.confirm_and_size()
            if not lost:
                return self.finish(Phase.NOT_A_LOSS)
            # 2. Stop routing to it (router-only label; never a selector label).
            await self.stop_routing(obs, lost)
            if self._correlation is not None and not self._correlation.replace:
                await self.bad_rollout(lost)
                return self.finish(Phase.BAD_ROLLOUT)
            # 3. Protect the survivors: refuse exactly the capacity gap (re-computed at every capacity change).
            obs = await self.protect_survivors(lost)
            # 4. In-flight requests: retry budget before first byte; collect the record.
            await self.decide_in_flight(obs, lost)
            # 5. Promote warm capacity of the same model and revision. Do not scale first.
            promoted = await self.promote_warm_capacity(obs, lost)
            # 6. Rebuild the warm floor (or post the lead time when there was no spare).
            await self.rebuild_warm_floor(obs, lost, promoted)
            # 7. Place it where it fits: whole shape, or report fragmentation.
            await self.place_replacements(lost)
            # 8. Triage the hardware, off the critical path, while 9. ramping back by measured rate.
            triage = asyncio.ensure_future(self.triage_hardware(obs, lost))
            await self.ramp_back(promoted)
            await triage
            # 10. Verify, then roll back the emergency measures.
            await self.verify_and_roll_back(lost)
            return self.finish(Phase.DONE)
        except Aborted:
            return self.finish(Phase.ABORTED)
        finally:
            self._keeping_admission = False

    # ---------------------------------------------------------------- step 1

    async def confirm_and_size(self) -> tuple[PoolObservation, list[ReplicaGroup]]:
        await self.enter(Phase.CONFIRMING, "Confirming the loss: is the endpoint gone, or merely slow?")
        for r in self._reports:
            if r.source == "fastpath":  # the evidence the fast path opened the incident on
                self.decide(
                    f"reported by the fast path ({r.alert_name}, {r.replica_group or r.pod or r.node}): "
                    + r.labels.get("fleetmend_evidence", "no evidence given"),
                    {"report": r.model_dump(mode="json")},
                )
        timings = self._inp.timings
        give_up = self.now() + timings.reappear_timeout_s
        looked_again = False
        recreating: list[ReplicaGroup] = []
        first_look: PoolObservation | None = None
        # patched: a recovery that was confirming when the worker was upgraded replays as it ran.
        by_pod_name = self._by_pod_name = workflow.patched("lws-group-by-pod-name")
        while True:
            obs = await self._observe(
                check_progress=True, light=True, summary="confirm: read pool, endpoints, engines"
            )
            first_look = first_look or obs
            recreating = groups_being_recreated(
                obs.snapshot, obs.workloads, self._reports, by_pod_name=by_pod_name
            )
            matched = match_reports(obs.snapshot, self._reports, by_pod_name=by_pod_name)
            if matched or recreating or self.now() >= give_up:
                break
            # A LeaderWorkerSet deletes and recreates a whole group when one pod fails: until its pods are
            # back, the reported pod is in no group. Look again before calling it not-a-loss.
            if not looked_again:
                looked_again = True
                self.decide(
                    "the reported pod / group is not in the pool right now (its controller may be "
                    f"recreating it): looking for it for up to {timings.reappear_timeout_s:g} s"
                )
            await workflow.sleep(timings.poll_interval_s, summary="confirm: look again")
        for g in recreating:
            self.decide(
                f"{g.id}: its LeaderWorkerSet {g.workload_name} deleted the group to re-create it (none "
                "of its pods exists): confirming it as it was, since it serves nothing until new pods are ready",
                {"group": g.id},
            )
        obs = _with_lost(obs, recreating)
        self._initial_obs = obs
        self._confirmed_at = self.now()
        self._arrivals = self._arrivals.add(obs, 0.0)
        lost = self._confirm(obs, self._reports)
        if not lost:
            return obs, []
        if by_pod_name and first_look is not None:
            # A group re-created while confirmation looked is new, not "the same pods as at the loss".
            uids = uids_at_loss(lost, first_look.pod_uids, obs.pod_uids)
            self._initial_obs = obs = obs.model_copy(update={"pod_uids": uids})
        self._lost_ids.update(g.id for g in lost)
        self._lost_groups = lost  # the runbook's own list: groups confirmed later join it
        size = size_loss(obs.snapshot, [g.id for g in lost])
        self.decide(f"loss confirmed: {size.summary}", {"loss": size.model_dump(mode="json")})
        self.figure("groups_lost", size.groups_lost)
        self.figure("lost_pods", sorted(p for g in lost for p in g.pods))
        events = [LossEvent(group_id=g.id, revision=g.revision, nodes=g.nodes, at=self.now()) for g in lost]
        self._correlation = correlate(events, obs.snapshot, self._inp.timings.correlation_window_s)
        self.decide(f"cause: {self._correlation.reason}", {"cause": self._correlation.cause.value})
        self.figure("cause", self._correlation.cause.value)
        workflow.upsert_search_attributes(
            [sa.FLEETMEND_REPLICA_GROUP.value_set(",".join(g.id for g in lost)[:250])]
        )
        return obs, lost

    def _confirm(self, obs: PoolObservation, reports: list[LossReport]) -> list[ReplicaGroup]:
        """Resolve reports to replica groups (node → groups, pod → group) and confirm each."""
        candidates = match_reports(obs.snapshot, reports, by_pod_name=self._by_pod_name)
        lost: list[ReplicaGroup] = []
        for g in candidates.values():
            verdict = confirm_group(g, obs.pods, obs.snapshot.nodes, obs.routed_pods, obs.publish_not_ready)
            self._verdicts.append(verdict)
            self.decide(
                f"{g.id}: {verdict.verdict.value} — {verdict.reason}", {"evidence": list(verdict.evidence)}
            )
            if verdict.lost:
                lost.append(g)
        if not candidates:
            self.decide(
                "no replica group of the pool matches the reports: "
                + "; ".join(
                    f"{r.alert_name} node={r.node} pod={r.pod} group={r.replica_group}" for r in reports
                )
            )
        return lost

    # ---------------------------------------------------------------- step 2

    async def stop_routing(self, obs: PoolObservation, lost: list[ReplicaGroup]) -> None:
        inp = self._inp
        await self.enter(Phase.DEROUTING, f"Derouting {', '.join(g.id for g in lost)}")
        label = obs.router_label
        selecting = obs.controllers_selecting(label)
        lost_ids = {g.id for g in lost}
        dead_routed = sorted({p for v in self._verdicts if v.group_id in lost_ids for p in v.dead_but_routed})
        # Every pod of a lost group leaves routing: one lost rank takes the whole group.
        to_deroute = sorted({p for g in lost for p in g.pods if p in obs.routed_pods} | set(dead_routed))
        if not to_deroute:
            seconds = max(0.0, self.now() - (inp.first_signal_at or self._started_at))
            self.figure("deroute_seconds", seconds)
            self.decide(
                f"lost endpoints already out of routing {seconds:.2f} s after the first signal "
                "(EndpointSlice not ready / label absent)"
            )
            return
        if selecting:
            names = ", ".join(f"{w.kind}/{w.name}" for w in selecting)
            self.decide(
                f"refusing to remove label {label}: {names} select(s) on it — removing it would orphan the pod "
                "(the controller makes a replacement while the old pod keeps its GPUs); asking an operator "
                "to approve force-deleting the dead pods instead",
                {"selected_by": names, "pods": to_deroute},
            )
            await self._force_delete(
                to_deroute, f"(label {label} is a controller selector)", lost, step="deroute-force-delete"
            )
            seen = await self.await_out_of_routing(
                inp.pool, to_deroute, timeout_s=inp.timings.deroute_timeout_s
            )
        else:
            seen = await self.deroute(
                inp.pool,
                to_deroute,
                label,
                step="deroute",
                why="deroute",
                timeout_s=inp.timings.deroute_timeout_s,
            )
        if seen is None:
            self.decide(f"dry-run: would deroute {', '.join(to_deroute)}")
            return
        seconds = max(0.0, seen.at - (inp.first_signal_at or self._started_at))
        self.figure("deroute_seconds", seconds)
        self.decide(
            f"dead endpoints out of routing {seconds:.2f} s after the first signal", {"pods": to_deroute}
        )

    # ---------------------------------------------------------------- bad rollout

    async def bad_rollout(self, lost: list[ReplicaGroup]) -> None:
        await self.enter(Phase.BAD_ROLLOUT, "Bad rollout: revert, do not replace with the failing revision")
        revision = self._correlation.revision if self._correlation else None
        text = (
            f"[fleetmend] {self._inp.pool.key}: {len(lost)} replica group(s) of revision {revision} failed during "
            "its rollout. The failing groups are derouted; no replacement of that revision will be created. "
            "Revert the rollout (e.g. `kubectl rollout undo`) — fleetmend does not roll back on its own."
        )
        await self.notify("bad-rollout", text)
        self.decide(text, {"revision": revision, "groups": [g.id for g in lost]})

    # ---------------------------------------------------------------- step 3

    async def protect_survivors(self, lost: list[ReplicaGroup]) -> PoolObservation:
        inp = self._inp
        await self.enter(
            Phase.PROTECTING, "Protecting the survivors: reading their queues, KV and preemptions"
        )
        before = await self._observe(summary="survivors: first scrape")
        # Survivors' queues now are the baseline verification compares against.
        self._baseline = {gid: e.waiting for gid, e in before.engines.items()}
        await workflow.sleep(inp.timings.poll_interval_s, summary="interval between two scrapes")
        obs = await self._observe(summary="survivors: second scrape")
        seconds = max(1e-3, obs.snapshot.observed_at - before.snapshot.observed_at)
        lost_ids = {g.id for g in lost}
        per_group, capacity_note = per_group_capacity(inp.objectives.group_capacity_rps, before, obs, seconds)
        # A gateway's counter is read from the incident's first look on: arrivals do not change with a loss.
        arrival, counted = arrival_rate(
            before,
            obs,
            seconds,
            lost_ids,
            refused_share=refused_fraction(self._admission),
            counted_since=self._initial_obs,
        )
        self.decide(f"arrivals {arrival:.1f} req/s ({counted}); {capacity_note}")
        self._arrivals = self._arrivals.add(before, 0.0).add(obs, refused_fraction(self._admission))
        survivors = survivor_loads(before, obs, lost_ids)
        self._arrival_rps, self._per_group_rps, self._serving_groups = arrival, per_group, len(survivors)
        self._backlog = routed_backlog(obs, lost_ids)
        async with self._admission_lock:
            self._shed = decide_shedding(
                arrival_rps=arrival,
                survivors=survivors,
                lost_capacity_rps=per_group * len([g for g in lost if g.role is GroupRole.SERVING]),
                per_group_capacity_rps=per_group,
                keep_armed=True,  # the warm floor is short until the replacement is back
                queues=self._queue_room(self._backlog),
            )
            self._capacity_rps = self._shed.survivor_capacity_rps
            await self._apply_shedding(self._shed, step="protect-shed")
        if not inp.dry_run:
            self._keeping_admission = True
            self._admission_keeper = asyncio.ensure_future(self._keep_admission(lost_ids))
        return obs

    def _queue_room(self, backlog: float) -> QueueRoom | None:
        """What the routed replicas' queues can absorb until the keeper's next look (None: budget 0)."""
        budget = self._inp.objectives.wait_budget_s
        if budget <= 0:
            return None
        # Twice the keeper's interval: a change takes effect a moment after it is decided.
        horizon = 2 * self._admission_look_s
        return QueueRoom(wait_budget_s=budget, backlog=backlog, horizon_s=horizon)

    async def _keep_admission(self, lost_ids: set[str]) -> None:
        """From step 3 until verification: re-read the queues every ``admission_interval_s`` and re-admit.

        The queues absorb what they can of the gap; as they fill, the refused share rises to the
        gap, and when capacity returns it falls. A look that changes nothing records nothing, and
        while looks change nothing the interval backs off (``next_admission_look``).
        """
        timings = self._inp.timings
        previous: PoolObservation | None = None
        served: float | None = None
        while self._keeping_admission:
            try:
                await workflow.wait_condition(
                    lambda: not self._keeping_admission, timeout=self._admission_look_s
                )
                return
            except TimeoutError:
                pass
            obs = await self._observe(summary="admission: the routed replicas' queues")
            backlog = routed_backlog(obs, lost_ids)
            self._arrivals = self._arrivals.add(obs, refused_fraction(self._admission))
            arrival = self._arrivals.rate(ARRIVALS_COUNTED_S)
            if previous is not None:
                served = smoothed(served, routed_served_rate(previous, obs, lost_ids))
            previous = obs
            if not self._keeping_admission:
                return
            capacity, measured = capacity_to_count_on(self._capacity_rps, served)
            notes = [f"queues re-read: {backlog:.0f} request(s) waiting on the routed replicas"]
            if arrival is not None:
                notes.append(
                    f"arrivals {arrival:.1f} req/s counted by the gateway over {self._arrivals.seconds:.0f} s"
                )
            if measured:
                notes.append(measured)
            moved = await self._readmit(
                "; ".join(notes),
                capacity,
                arrival,
                backlog=backlog,
                capacity_changed=False,
            )
            bounded = workflow.patched("keeper-bounds-history")
            history_large = bounded and workflow.info().is_continue_as_new_suggested()
            if history_large and not self._keeper_parked:
                self._keeper_parked = True
                self.decide(
                    f"the recovery's history is long ({workflow.info().get_current_history_length()} events): "
                    f"the admission keeper re-reads the queues every "
                    f"{PARKED_FACTOR * timings.admission_max_interval_s:.0f} s from now on "
                    "(capacity changes still re-admit at once)"
                )
            self._admission_look_s = next_admission_look(
                self._admission_look_s,
                timings.admission_interval_s,
                timings.admission_max_interval_s,
                admission_moved=moved,
                backlog=backlog,
                awaiting_operator=bounded and self._status.phase is Phase.AWAITING_OPERATOR,
                history_large=history_large,
            )

    async def _stop_keeping_admission(self) -> None:
        self._keeping_admission = False
        if self._admission_keeper is not None:
            await self._admission_keeper
            self._admission_keeper = None

    async def _readmit(
        self,
        change: str,
        capacity_rps: float,
        arrival_rps: float | None = None,
        *,
        backlog: float | None = None,
        capacity_changed: bool = True,
    ) -> bool:
        """A capacity change or a new look at the queues: recompute the gap the queues cannot absorb
        and re-apply admission when the shed level moved (True when it did)."""
        async with self._admission_lock:
            if arrival_rps is not None:
                self._arrival_rps = arrival_rps
            if backlog is not None:
                self._backlog = backlog
            if capacity_changed:
                self._capacity_rps = capacity_rps
            decision = decide_readmission(
                self._arrival_rps,
                capacity_rps,
                change,
                warm_floor_restored=False,
                queues=self._queue_room(self._backlog),
            )
            if not admission_changed(self._admission, decision.admission):
                return False
            self._readmissions += 1
            await self._apply_shedding(decision, step=f"readmit-{self._readmissions}")
            return True

    def _record_shed_level(self, gap: float, refused: float) -> None:
        """The shed level over time (figure ``shed_levels``: at = epoch seconds, shares of arrivals)."""
        levels = list(self._status.figures.get("shed_levels") or [])
        levels.append({"at": round(self.now(), 3), "gap": round(gap, 4), "refused": round(refused, 4)})
        self.figure("shed_levels", levels)

    async def _apply_shedding(self, decision: ShedDecision, *, step: str) -> None:
        """Every change of the shed level is a decision in the incident record, and one ledger effect."""
        self.decide(decision.reason, {"shed": decision.model_dump(mode="json")})
        self._record_shed_level(decision.deficit_fraction, decision.shed_fraction)
        # Every tier refused any of during the incident, lowest first.
        touched = set(self._status.figures.get("shed_tiers") or []) | {
            t.value for t in decision.tiers_touched
        }
        self.figure("shed_tiers", [t.value for t in SHED_ORDER if t.value in touched])
        if decision.admission == self._admission:
            return
        refused = ", ".join(
            f"{t.value} {decision.admission.shed_share(t):.0%}" for t in decision.tiers_touched
        )
        await self.act(
            ActActivities.set_admission,
            AdmissionChangeRequest(step=step, pool=self._inp.pool, admission=decision.admission),
            f"admission: refuse {refused or 'nothing'} ({decision.shed_fraction:.1%} of arrivals); "
            f"queue bound {decision.admission.queue_bound}",
        )
        self._admission = decision.admission

    # ---------------------------------------------------------------- step 4

    async def decide_in_flight(self, obs: PoolObservation, lost: list[ReplicaGroup]) -> None:
        inp = self._inp
        await self.enter(Phase.IN_FLIGHT, "Deciding the lost replicas' in-flight requests")
        lost_ids = {g.id for g in lost}
        decision = decide_retry_policy(survivor_loads(obs, obs, lost_ids))
        self.decide(decision.reason, {"retry": decision.policy.model_dump(mode="json")})
        await self.act(
            ActActivities.set_retry_policy,
            RetryPolicyChangeRequest(step="in-flight-retry-policy", pool=inp.pool, retry=decision.policy),
            "retry before first byte only, budget from survivors' headroom",
        )
        leaders = [g.leader_pod for g in lost]
        journal = await self.observe(
            ObserveActivities.read_journal,
            JournalRequest(pool=inp.pool, replicas=leaders),
            f"collect the request journal of {', '.join(leaders)}",
        )
        record = in_flight_record(journal, since=(inp.first_signal_at or self._started_at) - 60.0)
        self.figure("in_flight", record)
        self.decide(
            f"lost replicas' requests: {record['retried']} retried before first byte, {record['terminal_errors']} "
            f"ended with a terminal stream error after streaming (never replayed); "
            f"{record['effect_operation_ids']} proposed effect(s) carry request-derived operation ids",
            {"in_flight": record},
        )

    # ---------------------------------------------------------------- step 5

    async def promote_warm_capacity(
        self, obs: PoolObservation, lost: list[ReplicaGroup]
    ) -> list[ReplicaGroup]:
        """Route to warm spares of the same model and revision by adding the router-only label.

        Nothing else about the spare changes: its role label may be what its own
        controller selects on, and changing it would orphan the pod.
        """
        inp = self._inp
        await self.enter(Phase.PROMOTING, "Promoting warm spares of the same model and revision")
        obs = _with_lost(obs, lost)
        # Spares on a node that failed are not warm capacity; a node that only hosted a crashed pod is fine.
        failed = sorted(failed_nodes(lost, obs.snapshot, self._reports))
        pick = pick_spares(obs.snapshot, [g.id for g in lost if g.role is GroupRole.SERVING], failed)
        self.decide(pick.reason, {"promotions": pick.promotions, "rejected": pick.rejected})
        promoted: list[ReplicaGroup] = []
        for lost_id, spare_id in pick.promotions.items():
            spare = obs.snapshot.group(spare_id)
            await self.route(
                inp.pool,
                spare.pods,
                obs.router_label,
                self._router_value(),
                step="promote",
                why=f"promote spare {spare_id} in place of {lost_id}",
            )
            promoted.append(spare)
        self.figure("promoted", [g.id for g in promoted])
        if promoted:
            self._serving_groups += len(promoted)
            await self._readmit(
                f"promoted {', '.join(g.id for g in promoted)} (warm): {self._serving_groups} serving group(s) "
                f"x {self._per_group_rps:.1f} req/s",
                pool_capacity_rps(self._per_group_rps, self._serving_groups),
            )
        self._unmatched = list(pick.unmatched)
        return promoted

    # ---------------------------------------------------------------- step 6

    async def rebuild_warm_floor(
        self, obs: PoolObservation, lost: list[ReplicaGroup], promoted: list[ReplicaGroup]
    ) -> None:
        """Replace what was used (``fleet.rebuild.plan_rebuild``: absolute counts, lost pods retired first)."""
        inp = self._inp
        await self.enter(Phase.REBUILDING, "Rebuilding the warm floor")
        obs = _with_lost(obs, lost)
        await self._fence_failed_nodes(obs, lost)
        plan = plan_rebuild(
            lost,
            promoted,
            self._unmatched,
            {(w.kind, w.name): w.replicas or 0 for w in obs.workloads},
            present_pods=obs.pods,
            pool_groups=self._initial_obs.snapshot.groups if self._initial_obs else (),
        )
        self._expected_new = plan.expected_new
        # patched: a recovery that was past this point when the worker was upgraded replays as it ran.
        retire_first = workflow.patched("retire-before-regrow")
        for workload in plan.workloads:
            await self.mark_removed_first(
                inp.pool, workload.retire_pods, step="retire-mark", why="lost pod leaves"
            )
            for n, scale in enumerate(workload.scales):
                report = await self.act(
                    ActActivities.scale_workload,
                    ScaleChange(
                        step=scale.step,
                        namespace=inp.pool.namespace,
                        kind=scale.kind,
                        name=scale.name,
                        replicas=scale.replicas,
                    ),
                    scale.summary,
                )
                self.decide(scale.summary, {"ledger": report.state})
                if retire_first and n == 0 and workload.retire_pods and len(workload.scales) > 1:
                    await self._await_retired(workload.retire_pods, f"{scale.kind} {scale.name}")
        unmatched = [g for g in lost if g.id in plan.unmatched]
        if not unmatched:
            self.figure("lead_time_announced_seconds", None)
            return
        g0 = unmatched[0]
        estimate = estimate_lead_time(
            g0.model, needs_new_node=not self._room_for(obs, g0, lost), multi_node=g0.multi_node
        )
        self.figure("lead_time_announced_seconds", round(estimate.total_s, 1))
        text = (
            f"[fleetmend] {inp.pool.key}: no warm spare for {', '.join(g.id for g in unmatched)}. "
            f"{estimate.text}. Shedding stays on until capacity returns."
        )
        await self.notify("lead-time", text)
        self.decide(text, {"lead_time": estimate.model_dump(mode="json")})

    async def _await_retired(self, pods: tuple[str, ...], workload: str) -> None:
        """Before scaling up: has the workload's controller let the lost pods go (``fleet.rebuild.still_counted``)?"""
        timings = self._inp.timings
        if self._inp.dry_run:
            return
        deadline = self.now() + timings.deroute_timeout_s
        while True:
            obs = await self._observe(light=True, summary=f"rebuild: has {workload} let the lost pods go?")
            left = still_counted(pods, obs.pods)
            if not left:
                return
            if self.now() >= deadline:
                self.decide(
                    f"{workload} still counts {', '.join(left)} {timings.deroute_timeout_s:g} s after the "
                    "scale-down that retires them: scaling up anyway (verification shows whether a "
                    "replacement came for each)",
                    {"still_counted": left},
                )
                return
            await workflow.sleep(
                timings.poll_interval_s, summary=f"rebuild: {workload} to let {', '.join(left)} go"
            )

    async def _force_delete(self, pods: list[str], why: str, lost: list[ReplicaGroup], *, step: str) -> None:
        """The last resort (DESIGN.md §3 step 2): an operator approves, the capacity guard agrees, then grace 0."""
        approval = await self.await_operator(f"approve force-delete of {', '.join(pods)} {why}")
        assert approval is not None
        self.decide(f"force-delete approved by {approval.operator}: {approval.reason}")
        await self._guard_capacity(f"force-delete of {', '.join(pods)}", removing=sorted(g.id for g in lost))
        for pod in pods:
            await self.act(
                ActActivities.delete_pod,
                PodDeletion(step=step, namespace=self._inp.pool.namespace, pod=pod),
                f"force-delete {pod} (operator-approved)",
            )

    async def _fence_failed_nodes(self, obs: PoolObservation, lost: list[ReplicaGroup]) -> None:
        """Cordon nodes that failed (not Ready, or a GPU/fabric fault) before anything is scheduled.

        Until the node controller marks a silent node unreachable, the scheduler may
        still bind a replacement to it; cordoning first keeps replacements off it.
        Triage adds the taint and label later.

        A dead machine's pods still read Running and ready for the node-monitor grace: when a lost
        pod's engine is silent and Kubernetes shows no death, the node is judged on an observation
        taken once a live kubelet would have reported a crashed container (``kubelet_report_s``
        after the loss was confirmed), so an OOM-killed engine does not fence its node.
        """
        failed = failed_nodes(lost, obs.snapshot, self._reports)
        maybe_silent = set(silent_nodes(lost, obs.pods)) - set(failed)
        # patched: a recovery that was already past this point when the worker was upgraded replays
        # as it ran (no extra look), and only new passes take it.
        if maybe_silent and workflow.patched("fence-silent-nodes"):
            wait = self._confirmed_at + self._inp.timings.kubelet_report_s - self.now()
            if wait > 0:
                await workflow.sleep(wait, summary="fence: give a live kubelet time to report a crash")
            obs = _with_lost(
                await self._observe(
                    light=True, summary=f"fence: did {', '.join(sorted(maybe_silent))} go silent?"
                ),
                lost,
            )
            failed = failed_nodes(lost, obs.snapshot, self._reports, silent_nodes(lost, obs.pods))
        self._failed_nodes = failed
        for node, why in failed.items():
            info = obs.snapshot.node(node)
            if info is not None and info.unschedulable:
                continue
            await self.act(
                ActActivities.cordon_node,
                NodeCordon(step="fence", node=node),
                f"cordon failed node {node} so no replacement lands on it",
            )
            self.decide(f"cordoned {node} ({why}): replacements must not land on the failed node")

    def _room_for(self, obs: PoolObservation, g: ReplicaGroup, lost: list[ReplicaGroup]) -> bool:
        shape = GroupShape(pods=len(g.pods), gpus_per_pod=max(1, g.gpus_per_pod))
        return place_group(shape, obs.snapshot.nodes, exclude={n for x in lost for n in x.nodes}).admissible

    # ---------------------------------------------------------------- step 7

    async def place_replacements(self, lost: list[ReplicaGroup]) -> None:
        """Wait for the scheduler; a replacement still Pending after a few looks is reported, not awaited.

        The report says *why* it cannot land: no capacity, or fragmentation ("N free
        GPUs, no admissible group for shape S") from the whole-shape placement check.
        """
        inp = self._inp
        await self.enter(Phase.PLACING, "Placing replacements: whole shape, admissible allocation")
        if inp.dry_run:
            self.decide("dry-run: placement not awaited")
            return
        deadline = self.now() + inp.timings.replacement_timeout_s
        excluded = {n for g in lost for n in g.nodes}
        lost_pods = {p for g in lost for p in g.pods}
        looks: dict[str, int] = {}
        reported: set[str] = set()
        released = False
        initial = self._initial_obs
        assert initial is not None
        while True:
            obs = await self._observe(summary="placement: pending pods and free GPUs")
            pending = {p: m for p, m in obs.pending_pods.items() if p not in lost_pods}
            waiting = awaiting_recreation(lost, initial.pod_uids, obs.pod_uids)
            held = pods_held_by_lost_nodes(
                [g for g in lost if g.id in waiting], obs.pod_nodes, obs.snapshot.nodes
            )
            if held and not released:
                released = True
                await self._force_delete(
                    held,
                    "(they sit on a node that is not Ready; their LeaderWorkerSet recreates the group only once "
                    "they are gone, and Kubernetes' taint eviction would remove them only after "
                    "tolerationSeconds, 300 s by default)",
                    lost,
                    step="release-held-pods",
                )
                continue
            if not pending and not waiting:
                self.decide("every replacement is scheduled")
                return
            for pod, message in pending.items():
                looks[pod] = looks.get(pod, 0) + 1
                if (
                    pod in reported
                    or looks[pod] < PLACEMENT_LOOKS
                    or message.startswith("Pending (no scheduling event")
                ):
                    continue
                group = obs.snapshot.group_of_pod(pod)
                shape = GroupShape(
                    pods=len(group.pods) if group else 1,
                    gpus_per_pod=max(1, group.gpus_per_pod if group else 1),
                )
                result = place_group(shape, obs.snapshot.nodes, exclude=excluded)
                if result.admissible:
                    continue  # the scheduler has somewhere to put it: give it time
                reported.add(pod)
                text = f"[fleetmend] {inp.pool.key}: replacement {pod} cannot be placed - {result.reason} ({message})"
                if result.fragmented:
                    self.figure("fragmentation", result.reason)
                self.decide(text, {"placement": result.model_dump(mode="json")})
                await self.notify(f"placement-{pod}", text)
            if reported and all(p in reported for p in pending):
                # Not silently Pending: say why, and let an operator decide (free capacity, or abort).
                approval = await self.await_operator(
                    f"replacement(s) {', '.join(sorted(reported))} cannot be placed as a whole group; free a "
                    "topology domain or add a node, then approve to keep waiting for placement (or abort)"
                )
                assert approval is not None
                self.decide(
                    f"{approval.operator}: capacity freed ({approval.reason}); waiting for placement again"
                )
                reported.clear()
                looks.clear()
                deadline = self.now() + inp.timings.replacement_timeout_s
                continue
            if self.now() > deadline:
                self.decide(f"replacements still Pending after {inp.timings.replacement_timeout_s:.0f} s")
                return
            await workflow.sleep(inp.timings.poll_interval_s, summary="wait for the scheduler")

    # ---------------------------------------------------------------- step 8

    async def triage_hardware(self, obs: PoolObservation, lost: list[ReplicaGroup]) -> None:
        hint = next((r.fault_hint for r in self._reports if r.fault_hint), None)
        failed = {**failed_nodes(lost, obs.snapshot, self._reports), **self._failed_nodes}
        nodes = []
        for node in sorted({n for g in lost for n in g.nodes}):
            if node in failed or hint:
                nodes.append(node)
            else:
                self.decide(
                    f"{node} is Ready and no report is about it: the loss is a pod-level fault, "
                    "the node stays in service (no quarantine)"
                )
        for node in nodes:
            await self._triage_node(node, hint)

    async def _triage_node(self, node: str, hint: str | None) -> None:
        health = await self.observe(
            ObserveActivities.read_node_health,
            node,
            f"triage: read DCGM, conditions and pod status of {node}",
        )
        pods = [
            PodFault(
                pod=p,
                terminated_reason=r if r in ("OOMKilled", "Error") else None,
                waiting_reason=r if r.endswith("BackOff") else None,
                status_reason=r if r in ("NodeLost", "Evicted") else None,
            )
            for p, r in health.pod_reasons.items()
        ]
        result = triage_node(
            node,
            now=self.now(),
            telemetry=health.telemetry,
            node_conditions=health.conditions,
            pods=pods,
            hint=hint,
        )
        self.figure("fault_class", result.fault_class.value)
        self.decide(
            f"triage {node}: {result.reason}; follow-up: {result.follow_up}",
            {"triage": result.model_dump(mode="json"), "machine": health.machine},
        )
        if not result.quarantine:
            return
        machine = health.machine
        history = (
            await self.observe(
                QualificationActivities.machine_history,
                MachineQuery(machine=machine),
                f"remediation history of machine {machine}",
            )
            if machine
            else []
        )
        gate = remediation_gate(
            history,
            self.now(),
            cap=self._inp.timings.remediation_cap,
            window_s=self._inp.timings.repeat_fault_window_s,
            current_workflow=workflow.info().workflow_id,
        )
        await self._quarantine(node, machine, result.fault_class.value, step="quarantine")
        if not gate.allowed:
            self.figure("needs_operator", f"{node}: {gate.reason}")
            self.decide(
                f"{node} ({machine}): {gate.reason}; it stays quarantined",
                {"history": [r.model_dump() for r in history]},
            )
            await self.notify(
                f"remediation-cap-{node}",
                f"[fleetmend] {self._status.pool.key}: {node} (machine {machine}) {gate.reason}. It stays "
                f"cordoned and tainted ({QUARANTINE_TAINT_KEY}); follow-up: {result.follow_up}",
            )
            return
        if health.node is None or health.node.ready is not True or health.telemetry is None:
            self.decide(f"{node} is not reachable: qualification runs when it is back; it stays quarantined")
            return
        assert machine is not None and health.uid is not None
        gpus = health.gpu_capacity
        await self._qualify(node, machine, health.uid, gpus, result.fault_class.value, result.follow_up)

    async def _quarantine(self, node: str, machine: str | None, fault_class: str, *, step: str) -> None:
        """Cordon + label + taint, recorded with the machine (the ledger's history is keyed on it)."""
        await self.act(
            ActActivities.cordon_node,
            NodeCordon(
                step=step,
                node=node,
                machine=machine,
                labels={QUARANTINE_LABEL: fault_class},
                annotations={
                    FAULT_CLASS_ANNOTATION: fault_class,
                    REMEDIATED_AT_ANNOTATION: f"{self.now():.0f}",
                    MACHINE_ANNOTATION: machine,
                },
            ),
            f"quarantine {node}: cordon + label ({fault_class}, machine {machine})",
        )
        await self.act(
            ActActivities.taint_node,
            NodeTaint(
                step=f"{step}-taint", node=node, taint_key=QUARANTINE_TAINT_KEY, taint_value=fault_class
            ),
            f"quarantine {node}: taint {QUARANTINE_TAINT_KEY}={fault_class}:NoSchedule",
        )
        if node not in self._quarantined:
            self._quarantined.append(node)

    async def _qualify(
        self, node: str, machine: str, uid: str, gpus: int, fault_class: str, follow_up: str
    ) -> None:
        """Qualification Jobs until one passes (the node returns) or the attempts or the repair wait run out."""
        timings = self._inp.timings
        for attempt in range(timings.qualification_attempts):
            created = await self.act(
                QualificationActivities.create_qualification_job,
                QualificationJobRequest(step=f"qualify-{attempt}", node=node, machine=machine, gpus=gpus),
                f"qualification Job on {node} (DCGM diagnostics, all its GPUs), attempt {attempt + 1}",
            )
            if created.state != "applied":
                self.decide(f"{node}: no qualification Job ({created.state}); it stays quarantined")
                return
            name = str((created.result or {}).get("name"))
            self.decide(
                f"qualification Job {name} created on {node}; it returns to the pool only if it passes"
            )
            verdict = await self._await_job(name, node, machine)
            await self.act(
                QualificationActivities.delete_qualification_job,
                QualificationJobRef(step=f"qualify-{attempt}-delete", name=name, node=node),
                f"delete qualification Job {name}",
            )
            self.figure(
                "qualification", {"node": node, "attempt": attempt + 1, **verdict.model_dump(mode="json")}
            )
            if verdict.state == QualificationState.PASSED:
                await self.act(
                    QualificationActivities.return_node,
                    NodeReturn(
                        step="return-node",
                        node=node,
                        machine=machine,
                        uid=uid,
                        labels={QUARANTINE_LABEL: None},
                    ),
                    f"return {node} to the pool: qualification passed",
                )
                self._quarantined.remove(node)
                self.decide(
                    f"{node} passed qualification ({verdict.detail}); uncordoned, untainted, returned"
                )
                return
            self.decide(
                f"{node} failed qualification ({verdict.detail}): it stays out for the {fault_class} follow-up",
                {"failures": list(verdict.failures)},
            )
            await self.notify(
                f"qualification-failed-{node}-{attempt}",
                f"[fleetmend] {self._status.pool.key}: {node} failed qualification: {verdict.detail}. It stays "
                f"quarantined; follow-up: {follow_up}",
            )
            if attempt + 1 >= timings.qualification_attempts:
                return
            current = await self._await_repair(node, machine, uid, fault_class)
            if current is None:
                return
            uid = current

    async def _await_job(self, name: str, node: str, machine: str) -> Verdict:
        deadline = self.now() + self._inp.timings.qualification_timeout_s
        while True:
            reading = await self.observe(
                QualificationActivities.read_qualification_job,
                QualificationRead(name=name, node=node, machine=machine),
                f"qualification Job {name}",
            )
            if reading.verdict.state != QualificationState.RUNNING:
                return reading.verdict
            if self.now() > deadline:
                return reading.verdict.model_copy(
                    update={
                        "state": QualificationState.FAILED,
                        "detail": f"no verdict after {self._inp.timings.qualification_timeout_s:.0f} s: {reading.verdict.detail}",
                    }
                )
            await workflow.sleep(
                max(self._inp.timings.poll_interval_s, 1.0), summary=f"qualification of {node}"
            )

    async def _await_repair(self, node: str, machine: str, uid: str, fault_class: str) -> str | None:
        """Watch for the follow-up's repair (no Xid, every GPU offered, node free) of *this machine*.

        Returns the node object's uid to qualify (a re-created object of the same machine is
        quarantined again first), or None: no repair in time, or the name now holds another machine.
        """
        wait_s = self._inp.timings.repair_wait_s
        if wait_s <= 0:
            return None
        deadline = self.now() + wait_s
        self.decide(f"watching {node} for a repair for up to {wait_s:.0f} s before qualifying it again")
        gone_seen = False
        last = "no reading yet"
        told: set[str] = set()
        while self.now() <= deadline:
            await workflow.sleep(
                max(self._inp.timings.poll_interval_s, 1.0), summary=f"wait for the repair of {node}"
            )
            health = await self.observe(ObserveActivities.read_node_health, node, f"repair of {node}?")
            seen = identity(machine, uid, health.machine, health.uid)
            if seen is Identity.GONE:
                if not gone_seen:
                    self.decide(
                        f"{node} has no node object now; machine {machine} stays quarantined (ledger)"
                    )
                gone_seen = True
                last = "no node object"
                continue
            if seen is Identity.REPLACED:
                if node in self._quarantined:
                    self._quarantined.remove(node)  # the quarantined machine left; verification checks names
                self.decide(
                    f"{node} is now machine {health.machine}, not the quarantined {machine}: a new machine, "
                    "neither quarantined nor qualified on the old one's behalf; the old machine's quarantine "
                    "stays on record"
                )
                return None
            if seen is Identity.RECREATED:
                assert health.uid is not None
                await self._quarantine(node, machine, fault_class, step=f"quarantine-{health.uid[:8]}")
                self.decide(
                    f"{node} was re-created (uid {health.uid}) for the same machine {machine}: still "
                    "quarantined, cordoned and tainted again"
                )
                uid = health.uid
                last = f"re-created as uid {health.uid}, quarantined again"
                continue
            xids = {g.gpu: g.last_xid or 0 for g in health.telemetry.gpus} if health.telemetry else {"?": 1}
            if not repaired(health.conditions, xids, health.gpu_capacity, health.gpu_allocatable):
                last = (
                    f"GPU problem still shown ({health.gpu_allocatable}/{health.gpu_capacity} GPUs offered, "
                    f"Xid {max(xids.values(), default=0)})"
                )
                continue
            if health.gpu_holders:
                last = await self._clear_for_qualification(node, health.gpu_holders, told)
                continue
            self.decide(
                f"{node} looks repaired (no Xid, {health.gpu_allocatable}/{health.gpu_capacity} GPUs "
                "offered, no pods): qualifying again"
            )
            return uid
        self.decide(
            f"no repair of {node} seen within {wait_s:.0f} s (last seen: {last}): it stays quarantined "
            "until an operator acts"
        )
        return None

    async def _clear_for_qualification(self, node: str, holders: list[GpuHolder], told: set[str]) -> str:
        """A repaired machine still holding pods (a warm spare left on it, or one placed while a
        re-created node object was not yet quarantined): qualification needs every GPU. Warm spares
        are deleted gracefully (a spare on quarantined hardware is no spare; cordoned, the node gets
        none back); anything else only an operator moves. Returns what still holds the machine."""
        clearing = clear_for_qualification(holders)
        spares = [h for h in clearing.delete if h.pod not in told]  # still terminating: asked already
        for held in spares:
            await self.act(
                ActActivities.delete_pod,
                PodDeletion(step=f"clear-{node}", namespace=held.namespace, pod=held.pod, grace_period_s=5),
                f"delete warm spare {held.pod} on quarantined {node}: qualification needs all its GPUs",
            )
            told.add(held.pod)
        if spares:
            self.decide(
                f"{node} looks repaired but holds warm spare(s) {', '.join(h.pod for h in spares)}: "
                "deleted gracefully (a spare on quarantined hardware is no spare; their controller places "
                "them elsewhere) so qualification gets every GPU"
            )
        others = [h.pod for h in clearing.operator if h.pod not in told]
        if others:
            told.update(others)
            text = (
                f"{node} looks repaired but {', '.join(others)} hold(s) GPUs on it: fleetmend does not move "
                "them; qualification waits until the machine is empty"
            )
            self.decide(text)
            await self.notify(f"occupied-{node}-{len(told)}", f"[fleetmend] {self._status.pool.key}: {text}")
        return "pods hold its GPUs: " + ", ".join(f"{h.pod} ({h.gpus})" for h in holders)

    # ---------------------------------------------------------------- step 9

    async def ramp_back(self, promoted: list[ReplicaGroup]) -> None:
        inp = self._inp
        await self.enter(Phase.RAMPING, "Ramping traffic back by measured service rate")
        if inp.dry_run:
            self.decide("dry-run: ramp not performed")
            return
        initial = self._initial_obs
        assert initial is not None
        new_pods = {g.leader_pod for g in promoted}
        deadline = self.now() + inp.timings.ramp_max_s
        previous: dict[str, EngineSnapshot] | None = None
        previous_at = 0.0
        step = 0
        backoff: dict[str, float] = {}
        while True:
            obs = await self._observe(summary="ramp: routed replicas and their engines")
            new_pods |= new_leaders(initial, obs)
            routed_leaders = sorted(
                g.leader_pod
                for g in obs.snapshot.groups
                if g.routed and g.ready and g.leader_pod in obs.routed_pods
            )
            if not new_pods & set(routed_leaders):
                if self.now() > deadline:
                    self.decide("no new replica to ramp (none routed yet, none pending)")
                    return
                await workflow.sleep(
                    inp.timings.poll_interval_s, summary="wait for a replacement to be ready"
                )
                continue
            current = await self.observe(
                ObserveActivities.scrape_engines,
                ScrapeRequest(pool=inp.pool, pods=routed_leaders),
                f"ramp: measure {len(routed_leaders)} replicas",
            )
            if previous is not None:
                plan = plan_weights(
                    previous,
                    current,
                    max(1e-3, self.now() - previous_at),
                    sorted(new_pods & set(routed_leaders)),
                    ttft_slo_s=inp.objectives.ttft_p99_slo_s,
                    warm_fraction=inp.timings.warm_fraction,
                    backoff=backoff,
                )
                backoff = dict(plan.backoff)
                step += 1
                await self._readmit_from_ramp(step, previous, current, previous_at, new_pods, plan)
                await self.act(
                    ActActivities.set_weights,
                    WeightsChangeRequest(step=f"ramp-{step}", pool=inp.pool, weights=plan.weights),
                    f"ramp step {step}: weights by measured rate",
                )
                self.figure("ramp_weights", plan.weights)
                self.decide(
                    f"ramp step {step}: {plan.reason}", {"weights": plan.weights, "rates": plan.rates}
                )
                ramped = new_pods & set(routed_leaders)
                if (plan.all_warm and len(ramped) >= self._expected_new) or self.now() > deadline:
                    self.decide("new replicas warm: ramp complete" if plan.all_warm else "ramp window over")
                    return
            previous, previous_at = current, self.now()
            await workflow.sleep(inp.timings.ramp_interval_s, summary=f"ramp interval (step {step})")

    async def _readmit_from_ramp(
        self,
        step: int,
        previous: dict[str, EngineSnapshot],
        current: dict[str, EngineSnapshot],
        previous_at: float,
        new_pods: set[str],
        plan: RampPlan,
    ) -> None:
        """Each ramp step re-measures capacity (new replicas at their warmth) and arrivals, and re-admits."""
        seconds = max(1e-3, self.now() - previous_at)
        # Arrivals as the gateway counted them since the first look; the engines' admissions only
        # when the gateway keeps no count.
        arrival = self._arrivals.rate(ARRIVALS_COUNTED_S)
        if arrival is not None:
            counted = (
                f"arrivals {arrival:.1f} req/s counted by the gateway over {self._arrivals.seconds:.0f} s"
            )
        else:
            admitted = admitted_rate(previous, current, seconds)
            arrival = estimate_arrivals(admitted, self._admission, self._arrival_rps)
            counted = f"the engines admitted {admitted:.1f} req/s"
        established, warmth = ramp_capacity_shape(plan, new_pods)
        await self._readmit(
            f"ramp step {step}: {established} established group(s) + new "
            + (", ".join(f"{p} {w:.0%} warm" for p, w in sorted(warmth.items())) or "none")
            + f" x {self._per_group_rps:.1f} req/s; {counted}",
            pool_capacity_rps(self._per_group_rps, established, warmth),
            arrival,
        )

    # ---------------------------------------------------------------- step 10

    async def verify_and_roll_back(self, lost: list[ReplicaGroup]) -> None:
        inp = self._inp
        await self.enter(Phase.VERIFYING, "Verifying before lifting the emergency measures")
        await self._stop_keeping_admission()
        if inp.dry_run:
            self.decide("dry-run: nothing to verify; the plan is in the ledger as planned effects")
            return
        lost_ids = {g.id for g in lost}
        while True:
            report, before, obs = await self._verify(lost_ids)
            if report.passed:
                break
            failing = "; ".join(
                f"{c.name} observed {c.observed} expected {c.expected}" for c in report.checks if not c.passed
            )
            # A failed verification keeps the incident open: retry verifies again, skip accepts it as is.
            refusal = Refusal(step="verify", what="verification of the recovered pool", error=failing)
            if await self.escalate(refusal) == "skip":
                break
        await self.enter(Phase.ROLLING_BACK, "Rolling back the emergency measures")
        if self._admission != Admission():
            lift = can_lift_shedding(
                warm_groups=sum(1 for g in obs.snapshot.groups if g.ready),
                warm_floor=self._warm_target(),
                replacement_warm=report.passed,
                survivors=survivor_loads(before, obs, lost_ids),
            )
            self.decide(f"lift shedding? {lift.reason}")
            if lift.lift or report.passed:
                await self.act(
                    ActActivities.set_admission,
                    AdmissionChangeRequest(
                        step="rollback-lift-shedding", pool=inp.pool, admission=Admission()
                    ),
                    "lift shedding: warm floor restored",
                )
                self._admission = Admission()
                self._record_shed_level(0.0, 0.0)
                self.figure("shedding_lifted", True)

    async def _verify(
        self, lost_ids: set[str]
    ) -> tuple[VerificationReport, PoolObservation, PoolObservation]:
        """Poll the checks until they pass or the verify timeout is over; the last report is recorded."""
        inp = self._inp
        initial = self._initial_obs
        assert initial is not None
        deadline = self.now() + inp.timings.verify_timeout_s
        last_failing = ""
        while True:
            before = await self._observe(summary="verify: first scrape")
            await workflow.sleep(inp.timings.poll_interval_s, summary="verify: interval")
            obs = await self._observe(summary="verify: second scrape")
            reconcile = await self.observe(
                AuditActivities.reconcile_workflow,
                ReconcileRequest(workflow_id=workflow.info().workflow_id),
                "verify: ledger reconciliation",
            )
            observations = recovery_observations(
                initial,
                before,
                obs,
                lost_ids,
                baseline_waiting=self._baseline,
                quarantined=self._quarantined,
                reconcile=reconcile,
            )
            # The warm floor to restore is what the pool had before the loss (serving + spare).
            report = verify_recovery(observations, inp.objectives, warm_floor=self._warm_target())
            if report.passed or self.now() > deadline:
                break
            failing = ", ".join(c.name for c in report.checks if not c.passed)
            if failing != last_failing:
                last_failing = failing
                self.decide(
                    "verification waiting on: "
                    + "; ".join(
                        f"{c.name} (observed {c.observed}, expected {c.expected})"
                        for c in report.checks
                        if not c.passed
                    )
                )
            self.set_details(f"**Verifying** — waiting on: {failing}")
            await workflow.sleep(inp.timings.poll_interval_s, summary=f"verify: waiting on {failing}"[:190])
        self._status.verification = report
        self.decide(
            "verification "
            + ("passed" if report.passed else "FAILED: ")
            + ", ".join(c.name for c in report.checks if not c.passed),
            {"checks": [c.model_dump(mode="json") for c in report.checks]},
        )
        return report, before, obs

    def _warm_target(self) -> int:
        assert self._initial_obs is not None
        return warm_groups_before(self._initial_obs)

    # ================================================================ operator steering and losses

    @workflow.signal(name="add_losses", description="Further losses within the incident's correlation window")
    def add_losses(self, reports: list[LossReport]) -> None:
        self._new_reports.extend(reports)

    async def _guard_capacity(self, action: str, removing: list[str]) -> None:
        """Capacity-aware storm protection before a destructive step (DESIGN.md §6a).

        If the groups left after the step could not carry what the pool serves now,
        stop and ask an operator — never silently proceed.
        """
        before = await self._observe(summary=f"guard: capacity before {action}")
        await workflow.sleep(self._inp.timings.poll_interval_s, summary="guard: measurement interval")
        after = await self._observe(summary=f"guard: capacity before {action}")
        decision = recovery_guard(action, before, after, removing, self._inp.objectives.min_serving_groups)
        self.decide(decision.reason, {"guard": decision.model_dump(mode="json")})
        if not decision.allowed:
            await self.await_operator(decision.reason)

    async def on_phase_entered(self, phase: Phase) -> None:
        # Losses reported meanwhile (same correlation window) are derouted at the next boundary.
        if self._new_reports and phase not in (Phase.CONFIRMING, Phase.AWAITING_OPERATOR):
            await self._absorb_new_losses()

    async def _absorb_new_losses(self) -> None:
        reports, self._new_reports = self._new_reports, []
        self._reports.extend(reports)
        self.set_fingerprints([r.fingerprint for r in self._reports])
        obs = await self._observe(check_progress=True, summary="confirm further losses")
        confirmed = self._confirm(obs, reports)
        more = [g for g in confirmed if g.id not in self._lost_ids]
        if confirmed and not more:
            # The alert that follows the fast path (or a second alert) names groups this recovery
            # already handles: absorbed, nothing to deroute again.
            self.decide(
                f"further report(s) name group(s) already handled: {', '.join(sorted(g.id for g in confirmed))}"
            )
        if more:
            self._lost_ids.update(g.id for g in more)
            # The steps still ahead (promote, rebuild, place, triage, verify) handle them too.
            self._lost_groups.extend(more)
            self.decide(
                f"{len(more)} more group(s) lost within the correlation window: "
                f"{', '.join(g.id for g in more)}; derouting them now"
            )
            await self.stop_routing(obs, more)

    async def _observe(
        self, *, check_progress: bool = False, light: bool = False, summary: str
    ) -> PoolObservation:
        focus: list[str] = []
        if check_progress:
            focus = sorted({r.replica_group or r.pod or "" for r in self._reports} - {""})
        return await self.observe(
            ObserveActivities.observe_pool,
            ObserveRequest(
                pool=self._inp.pool,
                check_progress_of=focus,
                focus_nodes=sorted({r.node for r in self._reports if r.node}),
                focus_pods=sorted({r.pod for r in self._reports if r.pod}),
                light=light,
            ),
            summary,
        )

    def _router_value(self) -> str:
        assert self._initial_obs is not None
        return self._initial_obs.router_label_value


def _with_lost(obs: PoolObservation, lost: list[ReplicaGroup]) -> PoolObservation:
    """The observation with the lost groups as confirmed (a deleted pod no longer shows up)."""
    present = {g.id for g in obs.snapshot.groups}
    missing = tuple(g for g in lost if g.id not in present)
    if not missing:
        return obs
    return obs.model_copy(
        update={"snapshot": obs.snapshot.model_copy(update={"groups": obs.snapshot.groups + missing})}
    )


__all__ = ["CheckResult", "IncidentCause", "ReplicaLossRecovery"]
