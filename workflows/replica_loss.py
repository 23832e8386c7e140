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

Beside this file: the admission keeper (``workflows/admission.py``, steps 3 to 10), the ramp
(``workflows/ramp.py``, step 9) and each failed node's hardware path, a ``NodeQualification``
child workflow per node (``workflows/node_qualification.py``, step 8). The recovery's state
is one model, ``fleet.recovery_state.RecoveryState``. An operator wait adds at most
``procedure.OPERATOR_WAIT_EVENTS_MAX`` history events however long it lasts (README, "Long waits").
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.act import ActActivities, PodDeletion, ScaleChange
    from activities.audit import AuditActivities, ReconcileRequest
    from fleet import rebuild
    from fleet import search_attributes as sa
    from fleet.capacity import recovery_guard
    from fleet.incident import LossReport
    from fleet.leadtime import estimate_lead_time
    from fleet.loss import (
        LossEvent,
        confirm_group,
        correlate,
        groups_being_recreated,
        match_reports,
        size_loss,
    )
    from fleet.observation import PoolObservation
    from fleet.pool import ReplicaGroup
    from fleet.recovery import Phase, ProcedureStatus, RecoveryInput, Refusal, VerificationReport
    from fleet.recovery_observations import recovery_observations, warm_groups_before
    from fleet.recovery_state import RecoveryState
    from fleet.runbook import (
        bad_rollout_notice,
        failing_checks,
        fast_path_evidence,
        judge_pending,
        lead_time_notice,
        pods_to_deroute,
        reports_text,
        room_for,
        with_lost,
    )
    from fleet.survivor_load import survivors_read
    from fleet.verification import verify_recovery
    from workflows.admission import AdmissionKeeper
    from workflows.node_qualification import NodeTriaged, NodeWorkflows
    from workflows.procedure import Aborted, Procedure, opening
    from workflows.ramp import promote_warm_capacity, ramp_back
    from workflows.rebuild import await_rebuild_slot, await_retired


