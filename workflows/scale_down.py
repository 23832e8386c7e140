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
``yielding-to-incident``, with the incident named in the status). Every mutation
goes through the procedure toolkit (``workflows/procedure.py``): the ledger, under an
operation id unique to this scale-down, and the one refused-effect policy - a refused
claim, gate, deroute or scale stops the step and asks an operator (``retry`` /
``skip`` / ``abort``).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.act import ActActivities, ScaleChange
    from activities.audit import AuditActivities, ReconcileRequest
    from activities.coordination import IncidentState, incident_on_pool
    from activities.drain import CutStreamsRequest, DrainActivities, DrainLook
    from activities.observe import ObserveActivities, ObserveRequest
    from activities.readiness import ReadinessActivities, ServingReadyChange
    from fleet import search_attributes as sa
    from fleet.capacity import scale_down_guard
    from fleet.incident import PLANNED_SCALE_DOWN_WORKFLOW
    from fleet.observation import PoolObservation
    from fleet.pool import ReplicaGroup, WorkloadKind
    from fleet.recovery import OperatorAction, Phase, ProcedureStatus, Refusal
    from fleet.scale_down import (
        DRAINING_ANNOTATION,
        DrainProgress,
        ScaleDownInput,
        deadline_choice,
    )
    from fleet.verification import verify_scale_down
    from fleet.victims import GroupLoad, choose_victims
    from fleet.vocabulary import LWS_GROUP_INDEX_LABEL
    from workflows.procedure import Aborted, Procedure

# A drain look is a few scrapes: a short timeout lets a drain resume quickly on another worker.
_LOOK_TIMEOUT_S = 10.0


