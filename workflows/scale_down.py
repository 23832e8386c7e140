"""PlannedScaleDown: retire replica groups without cutting a single live token stream (DESIGN.md §4).

Lock the door, let seated tables finish, then turn out the lights:

1. **choose victims** - whole groups only, never the last warm copy of a
   revision, never below the warm floor, least loaded / coldest first; the
   capacity guard stops and asks (``approve``) if the rest cannot carry demand;
2. **mark not-ready** (readiness gate ``fleetmend.io/serving-ready`` False) and
   **stop routing** (remove the router-only label);
3. **drain** - poll the victims' running + waiting requests to zero, bounded by
   the drain deadline; at the deadline report what is still streaming and wait
   for ``extend`` or ``accept_cut`` (no answer: extend once, then ask again);
4. **terminate** - deletion cost on the victims, then scale the workload to an
   absolute count, so the drained pods are the ones removed;
5. **verify** - the remaining groups ready, no victim stream cut (unless an
   operator accepted it), ledger reconcile clean.

The run yields while a replica-loss incident is open on the same pool (phase
``yielding-to-incident``, with the incident named in the status). Every
mutation goes through the ledger with the operation id ``workflow id/step/target``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.act import ActActivities, EffectReport, NotifyRequest, PodLabelsChange, ScaleChange
    from activities.audit import AuditActivities, ReconcileRequest
    from activities.coordination import IncidentState, incident_on_pool
    from activities.drain import CutStreams, CutStreamsRequest, DrainActivities, DrainLook
    from activities.observe import DerouteWait, ObserveActivities, ObserveRequest
    from activities.readiness import ReadinessActivities, ServingReadyChange
    from fleet import search_attributes as sa
    from fleet.capacity import Demand, GroupCapacity, check_capacity
    from fleet.incident import PLANNED_SCALE_DOWN_WORKFLOW
    from fleet.observation import PoolObservation
    from fleet.pool import ReplicaGroup, WorkloadKind
    from fleet.recovery import (
        OperatorAction,
        Phase,
        ProcedureStatus,
    )
    from fleet.scale_down import (
        DRAINING_ANNOTATION,
        VICTIM_DELETION_COST,
        DrainProgress,
        ScaleDownInput,
        deadline_choice,
    )
    from fleet.verification import verify_scale_down
    from fleet.victims import GroupLoad, choose_victims
    from fleet.vocabulary import LWS_GROUP_INDEX_LABEL, POD_DELETION_COST_ANNOTATION
    from workflows.procedure import ACTIVITY_RETRY, ACTIVITY_TIMEOUT, Aborted, Procedure

_ACT_RETRY = ACTIVITY_RETRY
_ACT_TIMEOUT = ACTIVITY_TIMEOUT
# A drain look is a few scrapes: a short timeout lets a drain resume quickly on another worker.
_LOOK_TIMEOUT = timedelta(seconds=10)


@workflow.defn(name=PLANNED_SCALE_DOWN_WORKFLOW)
class PlannedScaleDown(Procedure):
    @workflow.init
    def __init__(self, inp: ScaleDownInput) -> None:
        super().__init__()
        # Status exists before the run starts: an Update delivered with the first task sees a running procedure.
        self._inp: ScaleDownInput | None = inp
        self._status = ProcedureStatus(
            workflow=workflow.info().workflow_id,
            pool=inp.pool,
            phase=Phase.CHOOSING_VICTIMS,
            dry_run=inp.dry_run,
        )
        self._at_deadline = False
        self._extension: OperatorAction | None = None
        self._cut_accepted: OperatorAction | None = None
        self._victims: list[ReplicaGroup] = []
        self._drain_since: float | None = None
        self._last_progress: DrainProgress | None = None

    # ================================================================ the procedure

    @workflow.run
    async def run(self, inp: ScaleDownInput) -> ProcedureStatus:
        self._begin(inp)
        try:
            await self.yield_to_incident("before choosing victims")
            obs = await self.choose_victims()
            if not self._victims:
                return self._finish(Phase.DONE)
            await self.guard_capacity(obs)
            await self.mark_not_ready(obs)
            await self.drain()
            await self.yield_to_incident("before terminating")
            await self.terminate()
            await self.verify(obs)
            return self._finish(Phase.DONE)
        except Aborted:
            return self._finish(Phase.ABORTED)

    # ---------------------------------------------------------------- yielding

    async def yield_to_incident(self, when: str) -> None:
        """Wait while a replica-loss incident is open on this pool; give up (abort) after the bound."""
        inp = self._inp_()
        started = self._now()
        previous: Phase | None = None
        while True:
            state: IncidentState = await workflow.execute_activity(
                incident_on_pool,
                inp.pool,
                start_to_close_timeout=_ACT_TIMEOUT,
                retry_policy=_ACT_RETRY,
                summary=f"is a replica-loss incident open on {inp.pool.key}? ({when})",
            )
            if not state.open:
                if previous is not None:
                    self._decide(f"incident over ({state.reason}); resuming {when}")
                    await self._enter(previous, f"resumed after the incident ({state.reason})")
                return
            waited = self._now() - started
            if previous is None:
                previous = self._status_().phase
                self._decide(f"yielding {when}: {state.reason}", {"incident": state.workflow_id})
                self._figure("yielded_to", state.workflow_id)
                await self._enter(
                    Phase.YIELDING,
                    f"**Yielding** to {state.reason}: a scale-down must not take replicas away while the "
                    f"pool is recovering. Re-checking every {inp.incident_poll_s:g} s.",
                )
            if waited >= inp.incident_yield_max_s:
                self._decide(
                    f"gave up after yielding {waited:.0f} s to {state.workflow_id}; nothing was removed "
                    "after the incident opened - run the scale-down again once the pool has recovered"
                )
                raise Aborted()
            await workflow.sleep(inp.incident_poll_s, summary=f"yielding to {state.workflow_id}")
            await self._checkpoint()

    # ---------------------------------------------------------------- step 1

    async def choose_victims(self) -> PoolObservation:
        inp = self._inp_()
        await self._enter(Phase.CHOOSING_VICTIMS, "Choosing victims: whole groups, the cheapest to lose")
        obs = await self._observe("choose victims: read pool, engines")
        loads = {
            gid: GroupLoad(running=e.running, waiting=e.waiting, kv_usage=e.kv_usage)
            for gid, e in obs.engines.items()
        }
        try:
            choice = choose_victims(
                obs.snapshot,
                target_groups=inp.target_groups,
                explicit=inp.victims,
                loads=loads,
                warm_floor=inp.warm_floor,
            )
        except ValueError as err:
            raise ApplicationError(f"bad scale-down request: {err}", non_retryable=True) from err
        self._decide(choice.reason, {"choice": choice.model_dump(mode="json")})
        self._figure("serving_before", len(obs.snapshot.serving))
        self._figure("victims", list(choice.victims))
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
        """Capacity-aware guard (DESIGN.md §6a): can the groups left carry today's demand?"""
        inp = self._inp_()
        interval = max(inp.poll_interval_s, 1.0)
        await workflow.sleep(interval, summary="guard: measurement interval")
        after = await self._observe("guard: serving rate of every group")
        seconds = max(1e-3, after.snapshot.observed_at - obs.snapshot.observed_at)
        measured: dict[str, float] = {}
        for g in after.snapshot.serving:
            now_, before = after.engines.get(g.id), obs.engines.get(g.id)
            measured[g.id] = (
                max(0.0, now_.generation_tokens_total - before.generation_tokens_total) / seconds
                if now_ is not None and before is not None and g.ready
                else 0.0
            )
        demand = sum(measured.values())
        # What a remaining group can carry: the operator's load-test figure, else the busiest group's rate now.
        per_group = inp.group_capacity_tokens_per_s or max(measured.values(), default=0.0)
        capacity = {
            gid: GroupCapacity(tokens_per_s=per_group if (rate > 0 or demand == 0) else 0.0)
            for gid, rate in measured.items()
        }
        if demand == 0:
            capacity = {gid: GroupCapacity(tokens_per_s=per_group or 1.0) for gid in measured}
        removing = [g.id for g in self._victims if g.id in capacity]
        decision = check_capacity(
            f"scale-down removing {', '.join(removing)}",
            capacity,
            removing,
            Demand(tokens_per_s=demand),
            min_groups=inp.min_serving_groups,
            headroom=inp.capacity_headroom,
        )
        self._decide(decision.reason, {"guard": decision.model_dump(mode="json")})
        self._figure("demand_tokens_per_s", round(demand, 1))
        if not decision.allowed:
            await self._ask_operator(decision.reason)

    # ---------------------------------------------------------------- step 2

    async def mark_not_ready(self, obs: PoolObservation) -> None:
        inp = self._inp_()
        wid = workflow.info().workflow_id
        pods = self._victim_pods()
        await self._enter(Phase.MARKING_NOT_READY, f"Marking {', '.join(pods)} not ready and out of routing")
        label = obs.router_label
        selecting = obs.controllers_selecting(label)
        self._drain_since = self._now()
        for pod in pods:
            # Claim first: the readiness keeper leaves a claimed pod's gate alone.
            await self._act(
                ActActivities.patch_pod_metadata,
                PodLabelsChange(
                    step="claim-for-drain",
                    namespace=inp.pool.namespace,
                    pod=pod,
                    annotations={DRAINING_ANNOTATION: wid},
                    dry_run=inp.dry_run,
                ),
                f"claim {pod} for the drain ({DRAINING_ANNOTATION})",
            )
            await self._act(
                ReadinessActivities.set_serving_ready,
                ServingReadyChange(
                    step="mark-not-ready",
                    namespace=inp.pool.namespace,
                    pod=pod,
                    ready=False,
                    reason="ScaleDown",
                    dry_run=inp.dry_run,
                ),
                f"readiness gate false on {pod}",
            )
        if selecting:
            names = ", ".join(f"{w.kind}/{w.name}" for w in selecting)
            self._decide(
                f"keeping label {label}: {names} select(s) on it (removing it would orphan the pods); "
                "the readiness gate alone takes them out of the EndpointSlice"
            )
        else:
            for pod in pods:
                await self._act(
                    ActActivities.patch_pod_metadata,
                    PodLabelsChange(
                        step="stop-routing",
                        namespace=inp.pool.namespace,
                        pod=pod,
                        labels={label: None},
                        dry_run=inp.dry_run,
                    ),
                    f"remove router-only label {label} from {pod}",
                )
        if inp.dry_run:
            self._decide(f"dry-run: would mark {', '.join(pods)} not ready and stop routing to them")
            return
        seen = await workflow.execute_activity_method(
            ObserveActivities.await_derouted,
            DerouteWait(pool=inp.pool, pods=pods, timeout_s=60.0),
            start_to_close_timeout=timedelta(seconds=90),
            heartbeat_timeout=timedelta(seconds=10),
            retry_policy=_ACT_RETRY,
            summary="wait until the router stops sending them new requests",
        )
        if seen.still_routed:
            raise ApplicationError(
                f"{seen.still_routed} still routed 60 s after the gate turned false and the router label "
                "was removed; the router does not follow EndpointSlice readiness nor the router-only label - "
                "check its configuration",
                non_retryable=True,
            )
        self._figure("stop_routing_seconds", round(max(0.0, seen.at - self._drain_since), 3))
        self._decide(f"no new requests go to {', '.join(pods)}")

    # ---------------------------------------------------------------- step 3

    async def drain(self) -> None:
        inp = self._inp_()
        leaders = [g.leader_pod for g in self._victims]
        await self._enter(
            Phase.DRAINING,
            f"Draining {', '.join(leaders)}: waiting for running + waiting requests to reach zero "
            f"(deadline {inp.drain_deadline_s:g} s)",
        )
        started = self._now()
        deadline = started + inp.drain_deadline_s
        unanswered = 0
        while True:
            progress = await self._look(leaders)
            if progress.drained:
                self._figure("drain_seconds", round(self._now() - started, 2))
                self._decide(f"drained: {progress.summary()}")
                return
            if inp.dry_run:
                self._decide(f"dry-run: would wait for {progress.summary()}")
                return
            now = self._now()
            if now >= deadline:
                self._figure("in_flight_at_deadline", progress.in_flight)
                verdict, extra_s = await self._deadline_reached(progress, unanswered)
                if verdict == "cut":
                    return
                if verdict == "unanswered":
                    unanswered += 1
                deadline = self._now() + extra_s
                await self._enter(Phase.DRAINING, f"Draining, {extra_s:g} s more: {progress.summary()}")
                continue
            self._set_details(
                f"**Phase:** draining\n\n{progress.summary()}; deadline in {deadline - now:.0f} s"
            )
            await workflow.sleep(min(inp.poll_interval_s, max(0.05, deadline - now)), summary="drain poll")
            await self._checkpoint()

    async def _deadline_reached(self, progress: DrainProgress, unanswered: int) -> tuple[str, float]:
        """Report what still streams and wait for ``extend`` / ``accept_cut``; no answer: extend once."""
        inp = self._inp_()
        what = (
            f"drain deadline passed with {progress.summary()}: `extend` (extend_s) to wait longer, or "
            "`accept_cut` to terminate now and cut them"
        )
        self._decide(what, {"still_streaming": progress.model_dump(mode="json")})
        self._extension = self._cut_accepted = None
        self._at_deadline = True
        status = self._status_()
        status.awaiting = what
        await self._enter(Phase.AWAITING_OPERATOR, f"**Awaiting operator**: {what}")
        await self._notify(f"drain-deadline-{len(status.decisions)}", f"[fleetmend] {inp.pool.key}: {what}")
        try:
            await workflow.wait_condition(
                lambda: (
                    self._extension is not None or self._cut_accepted is not None or self._abort is not None
                ),
                timeout=timedelta(seconds=inp.operator_timeout_s),
                timeout_summary="operator: extend or accept_cut",
            )
        except TimeoutError:
            choice = deadline_choice(unanswered)
            if choice == "extend":
                self._decide(
                    f"no operator answered within {inp.operator_timeout_s:g} s: extending the drain once by "
                    f"{inp.drain_deadline_s:g} s; at the next deadline the procedure asks again and waits"
                )
                return "unanswered", inp.drain_deadline_s
            self._decide(f"still no answer after {inp.operator_timeout_s:g} s: asking again")
            return "unanswered", inp.poll_interval_s
        finally:
            self._at_deadline = False
            status.awaiting = None
        if self._abort is not None:
            raise Aborted()
        if self._cut_accepted is not None:
            a = self._cut_accepted
            self._figure("cut_accepted_in_flight", progress.in_flight)
            self._figure("cut_accepted_by", a.operator)
            self._decide(f"cut accepted by {a.operator} ({a.reason}): terminating with {progress.summary()}")
            return "cut", 0.0
        assert self._extension is not None
        extra = self._extension.extend_s or inp.drain_deadline_s
        self._decide(f"drain extended by {extra:g} s by {self._extension.operator}: {self._extension.reason}")
        return "extended", extra

    # ---------------------------------------------------------------- step 4

    async def terminate(self) -> None:
        inp = self._inp_()
        pods = self._victim_pods()
        await self._enter(Phase.TERMINATING, f"Terminating the drained {', '.join(pods)}")
        for pod in pods:
            await self._act(
                ActActivities.patch_pod_metadata,
                PodLabelsChange(
                    step="deletion-cost",
                    namespace=inp.pool.namespace,
                    pod=pod,
                    annotations={POD_DELETION_COST_ANNOTATION: VICTIM_DELETION_COST},
                    dry_run=inp.dry_run,
                ),
                f"pod-deletion-cost {VICTIM_DELETION_COST} on {pod}: the ReplicaSet removes it first",
            )
        now_obs = await self._observe("terminate: current workload replicas")
        by_workload: dict[tuple[str, str], list[ReplicaGroup]] = {}
        for g in self._victims:
            by_workload.setdefault((g.workload_kind.value, g.workload_name), []).append(g)
        for (kind, name), groups in sorted(by_workload.items()):
            current = next((w.replicas for w in now_obs.workloads if w.kind == kind and w.name == name), None)
            if current is None:
                raise ApplicationError(
                    f"{kind} {inp.pool.namespace}/{name} of the victims is gone; nothing to scale",
                    non_retryable=True,
                )
            if kind == WorkloadKind.LEADER_WORKER_SET.value:
                self._check_lws_victims(now_obs, name, groups, current)
            still_there = [g for g in groups if any(p in now_obs.pods for p in g.pods)]
            replicas = max(0, current - len(still_there))
            self._decide(
                f"scale {kind}/{name} from {current} to {replicas} replica groups (absolute)",
                {"workload": f"{kind}/{name}", "from": current, "to": replicas},
            )
            await self._act(
                ActActivities.scale_workload,
                ScaleChange(
                    step="terminate-scale",
                    namespace=inp.pool.namespace,
                    kind=kind,
                    name=name,
                    replicas=replicas,
                    dry_run=inp.dry_run,
                ),
                f"scale {kind}/{name} to {replicas}",
            )
        if inp.dry_run:
            self._decide(f"dry-run: would wait for {', '.join(pods)} to terminate")
            return
        started = self._now()
        while True:
            obs = await self._observe("terminate: are the victims gone?")
            left = [p for p in pods if p in obs.pods]
            wrong = sorted(
                p
                for p, o in obs.pods.items()
                if o.deleting and p not in pods and obs.snapshot.group_of_pod(p)
            )
            if wrong:
                self._figure("non_victims_terminating", wrong)
            if not left:
                self._figure("terminate_seconds", round(self._now() - started, 2))
                self._decide(f"{', '.join(pods)} terminated")
                return
            if self._now() - started > inp.terminate_timeout_s:
                raise ApplicationError(
                    f"{', '.join(left)} still present {inp.terminate_timeout_s:g} s after the scale-down; "
                    "check the pods' finalizers and the workload controller",
                    non_retryable=True,
                )
            await workflow.sleep(inp.poll_interval_s, summary="wait for the victims to terminate")

    @staticmethod
    def _check_lws_victims(obs: PoolObservation, name: str, groups: list[ReplicaGroup], current: int) -> None:
        """A LeaderWorkerSet scales down from its highest group index: the victims must be those."""
        wanted = {str(i) for i in range(current - len(groups), current)}
        have: set[str] = set()
        for g in groups:
            leader = obs.pods.get(g.leader_pod)
            index = g.id.rsplit("-", 1)[-1] if leader is not None else ""
            have.add(index)
        if have != wanted:
            raise ApplicationError(
                f"LeaderWorkerSet {name} removes group indexes {sorted(wanted)} ({LWS_GROUP_INDEX_LABEL}) "
                f"when scaled down, not the victims {sorted(g.id for g in groups)}; name the highest groups "
                "as explicit victims",
                non_retryable=True,
            )

    # ---------------------------------------------------------------- step 5

    async def verify(self, before: PoolObservation) -> None:
        inp = self._inp_()
        await self._enter(Phase.VERIFYING, "Verifying: remaining ready, no stream cut, ledger clean")
        obs = await self._observe("verify: remaining replica groups")
        victim_ids = {g.id for g in self._victims}
        target = len([g for g in before.snapshot.serving if g.id not in victim_ids])
        ready = len([g for g in obs.snapshot.serving if g.ready and g.routed and g.id not in victim_ids])
        cut: CutStreams = await workflow.execute_activity_method(
            DrainActivities.cut_streams,
            CutStreamsRequest(pool=inp.pool, replicas=self._victim_pods(), since=self._drain_since),
            start_to_close_timeout=_ACT_TIMEOUT,
            retry_policy=_ACT_RETRY,
            summary="gateway journal: did any victim stream end cut?",
        )
        reconcile = await workflow.execute_activity_method(
            AuditActivities.reconcile_workflow,
            ReconcileRequest(workflow_id=workflow.info().workflow_id),
            start_to_close_timeout=_ACT_TIMEOUT,
            retry_policy=_ACT_RETRY,
            summary="ledger reconcile: no duplicate, no orphan",
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
        status = self._status_()
        status.verification = report
        self._figure("cut_streams", cut.cut)
        self._figure("cut_request_ids", cut.cut_request_ids)
        self._figure("victim_requests_completed", cut.completed)
        self._figure("serving_after", ready)
        self._decide(
            f"verification {'passed' if report.passed else 'FAILED'}: {ready} of {target} remaining groups "
            f"ready, {cut.cut} stream(s) cut" + (" (accepted by an operator)" if accepted else ""),
            {"verification": report.model_dump(mode="json")},
        )
        if not report.passed:
            self._finish(Phase.FAILED)
            raise ApplicationError(
                "scale-down verification failed: "
                + "; ".join(
                    f"{c.name}: observed {c.observed}, expected {c.expected}"
                    for c in report.checks
                    if not c.passed
                ),
                non_retryable=True,
            )

    # ================================================================ operator steering

    @workflow.update(
        name="extend", description="Give the drain more time (extend_s, default the drain deadline)"
    )
    def extend(self, action: OperatorAction) -> ProcedureStatus:
        self._extension = action
        return self._status_()

    @extend.validator
    def _validate_extend(self, action: OperatorAction) -> None:
        self._require_running()
        if not self._at_deadline:
            raise ValueError(
                f"the drain is not waiting at its deadline (phase {self._status_().phase.value}); extend "
                "applies once the deadline passed and status.awaiting asks for it"
            )

    @workflow.update(
        name="accept_cut",
        description="Terminate now although streams are still running on the victims (they are cut and "
        "recorded)",
    )
    def accept_cut(self, action: OperatorAction) -> ProcedureStatus:
        self._cut_accepted = action
        return self._status_()

    @accept_cut.validator
    def _validate_accept_cut(self, action: OperatorAction) -> None:
        self._require_running()
        if not self._at_deadline:
            raise ValueError(
                f"nothing to cut: the drain is not waiting at its deadline (phase {self._status_().phase.value})"
            )
        if not action.reason:
            raise ValueError(
                "accepting a cut needs a reason (it goes into the record next to the cut streams)"
            )

    async def _ask_operator(self, what: str) -> OperatorAction:
        timeout_s = self._inp_().operator_timeout_s
        approval = await self._await_operator(what, timeout_s)
        if approval is None:
            # Nothing was removed yet: give up cleanly rather than block the schedule's next runs (overlap skip).
            self._decide(
                f"nobody approved within {timeout_s:g} s: {what}; nothing was removed - the scale-down ends here"
            )
            raise Aborted()
        self._decide(f"approved by {approval.operator}: {approval.reason}")
        return approval

    async def _announce_awaiting(self, what: str) -> None:
        status = self._status_()
        await self._notify(
            f"approval-{len(status.decisions)}", f"[fleetmend] {self._inp_().pool.key}: {what}"
        )

    # ================================================================ plumbing

    def _begin(self, inp: ScaleDownInput) -> None:
        self._status_().figures.update(
            {
                "requested_by": inp.requested_by,
                "target_groups": inp.target_groups,
                "drain_deadline_s": inp.drain_deadline_s,
                "dry_run": inp.dry_run,
            }
        )
        workflow.upsert_search_attributes(
            [
                sa.FLEETMEND_KIND.value_set("scale-down"),
                sa.FLEETMEND_NAMESPACE.value_set(inp.pool.namespace),
                sa.FLEETMEND_POOL.value_set(inp.pool.key),
                sa.FLEETMEND_DRY_RUN.value_set(inp.dry_run),
            ]
        )

    async def _observe(self, summary: str) -> PoolObservation:
        return await workflow.execute_activity_method(
            ObserveActivities.observe_pool,
            ObserveRequest(pool=self._inp_().pool),
            start_to_close_timeout=_ACT_TIMEOUT,
            retry_policy=_ACT_RETRY,
            summary=summary[:190],
        )

    async def _look(self, leaders: list[str]) -> DrainProgress:
        progress: DrainProgress = await workflow.execute_activity_method(
            DrainActivities.drain_look,
            DrainLook(pool=self._inp_().pool, pods=leaders),
            start_to_close_timeout=_LOOK_TIMEOUT,
            retry_policy=_ACT_RETRY,
            summary="drain: running + waiting on the victims",
        )
        self._last_progress = progress
        self._figure("victims_in_flight", progress.in_flight)
        return progress

    async def _act(self, method: Any, request: Any, summary: str) -> Any:
        await self._checkpoint()
        result = await workflow.execute_activity_method(
            method,
            request,
            start_to_close_timeout=_ACT_TIMEOUT,
            retry_policy=_ACT_RETRY,
            summary=summary[:190],
        )
        if isinstance(result, EffectReport):
            figures = self._status_().figures
            figures[f"effects_{result.state}"] = figures.get(f"effects_{result.state}", 0) + 1
            if result.replayed:
                figures["effects_deduplicated"] = figures.get("effects_deduplicated", 0) + 1
            if result.error and result.state == "failed":
                raise ApplicationError(f"{summary}: {result.error}", non_retryable=True)
        return result

    async def _notify(self, topic: str, text: str) -> None:
        await self._act(
            ActActivities.notify,
            NotifyRequest(step="notify", topic=topic, text=text, dry_run=self._inp_().dry_run),
            f"incident channel: {topic}",
        )

    def _victim_pods(self) -> list[str]:
        return [p for g in self._victims for p in g.pods]

    def _inp_(self) -> ScaleDownInput:
        assert self._inp is not None
        return self._inp


__all__ = ["PlannedScaleDown", "ScaleDownInput"]
