"""PlannedScaleDown: retire replica groups without cutting a single live token stream (DESIGN.md §4).

Lock the door, let seated tables finish, then turn out the lights:

1. **choose victims** - whole groups only, never the last warm copy of a
   revision, never below the warm floor, least loaded / coldest first; the
   capacity guard stops and asks (``approve``) if the rest cannot carry demand;
2. **mark not-ready** (readiness gate ``fleetmend.io/serving-ready`` False) and
   **stop routing** (remove the router-only label);
3. **drain** - poll the victims' running + waiting requests to zero, bounded by
   the drain deadline; at the deadline report what is still streaming and wait
   for ``extend`` or ``accept_cut`` (no answer: extend once, then ask again) -
   ``workflows/drain.py``, a base of this workflow;
4. **terminate** - deletion cost on the victims, then scale the workload to an
   absolute count, so the drained pods are the ones removed;
5. **verify** - the remaining groups ready, no victim stream cut (unless an
   operator accepted it), ledger reconcile clean.

The run yields while a replica-loss incident is open on the same pool (phase
``yielding-to-incident``, with the incident named in the status). Every mutation
goes through the procedure toolkit (``workflows/procedure.py``): the ledger, under an
operation id unique to this scale-down, and the one refused-effect policy - a refused
claim, gate, deroute or scale stops the step and asks an operator (``retry`` /
``skip`` / ``abort``).
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.act import ActActivities, ScaleChange
    from activities.audit import AuditActivities, ReconcileRequest
    from activities.coordination import IncidentState, incident_on_pool
    from activities.drain import CutStreamsRequest, DrainActivities
    from activities.readiness import ReadinessActivities, ServingReadyChange
    from fleet import search_attributes as sa
    from fleet.capacity import scale_down_guard
    from fleet.incident import PLANNED_SCALE_DOWN_WORKFLOW
    from fleet.observation import PoolObservation
    from fleet.pool import ReplicaGroup
    from fleet.recovery import OperatorAction, Phase, ProcedureStatus, Refusal
    from fleet.scale_down import (
        DRAINING_ANNOTATION,
        ScaleDownInput,
        others_terminating,
        ready_without,
        serving_without,
        termination_overdue,
        victim_pods,
        victims_by_workload,
        victims_present,
        workload_scale,
    )
    from fleet.verification import verify_scale_down
    from fleet.victims import choose_victims, group_loads
    from workflows.drain import Drain
    from workflows.procedure import Aborted


@workflow.defn(name=PLANNED_SCALE_DOWN_WORKFLOW)
class PlannedScaleDown(Drain):
    @workflow.init
    def __init__(self, inp: ScaleDownInput) -> None:
        # Status exists before the run starts: an Update delivered with the first task sees a running procedure.
        status = ProcedureStatus(
            workflow=workflow.info().workflow_id,
            pool=inp.pool,
            phase=Phase.CHOOSING_VICTIMS,
            dry_run=inp.dry_run,
        )
        status.figures.update(
            {
                "requested_by": inp.requested_by,
                "target_groups": inp.target_groups,
                "drain_deadline_s": inp.drain_deadline_s,
                "dry_run": inp.dry_run,
            }
        )
        super().__init__(
            status, budget=inp.retry, dry_run=inp.dry_run, operator_wait_s=inp.operator_timeout_s
        )
        self._inp = inp
        self._victims: list[ReplicaGroup] = []
        self._drain_since: float | None = None

    # ================================================================ the procedure

    @workflow.run
    async def run(self, inp: ScaleDownInput) -> ProcedureStatus:
        self.begin("scale-down", inp.pool)
        try:
            await self.yield_to_incident("before choosing victims")
            obs = await self.choose_victims()
            if not self._victims:
                return self.finish(Phase.DONE)
            await self.guard_capacity(obs)
            await self.mark_not_ready(obs)
            await self.drain(inp, [g.leader_pod for g in self._victims])
            await self.yield_to_incident("before terminating")
            await self.terminate()
            await self.verify(obs)
            return self.finish(Phase.DONE)
        except Aborted:
            return self.finish(Phase.ABORTED)

    # ---------------------------------------------------------------- yielding

    async def yield_to_incident(self, when: str) -> None:
        """Wait while a replica-loss incident is open on this pool; give up (abort) after the bound."""
        inp = self._inp
        started = self.now()
        state = await self._incident_on_pool(when)
        if not state.open:
            return
        previous = self._status.phase
        self.decide(f"yielding {when}: {state.reason}", {"incident": state.workflow_id})
        self.figure("yielded_to", state.workflow_id)
        await self.enter(
            Phase.YIELDING,
            f"**Yielding** to {state.reason}: a scale-down must not take replicas away while the "
            f"pool is recovering. Re-checking every {inp.incident_poll_s:g} s.",
        )
        state, over = await self.poll(
            lambda: self._incident_on_pool(when, checkpoint=True),
            lambda s: not s.open,
            interval_s=inp.incident_poll_s,
            deadline=started + inp.incident_yield_max_s,
            summary=f"yielding to {state.workflow_id}",
            first=state,
        )
        if not over:
            self.decide(
                f"gave up after yielding {self.now() - started:.0f} s to {state.workflow_id}; nothing was "
                "removed after the incident opened - run the scale-down again once the pool has recovered"
            )
            raise Aborted()
        self.decide(f"incident over ({state.reason}); resuming {when}")
        await self.enter(previous, f"resumed after the incident ({state.reason})")

    # ---------------------------------------------------------------- step 1

    async def choose_victims(self) -> PoolObservation:
        inp = self._inp
        await self.enter(Phase.CHOOSING_VICTIMS, "Choosing victims: whole groups, the cheapest to lose")
        obs = await self.observe_pool(inp.pool, "choose victims: read pool, engines")
        try:
            choice = choose_victims(
                obs.snapshot,
                target_groups=inp.target_groups,
                explicit=inp.victims,
                loads=group_loads(obs.engines),
                warm_floor=inp.warm_floor,
            )
        except ValueError as err:
            raise ApplicationError(f"bad scale-down request: {err}", non_retryable=True) from err
        self.decide(choice.reason, {"choice": choice.model_dump(mode="json")})
        self.figure("serving_before", len(obs.snapshot.serving))
        self.figure("victims", list(choice.victims))
        if choice.victims and not choice.complete:
            await self._ask_operator(
                f"only {len(choice.victims)} of {choice.wanted} victim(s) are safe to remove "
                f"({'; '.join(f'{g}: {why}' for g, why in choice.blocked.items())}); approve to remove "
                f"{', '.join(choice.victims)} only, or abort"
            )
        self._victims = [obs.snapshot.group(g) for g in choice.victims]
        if self._victims:
            workflow.upsert_search_attributes(
                [sa.FLEETMEND_REPLICA_GROUP.value_set(",".join(choice.victims)[:250])]
            )
        return obs

    async def guard_capacity(self, obs: PoolObservation) -> None:
        """Capacity-aware guard (DESIGN.md §6a): can the groups left carry today's demand?

        The serving rates are two looks an interval apart; the first is the one victims were chosen by.
        """
        inp = self._inp
        _, after = await self.window(
            lambda summary: self.observe_pool(inp.pool, summary),
            max(inp.poll_interval_s, 1.0),
            summary="guard: serving rate of every group",
            first=obs,
        )
        decision, demand = scale_down_guard(
            obs,
            after,
            [g.id for g in self._victims],
            min_groups=inp.min_serving_groups,
            headroom=inp.capacity_headroom,
            group_capacity_tokens_per_s=inp.group_capacity_tokens_per_s,
        )
        self.decide(decision.reason, {"guard": decision.model_dump(mode="json")})
        self.figure("demand_tokens_per_s", round(demand, 1))
        if not decision.allowed:
            await self._ask_operator(decision.reason)

    # ---------------------------------------------------------------- step 2

    async def mark_not_ready(self, obs: PoolObservation) -> None:
        inp = self._inp
        wid = workflow.info().workflow_id
        pods = victim_pods(self._victims)
        await self.enter(Phase.MARKING_NOT_READY, f"Marking {', '.join(pods)} not ready and out of routing")
        label = obs.router_label
        selecting = obs.controllers_selecting(label)
        self._drain_since = self.now()
        for pod in pods:
            # Claim first: the readiness keeper leaves a claimed pod's gate alone.
            await self.annotate(
                inp.pool,
                pod,
                {DRAINING_ANNOTATION: wid},
                step="claim-for-drain",
                why=f"claim {pod} for the drain",
            )
            await self.act(
                ReadinessActivities.set_serving_ready,
                ServingReadyChange(
                    step="mark-not-ready",
                    namespace=inp.pool.namespace,
                    pod=pod,
                    ready=False,
                    reason="ScaleDown",
                ),
                f"readiness gate false on {pod}",
            )
        if selecting:
            names = ", ".join(f"{w.kind}/{w.name}" for w in selecting)
            self.decide(
                f"keeping label {label}: {names} select(s) on it (removing it would orphan the pods); "
                "the readiness gate alone takes them out of the EndpointSlice"
            )
            seen = await self.await_out_of_routing(inp.pool, pods, timeout_s=60.0)
        else:
            seen = await self.deroute(
                inp.pool, pods, label, step="stop-routing", why="stop new requests", timeout_s=60.0
            )
        if seen is None:
            self.decide(f"dry-run: would mark {', '.join(pods)} not ready and stop routing to them")
            return
        self.figure("stop_routing_seconds", round(max(0.0, seen.at - self._drain_since), 3))
        self.decide(f"no new requests go to {', '.join(pods)}")

    # ---------------------------------------------------------------- step 3: Drain.drain (workflows/drain.py)

    # ---------------------------------------------------------------- step 4

    async def terminate(self) -> None:
        inp = self._inp
        pods = victim_pods(self._victims)
        await self.enter(Phase.TERMINATING, f"Terminating the drained {', '.join(pods)}")
        await self.mark_removed_first(inp.pool, pods, step="deletion-cost", why="drained victim leaves")
        for (kind, name), groups in victims_by_workload(self._victims).items():
            await self._scale_down_workload(kind, name, groups)
        if inp.dry_run:
            self.decide(f"dry-run: would wait for {', '.join(pods)} to terminate")
            return
        started = self.now()
        last: PoolObservation | None = None
        while True:
            obs, gone = await self.poll(
                lambda: self._termination_look(pods),
                lambda o: not victims_present(o, pods),
                interval_s=inp.poll_interval_s,
                deadline=started + inp.terminate_timeout_s,
                summary="wait for the victims to terminate",
                first=last,  # after an operator's retry: an interval first, then the next look
            )
            last = obs
            if gone:
                self.figure("terminate_seconds", round(self.now() - started, 2))
                self.decide(f"{', '.join(pods)} terminated")
                return
            overdue = termination_overdue(victims_present(obs, pods), inp.terminate_timeout_s)
            if await self.escalate(overdue) == "skip":
                return
            started = self.now()

    async def _scale_down_workload(self, kind: str, name: str, groups: list[ReplicaGroup]) -> None:
        """Scale one workload to an absolute count without the victims; what blocks it goes to an operator."""
        inp = self._inp
        while True:
            obs = await self.observe_pool(inp.pool, "terminate: current workload replicas")
            scale = workload_scale(obs, inp.pool.namespace, kind, name, groups)
            if scale.problem is None:
                break
            refusal = Refusal(step="terminate-scale", what=f"scale {kind}/{name}", error=scale.problem)
            if await self.escalate(refusal) == "skip":
                return
        current, replicas = scale.current, scale.replicas
        self.decide(
            f"scale {kind}/{name} from {current} to {replicas} replica groups (absolute)",
            {"workload": f"{kind}/{name}", "from": current, "to": replicas},
        )
        await self.act(
            ActActivities.scale_workload,
            ScaleChange(
                step="terminate-scale", namespace=inp.pool.namespace, kind=kind, name=name, replicas=replicas
            ),
            f"scale {kind}/{name} to {replicas}",
        )

    # ---------------------------------------------------------------- step 5

    async def verify(self, before: PoolObservation) -> None:
        inp = self._inp
        await self.enter(Phase.VERIFYING, "Verifying: remaining ready, no stream cut, ledger clean")
        if inp.dry_run:
            self.decide(
                "dry-run: nothing was removed, so nothing to verify; the plan is in the ledger as planned"
            )
            return
        victim_ids = {g.id for g in self._victims}
        target = serving_without(before.snapshot, victim_ids)
        announced = False

        def settling(obs: PoolObservation) -> None:
            nonlocal announced
            if not announced:
                announced = True
                self.decide(
                    f"{ready_without(obs.snapshot, victim_ids)} of {target} remaining groups read ready and "
                    f"routed: waiting up to {inp.verify_settle_s:.0f} s for them to settle before verifying"
                )

        obs, _ = await self.poll(
            lambda: self.observe_pool(inp.pool, "verify: remaining replica groups"),
            lambda o: ready_without(o.snapshot, victim_ids) >= target,
            interval_s=inp.poll_interval_s,
            deadline=self.now() + inp.verify_settle_s,
            summary="verify: let the remaining groups settle",
            on_miss=settling,
        )
        ready = ready_without(obs.snapshot, victim_ids)
        # patched: a scale-down that counted its cut streams at once replays as it ran.
        if workflow.patched("count-cuts-once-victims-are-gone"):
            # A victim's streams end when its engine exits and Envoy reports them a flush (0.2 s) later:
            # count them once every victim pod is gone, one poll interval after that.
            pods = set(victim_pods(self._victims))
            await self.poll(
                lambda: self.observe_pool(inp.pool, "verify: are the victims' pods gone?", light=True),
                lambda o: not pods & set(o.pods),
                interval_s=inp.poll_interval_s,
                deadline=self.now() + inp.verify_settle_s,
                summary="verify: the victims' pods to be gone before counting cut streams",
            )
            await workflow.sleep(inp.poll_interval_s, summary="verify: Envoy's last access-log flush")
        cut = await self.observe(
            DrainActivities.cut_streams,
            CutStreamsRequest(pool=inp.pool, replicas=victim_pods(self._victims), since=self._drain_since),
            "gateway journal: did any victim stream end cut?",
        )
        reconcile = await self.observe(
            AuditActivities.reconcile_workflow,
            ReconcileRequest(workflow_id=workflow.info().workflow_id),
            "ledger reconcile: no duplicate, no orphan",
        )
        accepted = self._cut_accepted is not None
        progress = self._last_progress
        report = verify_scale_down(
            target_groups=target,
            ready_groups=ready,
            cut_streams=cut.cut,
            victims_in_flight=progress.in_flight if progress else 0,
            ledger=reconcile,
            accepted_cut=accepted,
        )
        self._status.verification = report
        self.figure("cut_streams", cut.cut)
        self.figure("cut_request_ids", cut.cut_request_ids)
        self.figure("victim_requests_completed", cut.completed)
        self.figure("serving_after", ready)
        self.decide(
            f"verification {'passed' if report.passed else 'FAILED'}: {ready} of {target} remaining groups "
            f"ready, {cut.cut} stream(s) cut" + (" (accepted by an operator)" if accepted else ""),
            {"verification": report.model_dump(mode="json")},
        )
        if not report.passed:
            failing = "; ".join(
                f"{c.name}: observed {c.observed}, expected {c.expected}"
                for c in report.checks
                if not c.passed
            )
            # Replicas are gone by now: a failed verification stays visible until an operator answers.
            refusal = Refusal(step="verify", what="scale-down verification", error=failing)
            if await self.escalate(refusal) == "retry":
                await self.verify(before)

    # ================================================================ operator steering

    async def _ask_operator(self, what: str) -> OperatorAction:
        timeout_s = self._inp.operator_timeout_s
        approval = await self.await_operator(what, timeout_s)
        if approval is None:
            # Nothing was removed yet: give up cleanly rather than block the schedule's next runs (overlap skip).
            self.decide(
                f"nobody approved within {timeout_s:g} s: {what}; nothing was removed - the scale-down ends here"
            )
            raise Aborted()
        self.decide(f"approved by {approval.operator}: {approval.reason}")
        return approval

    # ================================================================ looks

    async def _incident_on_pool(self, when: str, *, checkpoint: bool = False) -> IncidentState:
        if checkpoint:  # between re-checks an operator may pause or abort
            await self.checkpoint()
        inp = self._inp
        state: IncidentState = await self.call(
            incident_on_pool, inp.pool, f"is a replica-loss incident open on {inp.pool.key}? ({when})"
        )
        return state

    async def _termination_look(self, pods: list[str]) -> PoolObservation:
        obs = await self.observe_pool(self._inp.pool, "terminate: are the victims gone?")
        if wrong := others_terminating(obs, pods):
            self.figure("non_victims_terminating", wrong)
        return obs


__all__ = ["PlannedScaleDown", "ScaleDownInput"]