@workflow.defn(name=PLANNED_SCALE_DOWN_WORKFLOW)
class PlannedScaleDown(Procedure):
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
        self._at_deadline = False
        self._extension: OperatorAction | None = None
        self._cut_accepted: OperatorAction | None = None
        self._victims: list[ReplicaGroup] = []
        self._drain_since: float | None = None
        self._last_progress: DrainProgress | None = None

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
            await self.drain()
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
        previous: Phase | None = None
        while True:
            state: IncidentState = await self.call(
                incident_on_pool, inp.pool, f"is a replica-loss incident open on {inp.pool.key}? ({when})"
            )
            if not state.open:
                if previous is not None:
                    self.decide(f"incident over ({state.reason}); resuming {when}")
                    await self.enter(previous, f"resumed after the incident ({state.reason})")
                return
            waited = self.now() - started
            if previous is None:
                previous = self._status.phase
                self.decide(f"yielding {when}: {state.reason}", {"incident": state.workflow_id})
                self.figure("yielded_to", state.workflow_id)
                await self.enter(
                    Phase.YIELDING,
                    f"**Yielding** to {state.reason}: a scale-down must not take replicas away while the "
                    f"pool is recovering. Re-checking every {inp.incident_poll_s:g} s.",
                )
            if waited >= inp.incident_yield_max_s:
                self.decide(
                    f"gave up after yielding {waited:.0f} s to {state.workflow_id}; nothing was removed "
                    "after the incident opened - run the scale-down again once the pool has recovered"
                )
                raise Aborted()
            await workflow.sleep(inp.incident_poll_s, summary=f"yielding to {state.workflow_id}")
            await self.checkpoint()

    # ---------------------------------------------------------------- step 1

    async def choose_victims(self) -> PoolObservation:
        inp = self._inp
        await self.enter(Phase.CHOOSING_VICTIMS, "Choosing victims: whole groups, the cheapest to lose")
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
        """Capacity-aware guard (DESIGN.md §6a): can the groups left carry today's demand?"""
        inp = self._inp
        interval = max(inp.poll_interval_s, 1.0)
        await workflow.sleep(interval, summary="guard: measurement interval")
        after = await self._observe("guard: serving rate of every group")
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
        pods = self._victim_pods()
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

    # ---------------------------------------------------------------- step 3

    async def drain(self) -> None:
        inp = self._inp
        leaders = [g.leader_pod for g in self._victims]
        await self.enter(
            Phase.DRAINING,
            f"Draining {', '.join(leaders)}: waiting for running + waiting requests to reach zero "
            f"(deadline {inp.drain_deadline_s:g} s)",
        )
        started = self.now()
        deadline = started + inp.drain_deadline_s
        unanswered = 0
        while True:
            progress = await self._look(leaders)
            if progress.drained:
                self.figure("drain_seconds", round(self.now() - started, 2))
                self.decide(f"drained: {progress.summary()}")
                return
            if inp.dry_run:
                self.decide(f"dry-run: would wait for {progress.summary()}")
                return
            now = self.now()
            if now >= deadline:
                self.figure("in_flight_at_deadline", progress.in_flight)
                verdict, extra_s = await self._deadline_reached(progress, unanswered)
                if verdict == "cut":
                    return
                if verdict == "unanswered":
                    unanswered += 1
                deadline = self.now() + extra_s
                await self.enter(Phase.DRAINING, f"Draining, {extra_s:g} s more: {progress.summary()}")
                continue
            self.set_details(
                f"**Phase:** draining\n\n{progress.summary()}; deadline in {deadline - now:.0f} s"
            )
            await workflow.sleep(min(inp.poll_interval_s, max(0.05, deadline - now)), summary="drain poll")
            await self.checkpoint()

    async def _deadline_reached(self, progress: DrainProgress, unanswered: int) -> tuple[str, float]:
        """Report what still streams and wait for ``extend`` / ``accept_cut``; no answer: extend once."""
        inp = self._inp
        what = (
            f"drain deadline passed with {progress.summary()}: `extend` (extend_s) to wait longer, or "
            "`accept_cut` to terminate now and cut them"
        )
        self.decide(what, {"still_streaming": progress.model_dump(mode="json")})
        self._extension = self._cut_accepted = None
        self._at_deadline = True
        status = self._status
        status.awaiting = what
        await self.enter(Phase.AWAITING_OPERATOR, f"**Awaiting operator**: {what}")
        await self.notify(f"drain-deadline-{len(status.decisions)}", f"[fleetmend] {inp.pool.key}: {what}")
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
                self.decide(
                    f"no operator answered within {inp.operator_timeout_s:g} s: extending the drain once by "
                    f"{inp.drain_deadline_s:g} s; at the next deadline the procedure asks again and waits"
                )
                return "unanswered", inp.drain_deadline_s
            self.decide(f"still no answer after {inp.operator_timeout_s:g} s: asking again")
            return "unanswered", inp.poll_interval_s
        finally:
            self._at_deadline = False
            status.awaiting = None
        if self._abort is not None:
            raise Aborted()
        if self._cut_accepted is not None:
            a = self._cut_accepted
            self.figure("cut_accepted_in_flight", progress.in_flight)
            self.figure("cut_accepted_by", a.operator)
            self.decide(f"cut accepted by {a.operator} ({a.reason}): terminating with {progress.summary()}")
            return "cut", 0.0
        assert self._extension is not None
        extra = self._extension.extend_s or inp.drain_deadline_s
        self.decide(f"drain extended by {extra:g} s by {self._extension.operator}: {self._extension.reason}")
        return "extended", extra

    # ---------------------------------------------------------------- step 4

    async def terminate(self) -> None:
        inp = self._inp
        pods = self._victim_pods()
        await self.enter(Phase.TERMINATING, f"Terminating the drained {', '.join(pods)}")
        await self.mark_removed_first(inp.pool, pods, step="deletion-cost", why="drained victim leaves")
        by_workload: dict[tuple[str, str], list[ReplicaGroup]] = {}
        for g in self._victims:
            by_workload.setdefault((g.workload_kind.value, g.workload_name), []).append(g)
        for (kind, name), groups in sorted(by_workload.items()):
            await self._scale_down_workload(kind, name, groups)
        if inp.dry_run:
            self.decide(f"dry-run: would wait for {', '.join(pods)} to terminate")
            return
        started = self.now()
        while True:
            obs = await self._observe("terminate: are the victims gone?")
            left = [p for p in pods if p in obs.pods]
            wrong = sorted(
                p
                for p, o in obs.pods.items()
                if o.deleting and p not in pods and obs.snapshot.group_of_pod(p)
            )
            if wrong:
                self.figure("non_victims_terminating", wrong)
            if not left:
                self.figure("terminate_seconds", round(self.now() - started, 2))
                self.decide(f"{', '.join(pods)} terminated")
                return
            if self.now() - started > inp.terminate_timeout_s:
                refusal = Refusal(
                    step="terminate-wait",
                    what=f"terminate {', '.join(left)}",
                    error=f"still present {inp.terminate_timeout_s:g} s after the scale-down; check the pods' "
                    "finalizers and the workload controller",
                )
                if await self.escalate(refusal) == "skip":
                    return
                started = self.now()
            await workflow.sleep(inp.poll_interval_s, summary="wait for the victims to terminate")

    async def _scale_down_workload(self, kind: str, name: str, groups: list[ReplicaGroup]) -> None:
        """Scale one workload to an absolute count without the victims; what blocks it goes to an operator."""
        inp = self._inp
        while True:
            now_obs = await self._observe("terminate: current workload replicas")
            current = next((w.replicas for w in now_obs.workloads if w.kind == kind and w.name == name), None)
            problem = None
            if current is None:
                problem = f"{kind} {inp.pool.namespace}/{name} of the victims is gone; nothing to scale"
            elif kind == WorkloadKind.LEADER_WORKER_SET.value:
                problem = self._check_lws_victims(now_obs, name, groups, current)
            if problem is None:
                break
            if (
                await self.escalate(
                    Refusal(step="terminate-scale", what=f"scale {kind}/{name}", error=problem)
                )
                == "skip"
            ):
                return
        assert current is not None
        still_there = [g for g in groups if any(p in now_obs.pods for p in g.pods)]
        replicas = max(0, current - len(still_there))
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

    @staticmethod
    def _check_lws_victims(
        obs: PoolObservation, name: str, groups: list[ReplicaGroup], current: int
    ) -> str | None:
        """A LeaderWorkerSet scales down from its highest group index: the victims must be those."""
        wanted = {str(i) for i in range(current - len(groups), current)}
        have: set[str] = set()
        for g in groups:
            leader = obs.pods.get(g.leader_pod)
            index = g.id.rsplit("-", 1)[-1] if leader is not None else ""
            have.add(index)
        if have != wanted:
            return (
                f"LeaderWorkerSet {name} removes group indexes {sorted(wanted)} ({LWS_GROUP_INDEX_LABEL}) "
                f"when scaled down, not the victims {sorted(g.id for g in groups)}; name the highest groups "
                "as explicit victims"
            )
        return None

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
        target = len([g for g in before.snapshot.serving if g.id not in victim_ids])
        settle_until = self.now() + inp.verify_settle_s
        waited = False
        while True:
            obs = await self._observe("verify: remaining replica groups")
            ready = len([g for g in obs.snapshot.serving if g.ready and g.routed and g.id not in victim_ids])
            if ready >= target or self.now() >= settle_until:
                break
            if not waited:
                waited = True
                self.decide(
                    f"{ready} of {target} remaining groups read ready and routed: waiting up to "
                    f"{inp.verify_settle_s:.0f} s for them to settle before verifying"
                )
            await workflow.sleep(inp.poll_interval_s, summary="verify: let the remaining groups settle")
        cut = await self.observe(
            DrainActivities.cut_streams,
            CutStreamsRequest(pool=inp.pool, replicas=self._victim_pods(), since=self._drain_since),
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
        status = self._status
        status.verification = report
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
            if (
                await self.escalate(Refusal(step="verify", what="scale-down verification", error=failing))
                == "retry"
            ):
                await self.verify(before)

    # ================================================================ operator steering

    @workflow.update(
        name="extend", description="Give the drain more time (extend_s, default the drain deadline)"
    )
    def extend(self, action: OperatorAction) -> ProcedureStatus:
        self._extension = action
        return self._status

    @extend.validator
    def _validate_extend(self, action: OperatorAction) -> None:
        self._require_running()
        if not self._at_deadline:
            raise ValueError(
                f"the drain is not waiting at its deadline (phase {self._status.phase.value}); extend "
                "applies once the deadline passed and status.awaiting asks for it"
            )

    @workflow.update(
        name="accept_cut",
        description="Terminate now although streams are still running on the victims (they are cut and "
        "recorded)",
    )
    def accept_cut(self, action: OperatorAction) -> ProcedureStatus:
        self._cut_accepted = action
        return self._status

    @accept_cut.validator
    def _validate_accept_cut(self, action: OperatorAction) -> None:
        self._require_running()
        if not self._at_deadline:
            raise ValueError(
                f"nothing to cut: the drain is not waiting at its deadline (phase {self._status.phase.value})"
            )
        if not action.reason:
            raise ValueError(
                "accepting a cut needs a reason (it goes into the record next to the cut streams)"
            )

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

    # ================================================================ plumbing

    async def _observe(self, summary: str) -> PoolObservation:
        return await self.observe(
            ObserveActivities.observe_pool, ObserveRequest(pool=self._inp.pool), summary
        )

    async def _look(self, leaders: list[str]) -> DrainProgress:
        progress = await self.observe(
            DrainActivities.drain_look,
            DrainLook(pool=self._inp.pool, pods=leaders),
            "drain: running + waiting on the victims",
            timeout_s=_LOOK_TIMEOUT_S,
        )
        self._last_progress = progress
        self.figure("victims_in_flight", progress.in_flight)
        return progress

    def _victim_pods(self) -> list[str]:
        return [p for g in self._victims for p in g.pods]


__all__ = ["PlannedScaleDown", "ScaleDownInput"]