@workflow.defn(name="ReplicaLossRecovery")
class ReplicaLossRecovery(Procedure):
    @workflow.init
    def __init__(self, inp: RecoveryInput) -> None:
        # State exists before the first task: an Update sent right after the start is accepted.
        figures: dict[str, Any] = {"cause_hint": inp.cause.value, "dry_run": inp.dry_run}
        super().__init__(
            **opening(inp.pool, Phase.CONFIRMING, inp.timings, dry_run=inp.dry_run, figures=figures)
        )
        self._inp = inp
        self.state = RecoveryState(reports=list(inp.reports), started_at=workflow.now().timestamp())
        self.keeper = AdmissionKeeper(self, inp, self._look)
        self.nodes = NodeWorkflows(self, inp, self.state, aborted=lambda: self._abort is not None)
        self.set_fingerprints([r.fingerprint for r in self.state.reports])

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
            if self.state.correlation is not None and not self.state.correlation.replace:
                await self.bad_rollout(lost)
                return self.finish(Phase.BAD_ROLLOUT)
            # 3. Protect the survivors: refuse exactly the capacity gap (re-computed at every capacity change).
            obs = await self.protect_survivors(lost)
            # 4. In-flight requests: retry budget before first byte; collect the record.
            await self.keeper.in_flight(obs, lost, since=(inp.first_signal_at or self.state.started_at) - 60)
            # 5. Promote warm capacity of the same model and revision. Do not scale first.
            promoted = await promote_warm_capacity(self, self.keeper, obs, lost, self.state, self._initial())
            # 6. Rebuild the warm floor (or post the lead time when there was no spare).
            await self.rebuild_warm_floor(obs, lost, promoted)
            # 7. Place it where it fits: whole shape, or report fragmentation.
            await self.place_replacements(lost)
            # 8. Triage the hardware (a workflow per failed node) off the critical path, while 9. ramping back.
            triage = asyncio.ensure_future(self.nodes.triage(obs, lost))
            await ramp_back(
                self, self.keeper, self._initial(), promoted, expected_new=self.state.expected_new
            )
            await triage
            # 10. Verify, then roll back the emergency measures.
            await self.verify_and_roll_back(lost)
            return self.finish(Phase.DONE)
        except Aborted:
            return self.finish(Phase.ABORTED)
        finally:
            self.keeper.halt()

    # ---------------------------------------------------------------- step 1

    async def confirm_and_size(self) -> tuple[PoolObservation, list[ReplicaGroup]]:
        await self.enter(Phase.CONFIRMING, "Confirming the loss: is the endpoint gone, or merely slow?")
        st, timings = self.state, self._inp.timings
        for r in [r for r in st.reports if r.source == "fastpath"]:  # the evidence it opened the incident on
            self.decide(fast_path_evidence(r), {"report": r.model_dump(mode="json")})
        first_looks: list[PoolObservation] = []
        # patched: a recovery that was confirming when the worker was upgraded replays as it ran.
        by_pod_name = st.by_pod_name = workflow.patched("lws-group-by-pod-name")

        async def look() -> tuple[PoolObservation, list[ReplicaGroup], bool]:
            obs = await self._observe(
                check_progress=True, light=True, summary="confirm: read pool, endpoints, engines"
            )
            first_looks.append(obs)
            recreating = groups_being_recreated(
                obs.snapshot, obs.workloads, st.reports, by_pod_name=by_pod_name
            )
            return obs, recreating, bool(match_reports(obs.snapshot, st.reports, by_pod_name=by_pod_name))

        def not_in_pool(_: object) -> None:
            # A LeaderWorkerSet deletes and recreates a whole group when one pod fails: until its pods are
            # back, the reported pod is in no group. Look again before calling it not-a-loss.
            if len(first_looks) == 1:
                self.decide(
                    "the reported pod / group is not in the pool right now (its controller may be "
                    f"recreating it): looking for it for up to {timings.reappear_timeout_s:g} s"
                )

        (obs, recreating, _), _ = await self.poll(
            look,
            lambda seen: seen[2] or bool(seen[1]),
            interval_s=timings.poll_interval_s,
            deadline=self.now() + timings.reappear_timeout_s,
            summary="confirm: look again",
            on_miss=not_in_pool,
        )
        for g in recreating:
            self.decide(
                f"{g.id}: its LeaderWorkerSet {g.workload_name} deleted the group to re-create it (none "
                "of its pods exists): confirming it as it was, since it serves nothing until new pods are ready",
                {"group": g.id},
            )
        obs = st.initial_obs = with_lost(obs, recreating)
        st.confirmed_at = self.now()
        self.keeper.count(obs)
        lost = self._confirm(obs, st.reports)
        if not lost:
            return obs, []
        if by_pod_name:
            # A group re-created while confirmation looked is new, not "the same pods as at the loss".
            uids = rebuild.uids_at_loss(lost, first_looks[0].pod_uids, obs.pod_uids)
            obs = st.initial_obs = obs.model_copy(update={"pod_uids": uids})
        st.lost_ids.update(g.id for g in lost)
        st.lost_groups = lost  # the runbook's own list: groups confirmed later join it
        size = size_loss(obs.snapshot, [g.id for g in lost])
        self.decide(f"loss confirmed: {size.summary}", {"loss": size.model_dump(mode="json")})
        self.figure("groups_lost", size.groups_lost)
        self.figure("lost_pods", sorted(p for g in lost for p in g.pods))
        self.figure("lost_groups", sorted(st.lost_ids))  # the incident absorbs late reports of these
        events = [LossEvent(group_id=g.id, revision=g.revision, nodes=g.nodes, at=self.now()) for g in lost]
        st.correlation = correlate(events, obs.snapshot, timings.correlation_window_s)
        self.decide(f"cause: {st.correlation.reason}", {"cause": st.correlation.cause.value})
        self.figure("cause", st.correlation.cause.value)
        workflow.upsert_search_attributes(
            [sa.FLEETMEND_REPLICA_GROUP.value_set(",".join(g.id for g in lost)[:250])]
        )
        return obs, lost

    def _confirm(self, obs: PoolObservation, reports: list[LossReport]) -> list[ReplicaGroup]:
        """Resolve reports to replica groups (node → groups, pod → group) and confirm each."""
        candidates = match_reports(obs.snapshot, reports, by_pod_name=self.state.by_pod_name)
        lost: list[ReplicaGroup] = []
        for g in candidates.values():
            verdict = confirm_group(g, obs.pods, obs.snapshot.nodes, obs.routed_pods, obs.publish_not_ready)
            self.state.verdicts.append(verdict)
            self.decide(
                f"{g.id}: {verdict.verdict.value} — {verdict.reason}", {"evidence": list(verdict.evidence)}
            )
            if verdict.lost:
                lost.append(g)
        if not candidates:
            self.decide("no replica group of the pool matches the reports: " + reports_text(reports))
        return lost

    # ---------------------------------------------------------------- step 2

    async def stop_routing(self, obs: PoolObservation, lost: list[ReplicaGroup]) -> None:
        inp = self._inp
        await self.enter(Phase.DEROUTING, f"Derouting {', '.join(g.id for g in lost)}")
        label = obs.router_label
        selecting = obs.controllers_selecting(label)
        to_deroute = pods_to_deroute(lost, self.state.verdicts, obs.routed_pods)
        first_signal, wait_s = inp.first_signal_at or self.state.started_at, inp.timings.deroute_timeout_s
        if not to_deroute:
            seconds = max(0.0, self.now() - first_signal)
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
            seen = await self.await_out_of_routing(inp.pool, to_deroute, timeout_s=wait_s)
        else:
            seen = await self.deroute(
                inp.pool, to_deroute, label, step="deroute", why="deroute", timeout_s=wait_s
            )
        if seen is None:
            self.decide(f"dry-run: would deroute {', '.join(to_deroute)}")
            return
        seconds = max(0.0, seen.at - first_signal)
        self.figure("deroute_seconds", seconds)
        self.decide(
            f"dead endpoints out of routing {seconds:.2f} s after the first signal", {"pods": to_deroute}
        )

    async def bad_rollout(self, lost: list[ReplicaGroup]) -> None:
        await self.enter(Phase.BAD_ROLLOUT, "Bad rollout: revert, do not replace with the failing revision")
        revision = self.state.correlation.revision if self.state.correlation else None
        text = bad_rollout_notice(self._inp.pool.key, len(lost), revision)
        await self.notify("bad-rollout", text)
        self.decide(text, {"revision": revision, "groups": [g.id for g in lost]})

    # ---------------------------------------------------------------- step 3

    async def protect_survivors(self, lost: list[ReplicaGroup]) -> PoolObservation:
        await self.enter(
            Phase.PROTECTING, "Protecting the survivors: reading their queues, KV and preemptions"
        )
        before, obs = await self.read_enough(
            lambda: self.window(self._look, self._inp.timings.poll_interval_s, summary="survivors"),
            lambda seen, waited: survivors_read(
                *seen,
                {g.id for g in lost},
                waited_s=waited,
                patience_s=self._inp.timings.retry.read_patience_s,
            ),
            what="read the survivors' load",
            step="survivors",
        )
        # Survivors' queues now are the baseline verification compares against.
        self.state.baseline = {gid: e.waiting for gid, e in before.engines.items()}
        await self.keeper.first_shed(before, obs, lost, self._initial())
        if not self._inp.dry_run:
            self.keeper.keep({g.id for g in lost})
        return obs

    # ---------------------------------------------------------------- step 6

    async def rebuild_warm_floor(
        self, obs: PoolObservation, lost: list[ReplicaGroup], promoted: list[ReplicaGroup]
    ) -> None:
        """Replace what was used (``fleet.rebuild.plan_rebuild``: absolute counts, lost pods retired first)."""
        inp, st = self._inp, self.state
        await self.enter(Phase.REBUILDING, "Rebuilding the warm floor")
        obs = with_lost(obs, lost)
        await self.nodes.fence(obs, lost, self._look_light)
        if not inp.dry_run:
            await await_rebuild_slot(self, inp.pool, inp.timings)
        # patched: a recovery that had planned its rebuild before lost spares were refilled replays as it ran.
        refill_spares = workflow.patched("refill-lost-spares")
        plan = rebuild.plan_rebuild(
            lost,
            promoted,
            st.unmatched,
            {(w.kind, w.name): w.replicas or 0 for w in obs.workloads},
            present_pods=obs.pods,
            pool_groups=st.initial_obs.snapshot.groups if st.initial_obs else (),
            refill_lost_spares=refill_spares,
        )
        st.expected_new = plan.expected_new
        # patched: a recovery that was past this point when the worker was upgraded replays as it ran.
        retire_first = workflow.patched("retire-before-regrow")
        for workload in plan.workloads:
            await self.mark_removed_first(
                inp.pool, workload.retire_pods, step="retire-mark", why="lost pod leaves"
            )
            for n, scale in enumerate(workload.scales):
                fields = scale.model_dump(include={"step", "kind", "name", "replicas"})
                change = ScaleChange(namespace=inp.pool.namespace, **fields)
                report = await self.act(ActActivities.scale_workload, change, scale.summary)
                self.decide(scale.summary, {"ledger": report.state})
                if (
                    retire_first
                    and n == 0
                    and workload.retire_pods
                    and len(workload.scales) > 1
                    and not inp.dry_run
                ):
                    what = f"{scale.kind} {scale.name}"
                    await await_retired(self, self._look_light, inp.timings, workload.retire_pods, what)
        unmatched = [g for g in lost if g.id in plan.unmatched]
        if not unmatched:
            self.figure("lead_time_announced_seconds", None)
            return
        g0 = unmatched[0]
        needs_new_node = not room_for(g0, obs.snapshot.nodes, lost)
        estimate = estimate_lead_time(g0.model, needs_new_node=needs_new_node, multi_node=g0.multi_node)
        self.figure("lead_time_announced_seconds", round(estimate.total_s, 1))
        text = lead_time_notice(inp.pool.key, unmatched, estimate)
        await self.notify("lead-time", text)
        self.decide(text, {"lead_time": estimate.model_dump(mode="json")})

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

    # ---------------------------------------------------------------- step 7

    async def place_replacements(self, lost: list[ReplicaGroup]) -> None:
        """Wait for the scheduler; a replacement still Pending after a few looks is reported, not awaited.

        The report says *why* it cannot land: no capacity, or fragmentation ("N free
        GPUs, no admissible group for shape S") from the whole-shape placement check
        (``fleet.runbook.judge_pending``).
        """
        inp, initial = self._inp, self._initial()
        await self.enter(Phase.PLACING, "Placing replacements: whole shape, admissible allocation")
        if inp.dry_run:
            self.decide("dry-run: placement not awaited")
            return
        timeout_s = inp.timings.replacement_timeout_s
        excluded = {n for g in lost for n in g.nodes}
        lost_pods = {p for g in lost for p in g.pods}
        looks: dict[str, int] = {}
        reported: set[str] = set()
        held: list[str] = []
        released = False

        async def look() -> str:
            """One look: "release" (pods held by a dead node), "placed", "stuck" (ask) or "pending"."""
            nonlocal looks, held
            obs = await self._observe(summary="placement: pending pods and free GPUs")
            pending = {p: m for p, m in obs.pending_pods.items() if p not in lost_pods}
            waiting = rebuild.awaiting_recreation(lost, initial.pod_uids, obs.pod_uids)
            held = rebuild.pods_held_by_lost_nodes(
                [g for g in lost if g.id in waiting], obs.pod_nodes, obs.snapshot.nodes
            )
            if held and not released:
                return "release"
            if not pending and not waiting:
                return "placed"
            judged = judge_pending(pending, looks, reported, obs.snapshot, excluded)
            looks = judged.looks
            for stuck in judged.unplaceable:
                reported.add(stuck.pod)
                text = (
                    f"[fleetmend] {inp.pool.key}: replacement {stuck.pod} cannot be placed - "
                    f"{stuck.result.reason} ({stuck.message})"
                )
                if stuck.result.fragmented:
                    self.figure("fragmentation", stuck.result.reason)
                self.decide(text, {"placement": stuck.result.model_dump(mode="json")})
                await self.notify(f"placement-{stuck.pod}", text)
            return "stuck" if judged.stuck else "pending"

        deadline = self.now() + timeout_s
        while True:
            seen, _ = await self.poll(
                look,
                lambda seen: seen != "pending",
                interval_s=inp.timings.poll_interval_s,
                deadline=deadline,
                summary="wait for the scheduler",
            )
            if seen == "release":
                released = True
                await self._force_delete(
                    held,
                    "(they sit on a node that is not Ready; their LeaderWorkerSet recreates the group only once "
                    "they are gone, and Kubernetes' taint eviction would remove them only after "
                    "tolerationSeconds, 300 s by default)",
                    lost,
                    step="release-held-pods",
                )
            elif seen == "placed":
                self.decide("every replacement is scheduled")
                return
            elif seen == "stuck":
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
                looks = {}
                deadline = self.now() + timeout_s
            else:
                self.decide(f"replacements still Pending after {timeout_s:.0f} s")
                return

    # ---------------------------------------------------------------- step 8 (workflows/node_qualification.py)

    @workflow.signal(name="node_triaged", description="A node's workflow: triage (and quarantine) done")
    def node_triaged(self, report: NodeTriaged) -> None:
        self.nodes.triaged(report)

    @workflow.signal(name="node_released", description="A node's workflow: the node left quarantine")
    def node_released(self, node: str) -> None:
        self.nodes.released(node)

    # ---------------------------------------------------------------- step 10

    async def verify_and_roll_back(self, lost: list[ReplicaGroup]) -> None:
        await self.enter(Phase.VERIFYING, "Verifying before lifting the emergency measures")
        await self.keeper.stop()
        if self._inp.dry_run:
            self.decide("dry-run: nothing to verify; the plan is in the ledger as planned effects")
            return
        lost_ids = {g.id for g in lost}
        while True:
            report, before, obs = await self._verify(lost_ids)
            if report.passed:
                break
            # A failed verification keeps the incident open: retry verifies again, skip accepts it as is.
            failing = failing_checks(report, "{name} observed {observed} expected {expected}")
            refusal = Refusal(step="verify", what="verification of the recovered pool", error=failing)
            if await self.escalate(refusal) == "skip":
                break
        await self.enter(Phase.ROLLING_BACK, "Rolling back the emergency measures")
        await self.keeper.roll_back(report.passed, before, obs, lost_ids, warm_floor=self._warm_target())

    async def _verify(
        self, lost_ids: set[str]
    ) -> tuple[VerificationReport, PoolObservation, PoolObservation]:
        """Poll the checks until they pass or the verify timeout is over; the last report is recorded."""
        inp, initial = self._inp, self._initial()
        waiting_on = [""]

        async def look() -> tuple[VerificationReport, PoolObservation, PoolObservation]:
            before, obs = await self.window(self._look, inp.timings.poll_interval_s, summary="verify")
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
                baseline_waiting=self.state.baseline,
                quarantined=self.state.quarantined,
                reconcile=reconcile,
            )
            # The warm floor to restore is what the pool had before the loss (serving + spare).
            return verify_recovery(observations, inp.objectives, warm_floor=self._warm_target()), before, obs

        def still_failing(seen: tuple[VerificationReport, PoolObservation, PoolObservation]) -> None:
            names = failing_checks(seen[0], "{name}", ", ")
            if names != waiting_on[0]:
                waiting_on[0] = names
                self.decide("verification waiting on: " + failing_checks(seen[0]))
            self.set_details(f"**Verifying** — waiting on: {names}")

        (report, before, obs), _ = await self.poll(
            look,
            lambda seen: seen[0].passed,
            interval_s=inp.timings.poll_interval_s,
            deadline=self.now() + inp.timings.verify_timeout_s,
            summary="verify: waiting on the failing checks",
            on_miss=still_failing,
        )
        self._status.verification = report
        verdict = "passed" if report.passed else "FAILED: " + failing_checks(report, "{name}", ", ")
        self.decide(f"verification {verdict}", {"checks": [c.model_dump(mode="json") for c in report.checks]})
        return report, before, obs

    def _warm_target(self) -> int:
        return warm_groups_before(self._initial())

    # ================================================================ operator steering and losses

    @workflow.signal(name="add_losses", description="Further losses within the incident's correlation window")
    def add_losses(self, reports: list[LossReport]) -> None:
        self.state.new_reports.extend(reports)

    async def _guard_capacity(self, action: str, removing: list[str]) -> None:
        """Capacity-aware storm protection before a destructive step (DESIGN.md §6a).

        If the groups left after the step could not carry what the pool serves now,
        stop and ask an operator — never silently proceed.
        """
        interval_s = self._inp.timings.poll_interval_s
        before, after = await self.window(self._look, interval_s, summary=f"guard: capacity before {action}")
        decision = recovery_guard(action, before, after, removing, self._inp.objectives.min_serving_groups)
        self.decide(decision.reason, {"guard": decision.model_dump(mode="json")})
        if not decision.allowed:
            await self.await_operator(decision.reason)

    async def on_phase_entered(self, phase: Phase) -> None:
        # Losses reported meanwhile (same correlation window) are derouted at the next boundary.
        if self.state.new_reports and phase not in (Phase.CONFIRMING, Phase.AWAITING_OPERATOR):
            await self._absorb_new_losses()

    async def _absorb_new_losses(self) -> None:
        st = self.state
        reports, st.new_reports = st.new_reports, []
        st.reports.extend(reports)
        self.set_fingerprints([r.fingerprint for r in st.reports])
        obs = await self._observe(check_progress=True, summary="confirm further losses")
        confirmed = self._confirm(obs, reports)
        more = [g for g in confirmed if g.id not in st.lost_ids]
        if confirmed and not more:
            # The alert that follows the fast path (or a second alert) names groups this recovery
            # already handles: absorbed, nothing to deroute again.
            self.decide(
                f"further report(s) name group(s) already handled: {', '.join(sorted(g.id for g in confirmed))}"
            )
        if more:
            st.lost_ids.update(g.id for g in more)
            # The steps still ahead (promote, rebuild, place, triage, verify) handle them too.
            st.lost_groups.extend(more)
            self.figure("lost_pods", sorted(p for g in st.lost_groups for p in g.pods))
            self.figure("lost_groups", sorted(st.lost_ids))
            self.decide(
                f"{len(more)} more group(s) lost within the correlation window: "
                f"{', '.join(g.id for g in more)}; derouting them now"
            )
            await self.stop_routing(obs, more)

    async def _observe(
        self, *, check_progress: bool = False, light: bool = False, summary: str
    ) -> PoolObservation:
        """A look at the pool, focused on what the reports name."""
        reports = self.state.reports
        progress = {r.replica_group or r.pod or "" for r in reports} - {""} if check_progress else set()
        return await self.observe_pool(
            self._inp.pool,
            summary,
            check_progress_of=progress,
            focus_nodes={r.node for r in reports if r.node},
            focus_pods={r.pod for r in reports if r.pod},
            light=light,
        )

    async def _look(self, summary: str) -> PoolObservation:
        return await self._observe(summary=summary)

    async def _look_light(self, summary: str) -> PoolObservation:
        return await self._observe(light=True, summary=summary)

    def _initial(self) -> PoolObservation:
        assert self.state.initial_obs is not None
        return self.state.initial_obs


__all__ = ["ReplicaLossRecovery"]
