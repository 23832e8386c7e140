"""ReplicaLossRecovery: the replica-loss runbook (DESIGN.md §3) as a durable workflow.

Order is the product: **stop routing to it → protect the survivors → decide
the in-flight requests → recover capacity → triage → ramp back → verify**.
"Kubernetes will reschedule it" is never the first step.

Every step reads the world through an observe activity, decides with a pure
policy from ``fleet/`` and changes the world through a ledger-backed activity
whose operation id is ``workflow id/step/target``. Operators watch the phase
(search attribute ``FleetmendPhase``), the current details and the activity
summaries in the Temporal UI, and steer with the ``pause``, ``resume``,
``abort`` and ``approve`` Updates.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.act import (
        ActActivities,
        AdmissionChangeRequest,
        EffectReport,
        NodeCordon,
        NodeQuarantine,
        NodeRelease,
        NotifyRequest,
        PodDeletion,
        PodLabelsChange,
        QualificationRequest,
        RetryPolicyChangeRequest,
        ScaleChange,
        WeightsChangeRequest,
    )
    from activities.audit import AuditActivities, ReconcileRequest
    from activities.observe import (
        DerouteWait,
        JournalRequest,
        ObserveActivities,
        ObserveRequest,
        ScrapeRequest,
    )
    from fleet import live_ramp
    from fleet import search_attributes as sa
    from fleet.capacity import Demand, GroupCapacity, check_capacity
    from fleet.engine_metrics import EngineSnapshot
    from fleet.incident import LossReport
    from fleet.leadtime import estimate_lead_time
    from fleet.loss import GroupVerdict, LossEvent, confirm_group, correlate, size_loss
    from fleet.observation import PoolObservation
    from fleet.placement import GroupShape, place_group
    from fleet.pool import GroupRole, ReplicaGroup, WorkloadKind
    from fleet.protocol import Admission, QualificationState
    from fleet.recovery import (
        CheckResult,
        IncidentCause,
        OperatorAction,
        Phase,
        ProcedureStatus,
        RecoveryInput,
        VerificationReport,
    )
    from fleet.retry_budget import decide_retry_policy
    from fleet.shedding import SurvivorLoad, can_lift_shedding, decide_shedding
    from fleet.spares import pick_spares
    from fleet.triage import PodFault, triage_node
    from fleet.verification import (
        LedgerReconcile,
        RecoveryObservations,
        ReplicaObservation,
        verify_recovery,
    )
    from fleet.verification import (
        NodeQuarantine as QuarantineState,
    )
    from fleet.vocabulary import (
        FAULT_CLASS_ANNOTATION,
        POD_DELETION_COST_ANNOTATION,
        QUARANTINE_LABEL,
        QUARANTINE_TAINT_KEY,
        REMEDIATED_AT_ANNOTATION,
    )
    from workflows.procedure import ACTIVITY_RETRY, ACTIVITY_TIMEOUT, Aborted, Procedure

_ACT_RETRY = ACTIVITY_RETRY
_ACT_TIMEOUT = ACTIVITY_TIMEOUT
# A Pending replacement is judged unplaceable only after this many looks (the scheduler needs a moment).
PLACEMENT_LOOKS = 3


@workflow.defn(name="ReplicaLossRecovery")
class ReplicaLossRecovery(Procedure):
    def __init__(self) -> None:
        super().__init__()
        self._inp: RecoveryInput | None = None
        self._reports: list[LossReport] = []
        self._new_reports: list[LossReport] = []
        self._awaiting: str | None = None
        self._approval: OperatorAction | None = None
        self._phase_started: dict[str, float] = {}

    # ================================================================ the runbook

    @workflow.run
    async def run(self, inp: RecoveryInput) -> ProcedureStatus:
        self._begin(inp)
        try:
            # 1. Confirm and size: lost, or merely slow?
            obs, lost = await self.confirm_and_size()
            if not lost:
                return self._finish(Phase.NOT_A_LOSS)
            # 2. Stop routing to it (router-only label; never a selector label).
            await self.deroute(obs, lost)
            correlation = self._correlation
            if correlation is not None and not correlation.replace:
                await self.bad_rollout(obs, lost)
                return self._finish(Phase.BAD_ROLLOUT)
            # 3. Protect the survivors: shed by the arithmetic of lost capacity.
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
            return self._finish(Phase.DONE)
        except Aborted:
            return self._finish(Phase.ABORTED)

    # ---------------------------------------------------------------- step 1

    _verdicts: list[GroupVerdict]
    _correlation: Any = None
    _baseline: dict[str, float]
    _initial_obs: PoolObservation | None = None

    async def confirm_and_size(self) -> tuple[PoolObservation, list[ReplicaGroup]]:
        await self._enter(Phase.CONFIRMING, "Confirming the loss: is the endpoint gone, or merely slow?")
        obs = await self._observe(
            check_progress=True, light=True, summary="confirm: read pool, endpoints, engines"
        )
        self._initial_obs = obs
        lost = self._confirm(obs, self._reports)
        if not lost:
            return obs, []
        size = size_loss(obs.snapshot, [g.id for g in lost])
        self._decide(f"loss confirmed: {size.summary}", {"loss": size.model_dump(mode="json")})
        self._figure("groups_lost", size.groups_lost)
        self._figure("lost_pods", sorted(p for g in lost for p in g.pods))
        events = [LossEvent(group_id=g.id, revision=g.revision, nodes=g.nodes, at=self._now()) for g in lost]
        self._correlation = correlate(events, obs.snapshot, self._inp_().timings.correlation_window_s)
        self._decide(f"cause: {self._correlation.reason}", {"cause": self._correlation.cause.value})
        self._figure("cause", self._correlation.cause.value)
        workflow.upsert_search_attributes(
            [sa.FLEETMEND_REPLICA_GROUP.value_set(",".join(g.id for g in lost)[:250])]
        )
        return obs, lost

    def _confirm(self, obs: PoolObservation, reports: list[LossReport]) -> list[ReplicaGroup]:
        """Resolve reports to replica groups (node → groups, pod → group) and confirm each."""
        candidates: dict[str, ReplicaGroup] = {}
        for r in reports:
            if r.replica_group:
                try:
                    g = obs.snapshot.group(r.replica_group)
                    candidates[g.id] = g
                except KeyError:
                    pass
            if r.pod and (g2 := obs.snapshot.group_of_pod(r.pod)) is not None:
                candidates[g2.id] = g2
            if r.node:
                for g3 in obs.snapshot.groups_on_node(r.node):
                    candidates[g3.id] = g3
        lost: list[ReplicaGroup] = []
        self._verdicts = []
        for g in candidates.values():
            verdict = confirm_group(g, obs.pods, obs.snapshot.nodes, obs.routed_pods, obs.publish_not_ready)
            self._verdicts.append(verdict)
            self._decide(
                f"{g.id}: {verdict.verdict.value} — {verdict.reason}", {"evidence": list(verdict.evidence)}
            )
            if verdict.lost:
                lost.append(g)
        if not candidates:
            self._decide(
                "no replica group of the pool matches the reports: "
                + "; ".join(
                    f"{r.alert_name} node={r.node} pod={r.pod} group={r.replica_group}" for r in reports
                )
            )
        return lost

    # ---------------------------------------------------------------- step 2

    async def deroute(self, obs: PoolObservation, lost: list[ReplicaGroup]) -> None:
        inp = self._inp_()
        await self._enter(Phase.DEROUTING, f"Derouting {', '.join(g.id for g in lost)}")
        label = self._router_label(obs)
        selecting = obs.controllers_selecting(label)
        dead_routed = sorted({p for v in self._verdicts if v.lost for p in v.dead_but_routed})
        # Every pod of a lost group leaves routing: one lost rank takes the whole group.
        to_deroute = sorted({p for g in lost for p in g.pods if p in obs.routed_pods} | set(dead_routed))
        if not to_deroute:
            self._decide("lost endpoints already out of routing (EndpointSlice not ready / label absent)")
        elif selecting:
            names = ", ".join(f"{w.kind}/{w.name}" for w in selecting)
            self._decide(
                f"refusing to remove label {label}: {names} select(s) on it — removing it would orphan the pod "
                "(the controller makes a replacement while the old pod keeps its GPUs); asking an operator "
                "to approve force-deleting the dead pods instead",
                {"selected_by": names, "pods": to_deroute},
            )
            approval = await self._ask_operator(
                f"approve force-delete of {', '.join(to_deroute)} (label {label} is a controller selector)"
            )
            self._decide(f"force-delete approved by {approval.operator}: {approval.reason}")
            await self._guard_capacity("force-delete of lost pods", removing=[g.id for g in lost])
            for pod in to_deroute:
                await self._act(
                    ActActivities.delete_pod,
                    PodDeletion(
                        step="deroute-force-delete",
                        namespace=inp.pool.namespace,
                        pod=pod,
                        grace_period_s=0,
                        dry_run=inp.dry_run,
                        fingerprints=self._fingerprints(),
                    ),
                    f"force-delete {pod} (operator-approved)",
                )
        else:
            for pod in to_deroute:
                await self._act(
                    ActActivities.patch_pod_metadata,
                    PodLabelsChange(
                        step="deroute",
                        namespace=inp.pool.namespace,
                        pod=pod,
                        labels={label: None},
                        dry_run=inp.dry_run,
                        fingerprints=self._fingerprints(),
                    ),
                    f"deroute {pod}: remove router-only label {label}",
                )
        if inp.dry_run:
            self._decide(f"dry-run: would deroute {', '.join(to_deroute) or 'nothing'}")
            return
        seconds = await self._wait_out_of_routing(set(to_deroute))
        self._figure("deroute_seconds", seconds)
        self._decide(
            f"dead endpoints out of routing {seconds:.2f} s after the first signal", {"pods": to_deroute}
        )

    async def _wait_out_of_routing(self, pods: set[str]) -> float:
        inp = self._inp_()
        seen = await workflow.execute_activity_method(
            ObserveActivities.await_derouted,
            DerouteWait(pool=inp.pool, pods=sorted(pods), timeout_s=inp.timings.deroute_timeout_s),
            start_to_close_timeout=timedelta(seconds=inp.timings.deroute_timeout_s + 30),
            heartbeat_timeout=timedelta(seconds=10),
            retry_policy=_ACT_RETRY,
            summary="wait until the router no longer routes to them",
        )
        if seen.still_routed:
            raise ApplicationError(
                f"{seen.still_routed} still routed {inp.timings.deroute_timeout_s:.0f} s after derouting; "
                "the router is not following the router-only label - check its configuration",
                non_retryable=True,
            )
        return max(0.0, seen.at - (inp.first_signal_at or self._started_at))

    # ---------------------------------------------------------------- bad rollout

    async def bad_rollout(self, obs: PoolObservation, lost: list[ReplicaGroup]) -> None:
        inp = self._inp_()
        await self._enter(Phase.BAD_ROLLOUT, "Bad rollout: revert, do not replace with the failing revision")
        revision = self._correlation.revision if self._correlation else None
        text = (
            f"[fleetmend] {inp.pool.key}: {len(lost)} replica group(s) of revision {revision} failed during its "
            "rollout. The failing groups are derouted; no replacement of that revision will be created. "
            "Revert the rollout (e.g. `kubectl rollout undo`) — fleetmend does not roll back on its own."
        )
        await self._notify("bad-rollout", text)
        self._decide(text, {"revision": revision, "groups": [g.id for g in lost]})

    # ---------------------------------------------------------------- step 3

    _shed: Any = None

    async def protect_survivors(self, lost: list[ReplicaGroup]) -> PoolObservation:
        inp = self._inp_()
        await self._enter(
            Phase.PROTECTING, "Protecting the survivors: reading their queues, KV and preemptions"
        )
        before = await self._observe(summary="survivors: first scrape")
        # Survivors' queues now are the baseline verification compares against.
        self._baseline = {gid: e.waiting for gid, e in before.engines.items()}
        await workflow.sleep(inp.timings.poll_interval_s, summary="interval between two scrapes")
        obs = await self._observe(summary="survivors: second scrape")
        seconds = max(1e-3, obs.snapshot.observed_at - before.snapshot.observed_at)
        lost_ids = {g.id for g in lost}
        survivors = self._survivor_loads(before, obs, seconds, lost_ids)
        per_group, capacity_note = live_ramp.per_group_capacity(
            inp.objectives.group_capacity_rps, before, obs, seconds
        )
        arrival = live_ramp.arrival_rate(before, obs, seconds, lost_ids)
        self._decide(f"arrivals {arrival:.1f} req/s; {capacity_note}")
        self._shed = decide_shedding(
            arrival_rps=arrival,
            survivors=survivors,
            lost_capacity_rps=per_group * len([g for g in lost if g.role is GroupRole.SERVING]),
            per_group_capacity_rps=per_group,
        )
        self._figure("shed_tiers", [t.value for t in self._shed.shed_tiers])
        self._decide(self._shed.reason, {"shed": self._shed.model_dump(mode="json")})
        if self._shed.shedding:
            await self._act(
                ActActivities.set_admission,
                AdmissionChangeRequest(
                    step="protect-shed",
                    pool=inp.pool,
                    admission=self._shed.admission,
                    dry_run=inp.dry_run,
                    fingerprints=self._fingerprints(),
                ),
                f"shed {', '.join(t.value for t in self._shed.shed_tiers)} at the gateway",
            )
        return obs

    def _survivor_loads(
        self, before: PoolObservation, after: PoolObservation, seconds: float, lost_ids: set[str]
    ) -> list[SurvivorLoad]:
        loads = []
        for g in after.snapshot.serving:
            if g.id in lost_ids or not g.routed or g.id not in after.engines:
                continue
            now_e = after.engines[g.id]
            prev_e = before.engines.get(g.id, now_e)
            loads.append(live_ramp.survivor_load(g.id, prev_e, now_e, seconds))
        return loads

    # ---------------------------------------------------------------- step 4

    async def decide_in_flight(self, obs: PoolObservation, lost: list[ReplicaGroup]) -> None:
        inp = self._inp_()
        await self._enter(Phase.IN_FLIGHT, "Deciding the lost replicas' in-flight requests")
        lost_ids = {g.id for g in lost}
        survivors = [
            live_ramp.survivor_load(g.id, obs.engines[g.id], obs.engines[g.id], 1.0)
            for g in obs.snapshot.serving
            if g.id not in lost_ids and g.id in obs.engines and g.routed
        ]
        decision = decide_retry_policy(survivors)
        self._decide(decision.reason, {"retry": decision.policy.model_dump(mode="json")})
        await self._act(
            ActActivities.set_retry_policy,
            RetryPolicyChangeRequest(
                step="in-flight-retry-policy",
                pool=inp.pool,
                retry=decision.policy,
                dry_run=inp.dry_run,
                fingerprints=self._fingerprints(),
            ),
            "retry before first byte only, budget from survivors' headroom",
        )
        leaders = [g.leader_pod for g in lost]
        journal = await workflow.execute_activity_method(
            ObserveActivities.read_journal,
            JournalRequest(pool=inp.pool, replicas=leaders),
            start_to_close_timeout=_ACT_TIMEOUT,
            retry_policy=_ACT_RETRY,
            summary=f"collect the request journal of {', '.join(leaders)}",
        )
        record = live_ramp.in_flight_record(journal, since=(inp.first_signal_at or self._started_at) - 60.0)
        self._figure("in_flight", record)
        self._decide(
            f"lost replicas' requests: {record['retried']} retried before first byte, {record['terminal_errors']} "
            f"ended with a terminal stream error after streaming (never replayed); "
            f"{record['effect_operation_ids']} proposed effect(s) carry request-derived operation ids",
            {"in_flight": record},
        )

    # ---------------------------------------------------------------- step 5

    async def promote_warm_capacity(
        self, obs: PoolObservation, lost: list[ReplicaGroup]
    ) -> list[ReplicaGroup]:
        inp = self._inp_()
        """Route to warm spares of the same model and revision by adding the router-only label.

        Nothing else about the spare changes: its role label may be what its own
        controller selects on, and changing it would orphan the pod.
        """
        await self._enter(Phase.PROMOTING, "Promoting warm spares of the same model and revision")
        obs = self._with_lost(obs, lost)
        failed_nodes = sorted({n for g in lost for n in g.nodes})
        pick = pick_spares(obs.snapshot, [g.id for g in lost if g.role is GroupRole.SERVING], failed_nodes)
        self._decide(pick.reason, {"promotions": pick.promotions, "rejected": pick.rejected})
        promoted: list[ReplicaGroup] = []
        label = self._router_label(obs)
        for lost_id, spare_id in pick.promotions.items():
            spare = obs.snapshot.group(spare_id)
            for pod in spare.pods:
                await self._act(
                    ActActivities.patch_pod_metadata,
                    PodLabelsChange(
                        step="promote",
                        namespace=inp.pool.namespace,
                        pod=pod,
                        labels={label: self._router_value()},
                        dry_run=inp.dry_run,
                        fingerprints=self._fingerprints(),
                    ),
                    f"promote spare {pod} in place of {lost_id}",
                )
            promoted.append(spare)
        self._figure("promoted", [g.id for g in promoted])
        self._unmatched = list(pick.unmatched)
        return promoted

    # ---------------------------------------------------------------- step 6

    _unmatched: list[str]

    async def rebuild_warm_floor(
        self, obs: PoolObservation, lost: list[ReplicaGroup], promoted: list[ReplicaGroup]
    ) -> None:
        """Replace what was used, with absolute replica counts (a retried scale cannot compound).

        A Deployment's lost pods still count as replicas until they are deleted, so
        the serving workload first *retires* them (deletion cost -1000 makes them
        the ones the ReplicaSet removes), then grows back by the groups no spare
        covered. The promoted spares carry the other slots; the spare workload grows
        by as many to restore the warm floor. A LeaderWorkerSet recreates a lost
        group by itself (RecreateGroupOnPodRestart).
        """
        inp = self._inp_()
        await self._enter(Phase.REBUILDING, "Rebuilding the warm floor")
        obs = self._with_lost(obs, lost)
        await self._fence_failed_nodes(obs, lost)
        replicas = {(w.kind, w.name): w.replicas or 0 for w in obs.workloads}
        lost_serving = [g for g in lost if g.role is GroupRole.SERVING]
        unmatched = [g for g in lost_serving if g.id in self._unmatched]
        self._expected_new = len(promoted) + len(unmatched)
        by_workload: dict[tuple[str, str], list[ReplicaGroup]] = {}
        for g in lost_serving:
            if g.workload_kind is WorkloadKind.DEPLOYMENT:
                by_workload.setdefault((g.workload_kind.value, g.workload_name), []).append(g)
        for (kind, name), groups in by_workload.items():
            for g in groups:
                for pod in g.pods:
                    await self._act(
                        ActActivities.patch_pod_metadata,
                        PodLabelsChange(
                            step="retire-mark",
                            namespace=inp.pool.namespace,
                            pod=pod,
                            annotations={POD_DELETION_COST_ANNOTATION: "-1000"},
                            dry_run=inp.dry_run,
                            fingerprints=self._fingerprints(),
                        ),
                        f"mark lost {pod} to be removed first",
                    )
            current = replicas.get((kind, name), 0)
            retired = max(0, current - len(groups))
            await self._scale(
                kind, name, retired, "retire-lost", f"{kind} {name} → {retired}: lost pods leave"
            )
            regrow = [g for g in groups if g in unmatched]
            if regrow:
                target = retired + len(regrow)
                await self._scale(
                    kind, name, target, "replace-lost", f"{kind} {name} → {target}: replacements"
                )
        spares_used: dict[tuple[str, str], int] = {}
        for spare in promoted:
            key = (spare.workload_kind.value, spare.workload_name)
            spares_used[key] = spares_used.get(key, 0) + 1
        for (kind, name), n in spares_used.items():
            target = replicas.get((kind, name), 0) + n
            await self._scale(
                kind, name, target, "rebuild-warm-floor", f"{kind} {name} → {target}: new warm spare"
            )
        if unmatched:
            g0 = unmatched[0]
            estimate = estimate_lead_time(
                g0.model, needs_new_node=not self._room_for(obs, g0, lost), multi_node=g0.multi_node
            )
            self._figure("lead_time_announced_seconds", round(estimate.total_s, 1))
            text = (
                f"[fleetmend] {inp.pool.key}: no warm spare for {', '.join(g.id for g in unmatched)}. "
                f"{estimate.text}. Shedding stays on until capacity returns."
            )
            await self._notify("lead-time", text)
            self._decide(text, {"lead_time": estimate.model_dump(mode="json")})
        else:
            self._figure("lead_time_announced_seconds", None)

    _expected_new: int = 0

    @staticmethod
    def _with_lost(obs: PoolObservation, lost: list[ReplicaGroup]) -> PoolObservation:
        """The observation with the lost groups as confirmed (a deleted pod no longer shows up)."""
        present = {g.id for g in obs.snapshot.groups}
        missing = tuple(g for g in lost if g.id not in present)
        if not missing:
            return obs
        return obs.model_copy(
            update={"snapshot": obs.snapshot.model_copy(update={"groups": obs.snapshot.groups + missing})}
        )

    async def _fence_failed_nodes(self, obs: PoolObservation, lost: list[ReplicaGroup]) -> None:
        """Cordon nodes that failed (not Ready, or a GPU/fabric fault) before anything is scheduled.

        Until the node controller marks a silent node unreachable, the scheduler may
        still bind a replacement to it; cordoning first keeps replacements off it.
        Triage adds the taint and label later.
        """
        inp = self._inp_()
        hints = " ".join(r.fault_hint or "" for r in self._reports)
        hardware_hint = any(k in hints for k in ("xid", "nvlink", "thermal", "ecc"))
        for node in sorted({n for g in lost for n in g.nodes}):
            info = obs.snapshot.node(node)
            failed = info is None or info.ready is not True or hardware_hint
            reported = any(r.node == node for r in self._reports)
            if not (failed or reported) or (info is not None and info.unschedulable):
                continue
            await self._act(
                ActActivities.cordon_node,
                NodeCordon(step="fence", node=node, dry_run=inp.dry_run, fingerprints=self._fingerprints()),
                f"cordon failed node {node} so no replacement lands on it",
            )
            self._decide(f"cordoned {node}: replacements must not land on the failed node")

    def _room_for(self, obs: PoolObservation, g: ReplicaGroup, lost: list[ReplicaGroup]) -> bool:
        shape = GroupShape(pods=len(g.pods), gpus_per_pod=max(1, g.gpus_per_pod))
        return place_group(shape, obs.snapshot.nodes, exclude={n for x in lost for n in x.nodes}).admissible

    async def _scale(self, kind: str, name: str, replicas: int, step: str, summary: str) -> None:
        inp = self._inp_()
        report = await self._act(
            ActActivities.scale_workload,
            ScaleChange(
                step=f"{step}-{name}",
                namespace=inp.pool.namespace,
                kind=kind,
                name=name,
                replicas=replicas,
                dry_run=inp.dry_run,
                fingerprints=self._fingerprints(),
            ),
            summary,
        )
        self._decide(summary, {"ledger": report.state})

    # ---------------------------------------------------------------- step 7

    async def place_replacements(self, lost: list[ReplicaGroup]) -> None:
        """Wait for the scheduler; a replacement still Pending after a few looks is reported, not awaited.

        The report says *why* it cannot land: no capacity, or fragmentation ("N free
        GPUs, no admissible group for shape S") from the whole-shape placement check.
        """
        inp = self._inp_()
        await self._enter(Phase.PLACING, "Placing replacements: whole shape, admissible allocation")
        if inp.dry_run:
            self._decide("dry-run: placement not awaited")
            return
        deadline = self._now() + inp.timings.replacement_timeout_s
        excluded = {n for g in lost for n in g.nodes}
        lost_pods = {p for g in lost for p in g.pods}
        looks: dict[str, int] = {}
        reported: set[str] = set()
        while True:
            obs = await self._observe(summary="placement: pending pods and free GPUs")
            pending = {p: m for p, m in obs.pending_pods.items() if p not in lost_pods}
            if not pending:
                self._decide("every replacement is scheduled")
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
                    self._figure("fragmentation", result.reason)
                self._decide(text, {"placement": result.model_dump(mode="json")})
                await self._notify(f"placement-{pod}", text)
            if reported and all(p in reported for p in pending):
                # Not silently Pending: say why, and let an operator decide (free capacity, or abort).
                approval = await self._ask_operator(
                    f"replacement(s) {', '.join(sorted(reported))} cannot be placed as a whole group; free a "
                    "topology domain or add a node, then approve to keep waiting for placement (or abort)"
                )
                self._decide(
                    f"{approval.operator}: capacity freed ({approval.reason}); waiting for placement again"
                )
                reported.clear()
                looks.clear()
                deadline = self._now() + inp.timings.replacement_timeout_s
                continue
            if self._now() > deadline:
                self._decide(f"replacements still Pending after {inp.timings.replacement_timeout_s:.0f} s")
                return
            await workflow.sleep(inp.timings.poll_interval_s, summary="wait for the scheduler")

    # ---------------------------------------------------------------- step 8

    async def triage_hardware(self, obs: PoolObservation, lost: list[ReplicaGroup]) -> None:
        inp = self._inp_()
        hint = next((r.fault_hint for r in self._reports if r.fault_hint), None)
        nodes = []
        for node in sorted({n for g in lost for n in g.nodes}):
            info = obs.snapshot.node(node)
            if info is None or info.ready is not True or hint or any(r.node == node for r in self._reports):
                nodes.append(node)
            else:
                self._decide(
                    f"{node} is Ready and no alert points at it: the loss is a pod-level fault, "
                    "the node stays in service (no quarantine)"
                )
        for node in nodes:
            health = await workflow.execute_activity_method(
                ObserveActivities.read_node_health,
                node,
                start_to_close_timeout=_ACT_TIMEOUT,
                retry_policy=_ACT_RETRY,
                summary=f"triage: read DCGM, conditions and pod status of {node}",
            )
            remediated = health.annotations.get(REMEDIATED_AT_ANNOTATION)
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
                now=self._now(),
                telemetry=health.telemetry,
                node_conditions=health.conditions,
                pods=pods,
                remediated_at=float(remediated) if remediated else None,
                hint=hint,
            )
            self._figure("fault_class", result.fault_class.value)
            self._decide(
                f"triage {node}: {result.reason}; follow-up: {result.follow_up}",
                {"triage": result.model_dump(mode="json")},
            )
            if not result.quarantine:
                continue
            await self._act(
                ActActivities.quarantine_node,
                NodeQuarantine(
                    step="quarantine",
                    node=node,
                    dry_run=inp.dry_run,
                    fingerprints=self._fingerprints(),
                    labels={QUARANTINE_LABEL: result.fault_class.value},
                    annotations={
                        FAULT_CLASS_ANNOTATION: result.fault_class.value,
                        REMEDIATED_AT_ANNOTATION: f"{self._now():.0f}",
                    },
                    taint_key=QUARANTINE_TAINT_KEY,
                    taint_value=result.fault_class.value,
                ),
                f"quarantine {node}: cordon + taint + label ({result.fault_class.value})",
            )
            self._quarantined.append(node)
            if result.needs_operator:
                self._decide(
                    f"{node} was remediated within the repeat window: it stays out until an operator "
                    "returns it"
                )
                continue
            if health.node is None or health.node.ready is not True or health.telemetry is None:
                self._decide(
                    f"{node} is not reachable: qualification runs when it is back; it stays quarantined"
                )
                continue
            await self._act(
                ActActivities.start_qualification,
                QualificationRequest(
                    step="qualify", node=node, dry_run=inp.dry_run, fingerprints=self._fingerprints()
                ),
                f"start qualification diagnostics on {node}",
            )
            self._decide(f"qualification started on {node}; it returns to the pool only if it passes")
            await self._await_qualification(node, result.fault_class.value)

    _quarantined: list[str]

    async def _await_qualification(self, node: str, fault_class: str) -> None:
        """Return the node only when its qualification passes; otherwise it stays quarantined."""
        inp = self._inp_()
        deadline = self._now() + inp.timings.qualification_timeout_s
        while True:
            q = await workflow.execute_activity_method(
                ObserveActivities.read_qualification,
                node,
                start_to_close_timeout=_ACT_TIMEOUT,
                retry_policy=_ACT_RETRY,
                summary=f"qualification of {node}",
            )
            if q.state == QualificationState.PASSED:
                await self._act(
                    ActActivities.release_node,
                    NodeRelease(
                        step="return-node",
                        node=node,
                        labels={QUARANTINE_LABEL: None},
                        dry_run=inp.dry_run,
                        fingerprints=self._fingerprints(),
                    ),
                    f"return {node} to the pool: qualification passed",
                )
                self._quarantined.remove(node)
                self._decide(f"{node} passed qualification ({q.detail}); uncordoned and returned to the pool")
                return
            if q.state == QualificationState.FAILED:
                self._decide(
                    f"{node} failed qualification ({q.detail}): it stays quarantined for the {fault_class} follow-up"
                )
                return
            if self._now() > deadline:
                self._decide(
                    f"{node} qualification still running after {inp.timings.qualification_timeout_s:.0f} s; "
                    "it stays quarantined until it passes"
                )
                return
            await workflow.sleep(
                max(inp.timings.poll_interval_s, 1.0), summary=f"qualification of {node} running"
            )

    # ---------------------------------------------------------------- step 9

    async def ramp_back(self, promoted: list[ReplicaGroup]) -> None:
        inp = self._inp_()
        await self._enter(Phase.RAMPING, "Ramping traffic back by measured service rate")
        if inp.dry_run:
            self._decide("dry-run: ramp not performed")
            return
        initial = self._initial_obs
        assert initial is not None
        new_pods = {g.leader_pod for g in promoted}
        deadline = self._now() + inp.timings.ramp_max_s
        previous: dict[str, EngineSnapshot] | None = None
        previous_at = 0.0
        step = 0
        backoff: dict[str, float] = {}
        while True:
            obs = await self._observe(summary="ramp: routed replicas and their engines")
            new_pods |= live_ramp.new_leaders(initial, obs)
            routed_leaders = sorted(
                g.leader_pod
                for g in obs.snapshot.groups
                if g.routed and g.ready and g.leader_pod in obs.routed_pods
            )
            if not new_pods & set(routed_leaders):
                if self._now() > deadline:
                    self._decide("no new replica to ramp (none routed yet, none pending)")
                    return
                await workflow.sleep(
                    inp.timings.poll_interval_s, summary="wait for a replacement to be ready"
                )
                continue
            current = await workflow.execute_activity_method(
                ObserveActivities.scrape_engines,
                ScrapeRequest(pool=inp.pool, pods=routed_leaders),
                start_to_close_timeout=_ACT_TIMEOUT,
                retry_policy=_ACT_RETRY,
                summary=f"ramp: measure {len(routed_leaders)} replicas",
            )
            if previous is not None:
                plan = live_ramp.plan_weights(
                    previous,
                    current,
                    max(1e-3, self._now() - previous_at),
                    sorted(new_pods & set(routed_leaders)),
                    ttft_slo_s=inp.objectives.ttft_p99_slo_s,
                    warm_fraction=inp.timings.warm_fraction,
                    backoff=backoff,
                )
                backoff = dict(plan.backoff)
                step += 1
                await self._act(
                    ActActivities.set_weights,
                    WeightsChangeRequest(
                        step=f"ramp-{step}",
                        pool=inp.pool,
                        weights=plan.weights,
                        dry_run=inp.dry_run,
                        fingerprints=self._fingerprints(),
                    ),
                    f"ramp step {step}: weights by measured rate",
                )
                self._figure("ramp_weights", plan.weights)
                self._decide(
                    f"ramp step {step}: {plan.reason}", {"weights": plan.weights, "rates": plan.rates}
                )
                ramped = new_pods & set(routed_leaders)
                if (plan.all_warm and len(ramped) >= self._expected_new) or self._now() > deadline:
                    self._decide("new replicas warm: ramp complete" if plan.all_warm else "ramp window over")
                    return
            previous, previous_at = current, self._now()
            await workflow.sleep(inp.timings.ramp_interval_s, summary=f"ramp interval (step {step})")

    async def verify_and_roll_back(self, lost: list[ReplicaGroup]) -> None:
        inp = self._inp_()
        await self._enter(Phase.VERIFYING, "Verifying before lifting the emergency measures")
        if inp.dry_run:
            self._decide("dry-run: nothing to verify; the plan is in the ledger as planned effects")
            return
        deadline = self._now() + inp.timings.verify_timeout_s
        lost_ids = {g.id for g in lost}
        report: VerificationReport | None = None
        last_failing = ""
        while True:
            before = await self._observe(summary="verify: first scrape")
            await workflow.sleep(inp.timings.poll_interval_s, summary="verify: interval")
            obs = await self._observe(summary="verify: second scrape")
            reconcile = await workflow.execute_activity_method(
                AuditActivities.reconcile_workflow,
                ReconcileRequest(workflow_id=workflow.info().workflow_id),
                start_to_close_timeout=_ACT_TIMEOUT,
                retry_policy=_ACT_RETRY,
                summary="verify: ledger reconciliation for this workflow",
            )
            observations = self._recovery_observations(before, obs, lost_ids, reconcile)
            # The warm floor to restore is what the pool had before the loss (serving + spare).
            report = verify_recovery(observations, inp.objectives, warm_floor=self._warm_target(obs))
            if report.passed or self._now() > deadline:
                break
            failing = ", ".join(c.name for c in report.checks if not c.passed)
            if failing != last_failing:
                last_failing = failing
                self._decide(
                    "verification waiting on: "
                    + "; ".join(
                        f"{c.name} (observed {c.observed}, expected {c.expected})"
                        for c in report.checks
                        if not c.passed
                    )
                )
            self._set_details(f"**Verifying** — waiting on: {failing}")
            await workflow.sleep(inp.timings.poll_interval_s, summary=f"verify: waiting on {failing}"[:190])
        assert report is not None
        self._status_().verification = report
        self._decide(
            "verification "
            + ("passed" if report.passed else "FAILED: ")
            + ", ".join(c.name for c in report.checks if not c.passed),
            {"checks": [c.model_dump(mode="json") for c in report.checks]},
        )
        await self._enter(Phase.ROLLING_BACK, "Rolling back the emergency measures")
        if self._shed is not None and self._shed.shedding:
            survivors = self._survivor_loads(
                before, obs, max(1e-3, obs.snapshot.observed_at - before.snapshot.observed_at), lost_ids
            )
            lift = can_lift_shedding(
                warm_groups=sum(1 for g in obs.snapshot.groups if g.ready),
                warm_floor=self._warm_target(obs),
                replacement_warm=report.passed,
                survivors=survivors,
            )
            self._decide(f"lift shedding? {lift.reason}")
            if lift.lift or report.passed:
                await self._act(
                    ActActivities.set_admission,
                    AdmissionChangeRequest(
                        step="rollback-lift-shedding",
                        pool=inp.pool,
                        admission=Admission(),
                        dry_run=inp.dry_run,
                        fingerprints=self._fingerprints(),
                    ),
                    "lift shedding: warm floor restored",
                )
                self._figure("shedding_lifted", True)
        if not report.passed:
            raise ApplicationError(
                "verification failed: "
                + "; ".join(
                    f"{c.name} observed {c.observed} expected {c.expected}"
                    for c in report.checks
                    if not c.passed
                ),
                non_retryable=True,
            )

    def _warm_target(self, obs: PoolObservation) -> int:
        initial = self._initial_obs
        assert initial is not None
        return len([g for g in initial.snapshot.groups if g.ready]) if initial else 0

    def _recovery_observations(
        self, before: PoolObservation, obs: PoolObservation, lost_ids: set[str], reconcile: LedgerReconcile
    ) -> RecoveryObservations:
        initial = self._initial_obs
        assert initial is not None
        seconds = max(1e-3, obs.snapshot.observed_at - before.snapshot.observed_at)
        target = len([g for g in initial.snapshot.serving if g.routed or g.id in lost_ids])
        serving_now = [g for g in obs.snapshot.serving if g.id not in lost_ids or g.ready]
        routed_ready = [g for g in serving_now if g.ready and g.routed]
        # The routed endpoint is the group's leader (a Service may select only leaders).
        endpoint_ok = [
            g
            for g in routed_ready
            if (o := obs.pods.get(g.leader_pod)) is not None
            and o.endpoint is not None
            and o.endpoint.serving is not False
            and o.endpoint.terminating is not True
        ]
        replicas = []
        for g in routed_ready:
            if g.id not in obs.engines:
                continue
            load = live_ramp.survivor_load(
                g.id, before.engines.get(g.id, obs.engines[g.id]), obs.engines[g.id], seconds
            )
            rates = live_ramp.window_ttft_p99(before.engines.get(g.id), obs.engines[g.id])
            replicas.append(
                ReplicaObservation(
                    group_id=g.id,
                    waiting=load.waiting,
                    baseline_waiting=self._baseline.get(g.id, 0.0),
                    preemptions_per_s=load.preemptions_per_s,
                    ttft_p99_s=rates,
                )
            )
        quarantine = {}
        for node in self._quarantined:
            info = obs.snapshot.node(node)
            quarantine[node] = QuarantineState(
                cordoned=bool(info and info.unschedulable),
                tainted=bool(info and any(t.key == QUARANTINE_TAINT_KEY for t in info.taints)),
                labelled=bool(info and QUARANTINE_LABEL in info.labels),
            )
        return RecoveryObservations(
            target_groups=target,
            workload_ready_groups=len(routed_ready),
            endpoint_serving_groups=len(endpoint_ok),
            replicas=tuple(replicas),
            ledger=reconcile,
            warm_groups=sum(1 for g in obs.snapshot.groups if g.ready),
            failed_nodes=quarantine,
        )

    # ================================================================ operator steering

    @workflow.signal(name="add_losses", description="Further losses within the incident's correlation window")
    def add_losses(self, reports: list[LossReport]) -> None:
        self._new_reports.extend(reports)

    async def _ask_operator(self, what: str) -> OperatorAction:
        timeout_s = self._inp_().timings.approval_timeout_s
        approval = await self._await_operator(what, timeout_s)
        if approval is None:
            raise ApplicationError(
                f"no operator approved within {timeout_s:.0f} s: {what}", non_retryable=True
            )
        return approval

    async def _announce_awaiting(self, what: str) -> None:
        status = self._status_()
        await self._notify(
            f"approval-{len(status.decisions)}",
            f"[fleetmend] {self._inp_().pool.key}: operator needed — {what}",
        )

    async def _guard_capacity(self, action: str, removing: list[str]) -> None:
        """Capacity-aware storm protection before a destructive step (DESIGN.md §6a).

        Each serving group contributes the tokens/s it is serving now (a dead one 0);
        the demand is what the pool serves now. If the groups left after the step
        could not carry it, stop and ask an operator — never silently proceed.
        """
        inp = self._inp_()
        before = await self._observe(summary=f"guard: capacity before {action}")
        await workflow.sleep(inp.timings.poll_interval_s, summary="guard: measurement interval")
        after = await self._observe(summary=f"guard: capacity before {action}")
        seconds = max(1e-3, after.snapshot.observed_at - before.snapshot.observed_at)
        capacity = {}
        for g in after.snapshot.serving:
            e_now, e_before = after.engines.get(g.id), before.engines.get(g.id)
            tokens = (
                max(0.0, e_now.generation_tokens_total - e_before.generation_tokens_total) / seconds
                if e_now is not None and e_before is not None and g.ready
                else 0.0
            )
            capacity[g.id] = GroupCapacity(tokens_per_s=tokens)
        removing = [g for g in removing if g in capacity]
        demand = Demand(tokens_per_s=sum(c.tokens_per_s for c in capacity.values()))
        decision = check_capacity(
            action, capacity, removing, demand, min_groups=inp.objectives.min_serving_groups, headroom=1.0
        )
        self._decide(decision.reason, {"guard": decision.model_dump(mode="json")})
        if not decision.allowed:
            await self._ask_operator(decision.reason)

    # ================================================================ plumbing

    _started_at: float = 0.0

    def _begin(self, inp: RecoveryInput) -> None:
        self._inp = inp
        self._reports = list(inp.reports)
        self._quarantined = []
        self._unmatched = []
        self._baseline = {}
        self._started_at = self._now()
        self._status = ProcedureStatus(
            workflow=workflow.info().workflow_id, pool=inp.pool, phase=Phase.CONFIRMING, dry_run=inp.dry_run
        )
        self._status.figures.update({"cause_hint": inp.cause.value, "dry_run": inp.dry_run})
        workflow.upsert_search_attributes(
            [
                sa.FLEETMEND_KIND.value_set("replica-loss"),
                sa.FLEETMEND_NAMESPACE.value_set(inp.pool.namespace),
                sa.FLEETMEND_POOL.value_set(inp.pool.key),
                sa.FLEETMEND_SEVERITY.value_set(inp.severity.value),
                sa.FLEETMEND_DRY_RUN.value_set(inp.dry_run),
            ]
        )

    async def _on_phase_entered(self, phase: Phase) -> None:
        # Losses reported meanwhile (same correlation window) are derouted at the next boundary.
        if self._new_reports and phase not in (Phase.CONFIRMING, Phase.AWAITING_OPERATOR):
            await self._absorb_new_losses()

    async def _absorb_new_losses(self) -> None:
        reports, self._new_reports = self._new_reports, []
        self._reports.extend(reports)
        obs = await self._observe(check_progress=True, summary="confirm further losses")
        more = self._confirm(obs, reports)
        if more:
            self._decide(
                f"{len(more)} more group(s) lost within the correlation window: "
                f"{', '.join(g.id for g in more)}; derouting them now"
            )
            await self.deroute(obs, more)

    async def _observe(
        self, *, check_progress: bool = False, light: bool = False, summary: str
    ) -> PoolObservation:
        inp = self._inp_()
        focus: list[str] = []
        if check_progress:
            focus = sorted({r.replica_group or r.pod or "" for r in self._reports} - {""})
        return await workflow.execute_activity_method(
            ObserveActivities.observe_pool,
            ObserveRequest(
                pool=inp.pool,
                check_progress_of=focus,
                focus_nodes=sorted({r.node for r in self._reports if r.node}),
                focus_pods=sorted({r.pod for r in self._reports if r.pod}),
                light=light,
            ),
            start_to_close_timeout=_ACT_TIMEOUT,
            retry_policy=_ACT_RETRY,
            summary=summary[:190],
        )

    async def _act(self, method: Any, request: Any, summary: str) -> Any:
        await self._checkpoint()
        result = await workflow.execute_activity_method(
            method,
            request,
            start_to_close_timeout=_ACT_TIMEOUT,
            retry_policy=_ACT_RETRY,
            summary=summary[:190],
        )
        reports = result if isinstance(result, list) else [result]
        for r in reports:
            if isinstance(r, EffectReport):
                key = f"effects_{r.state}"
                self._status_().figures[key] = self._status_().figures.get(key, 0) + 1
                if r.replayed:
                    self._status_().figures["effects_deduplicated"] = (
                        self._status_().figures.get("effects_deduplicated", 0) + 1
                    )
        return result

    async def _notify(self, topic: str, text: str) -> None:
        inp = self._inp_()
        await self._act(
            ActActivities.notify,
            NotifyRequest(
                step="notify", topic=topic, text=text, dry_run=inp.dry_run, fingerprints=self._fingerprints()
            ),
            f"incident channel: {topic}",
        )

    def _fingerprints(self) -> list[str]:
        return sorted({r.fingerprint for r in self._reports})[:20]

    def _router_label(self, obs: PoolObservation) -> str:
        return obs.router_label

    def _router_value(self) -> str:
        assert self._initial_obs is not None
        return self._initial_obs.router_label_value

    def _inp_(self) -> RecoveryInput:
        assert self._inp is not None
        return self._inp


__all__ = ["CheckResult", "IncidentCause", "ReplicaLossRecovery"]
