"""A failed node's hardware path (DESIGN.md §3 step 8): triage, quarantine, qualification, repair watch.

``NodeLifecycle`` is that path, written once. A recovery runs it as the body of a
``NodeQualification`` child workflow per failed node (one per node, visible in the UI with its
own phase, details and Updates: a refused qualification Job asks an operator *there*), so the
recovery's verification never waits on a repair that may take hours:

* the recovery waits for each node's **triage report** - the fault class and, when the node is
  quarantined, the quarantine in place (cordon + label + taint) and the remediation gate's
  verdict - because verification checks that every failed node is quarantined;
* it leaves to the child the qualification Jobs, the repair watch and the node's return; the
  child outlives the recovery (``ParentClosePolicy.ABANDON``) and tells it, while it runs, when
  the node returned or the name now holds another machine.

The child's operation ids are in the recovery's scope (``<recovery id>@<first run>/step/node``,
as the inline path wrote them), so they stay unique per incident and an auditor finds a node's
quarantine under the incident that made it; its own incident-channel topics carry the node name.

Recoveries started before the child existed replay the same code inline in the recovery
(``workflow.patched("node-qualification-child")`` in ``NodeWorkflows.triage``). ``NodeWorkflows``
is the recovery's side: the fence of failed nodes (step 6), starting the node workflows and taking
their reports (signals ``node_triaged`` and ``node_released``).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from pydantic import BaseModel, Field
from temporalio import workflow
from temporalio.exceptions import ChildWorkflowError, FailureError
from temporalio.workflow import ChildWorkflowHandle, ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.act import ActActivities, NodeCordon, NodeTaint, PodDeletion
    from activities.observe import ObserveActivities
    from activities.qualification import (
        NodeReturn,
        QualificationActivities,
        QualificationJobRef,
        QualificationJobRequest,
        QualificationRead,
    )
    from fleet.device_fault import FaultScope, device_policy, fault_scope, fenceable
    from fleet.incident import PoolRef
    from fleet.loss import failed_nodes, silent_nodes
    from fleet.observation import PoolObservation
    from fleet.pool import ReplicaGroup
    from fleet.qualification import (
        MACHINE_ANNOTATION,
        GpuHolder,
        Identity,
        QualificationSlots,
        QualificationState,
        Verdict,
        clear_for_qualification,
        identity,
        qualification_slot,
        repaired,
    )
    from fleet.recovery import Phase, ProcedureStatus, RecoveryInput, RecoveryTimings
    from fleet.recovery_state import RecoveryState
    from fleet.runbook import nodes_to_triage, pod_faults, with_lost
    from fleet.triage import triage_node
    from fleet.vocabulary import (
        FAULT_CLASS_ANNOTATION,
        QUARANTINE_LABEL,
        QUARANTINE_TAINT_KEY,
        REMEDIATED_AT_ANNOTATION,
    )
    from workflows.device_quarantine import DeviceLifecycle, device_scope
    from workflows.procedure import Aborted, Procedure
    from workflows.remediation_history import machine_gate


Look = Callable[[str], Awaitable[PoolObservation]]


class NodeQualificationInput(BaseModel):
    pool: PoolRef
    node: str
    hint: str | None = Field(None, description="A report's fault hint (e.g. the alert named an Xid)")
    timings: RecoveryTimings = Field(default_factory=RecoveryTimings)
    dry_run: bool = False
    recovery_id: str = Field(description="The recovery that started it (told the triage and the release)")
    scope: str = Field(description="The recovery's operation-id scope: <recovery id>@<first run id>")


class NodeTriaged(BaseModel):
    """What a node's workflow tells its recovery once triage (and any quarantine) is done."""

    node: str
    workflow_id: str
    summary: str
    figures: dict[str, Any] = Field(default_factory=dict)
    fault_class: str
    quarantined: bool
    needs_operator: str | None = Field(None, description="Why it is not remediated automatically")


class NodeHooks(Protocol):
    """What the lifecycle tells the recovery when it runs as a child (inline, the recovery is the toolkit)."""

    async def triaged(self, report: NodeTriaged) -> None: ...

    async def released(self, node: str) -> None: ...

    async def stage(self, phase: Phase, details: str) -> None: ...


class NodeLifecycle:
    """One node's triage, quarantine, qualification and repair watch, acting through a procedure toolkit.

    ``quarantined`` is the list of nodes under quarantine that verification checks (the recovery's
    own list inline, the child's list otherwise); ``hooks`` is None inline.
    """

    def __init__(
        self,
        proc: Procedure,
        pool: PoolRef,
        timings: RecoveryTimings,
        quarantined: list[str],
        hooks: NodeHooks | None = None,
    ) -> None:
        self._proc, self._pool, self._timings = proc, pool, timings
        self._quarantined, self._hooks = quarantined, hooks

    async def run(self, node: str, hint: str | None) -> None:
        proc = self._proc
        health = await proc.observe(
            ObserveActivities.read_node_health,
            node,
            f"triage: read DCGM, conditions and pod status of {node}",
        )
        result = triage_node(
            node,
            now=proc.now(),
            telemetry=health.telemetry,
            node_conditions=health.conditions,
            pods=pod_faults(health.pod_reasons),
            hint=hint,
        )
        summary = f"triage {node}: {result.reason}; follow-up: {result.follow_up}"
        figures = {"triage": result.model_dump(mode="json"), "machine": health.machine}
        proc.figure("fault_class", result.fault_class.value)
        proc.decide(summary, figures)
        report = NodeTriaged(
            node=node,
            workflow_id=workflow.info().workflow_id,
            summary=summary,
            figures=figures,
            fault_class=result.fault_class.value,
            quarantined=False,
        )
        if not result.quarantine:
            await self._report(report)
            return
        machine = health.machine
        history, gate = await machine_gate(proc, machine, self._timings)
        if workflow.patched("device-scope"):
            scope = fault_scope(
                result,
                health.telemetry,
                health.conditions,
                ready=health.node.ready if health.node else None,
                annotations=health.annotations,
                policy=device_policy(self._timings),
                history_allows=gate.allowed,
            )
            scope = fenceable(scope, health.dra_devices)
            proc.decide(scope.reason, {"scope": scope.model_dump(mode="json")})
            if scope.scope is FaultScope.FENCED:
                proc.figure("fault_scope", scope.scope.value)
                await self._report(report)
                return
            if scope.device is not None:
                await self._report(
                    report.model_copy(
                        update={"figures": {**figures, "device": scope.device.model_dump(mode="json")}}
                    )
                )
                await DeviceLifecycle(self, proc, self._pool, self._timings).run(
                    node, health, result, scope.device
                )
                return
        await self.quarantine(node, machine, result.fault_class.value, step="quarantine")
        needs_operator = None if gate.allowed else f"{node}: {gate.reason}"
        await self._report(report.model_copy(update={"quarantined": True, "needs_operator": needs_operator}))
        if needs_operator is not None:
            proc.figure("needs_operator", needs_operator)
            proc.decide(
                f"{node} ({machine}): {gate.reason}; it stays quarantined",
                {"history": [r.model_dump() for r in history]},
            )
            await proc.notify(
                f"remediation-cap-{node}",
                f"[fleetmend] {self._pool.key}: {node} (machine {machine}) {gate.reason}. It stays "
                f"cordoned and tainted ({QUARANTINE_TAINT_KEY}); follow-up: {result.follow_up}",
            )
            return
        if health.node is None or health.node.ready is not True or health.telemetry is None:
            proc.decide(f"{node} is not reachable: qualification runs when it is back; it stays quarantined")
            return
        assert machine is not None and health.uid is not None
        if health.gpu_capacity < 1 and health.dra_devices:
            # A DRA node advertises no device-plugin GPUs: the whole-node Job cannot ask for them.
            text = (
                f"{node} publishes its GPUs through DRA ({len(health.dra_devices)} in its ResourceSlice), not the "
                "device plugin: a whole-node qualification Job is not automated there; it stays quarantined "
                f"for an operator (follow-up: {result.follow_up})"
            )
            proc.decide(text)
            await proc.notify(f"dra-node-qualification-{node}", f"[fleetmend] {self._pool.key}: {text}")
            return
        await self._qualify(
            node, machine, health.uid, health.gpu_capacity, result.fault_class.value, result.follow_up
        )

    async def _report(self, report: NodeTriaged) -> None:
        if self._hooks is not None:
            await self._hooks.triaged(report)

    async def stage(self, phase: Phase, details: str) -> None:
        if self._hooks is not None:
            await self._hooks.stage(phase, details)

    async def _release(self, node: str) -> None:
        if node in self._quarantined:
            self._quarantined.remove(node)
        if self._hooks is not None:
            await self._hooks.released(node)

    async def quarantine(self, node: str, machine: str | None, fault_class: str, *, step: str) -> None:
        """Cordon + label + taint, recorded with the machine (the ledger's history is keyed on it)."""
        proc = self._proc
        await proc.act(
            ActActivities.cordon_node,
            NodeCordon(
                step=step,
                node=node,
                machine=machine,
                labels={QUARANTINE_LABEL: fault_class},
                annotations={
                    FAULT_CLASS_ANNOTATION: fault_class,
                    REMEDIATED_AT_ANNOTATION: f"{proc.now():.0f}",
                    MACHINE_ANNOTATION: machine,
                },
            ),
            f"quarantine {node}: cordon + label ({fault_class}, machine {machine})",
        )
        await proc.act(
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
        proc, timings = self._proc, self._timings
        for attempt in range(timings.qualification_attempts):
            await self.stage(
                Phase.QUALIFYING, f"Qualifying **{node}**: DCGM diagnostics, attempt {attempt + 1}"
            )
            if workflow.patched("qualification-slots") and not await self.await_slot(node):
                return
            created = await proc.act(
                QualificationActivities.create_qualification_job,
                QualificationJobRequest(step=f"qualify-{attempt}", node=node, machine=machine, gpus=gpus),
                f"qualification Job on {node} (DCGM diagnostics, all its GPUs), attempt {attempt + 1}",
            )
            if created.state != "applied":
                proc.decide(f"{node}: no qualification Job ({created.state}); it stays quarantined")
                return
            name = str((created.result or {}).get("name"))
            proc.decide(
                f"qualification Job {name} created on {node}; it returns to the pool only if it passes"
            )
            verdict = await self.await_job(name, node, machine)
            await proc.act(
                QualificationActivities.delete_qualification_job,
                QualificationJobRef(step=f"qualify-{attempt}-delete", name=name, node=node),
                f"delete qualification Job {name}",
            )
            proc.figure(
                "qualification", {"node": node, "attempt": attempt + 1, **verdict.model_dump(mode="json")}
            )
            if verdict.state == QualificationState.PASSED:
                await proc.act(
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
                await self._release(node)
                proc.decide(
                    f"{node} passed qualification ({verdict.detail}); uncordoned, untainted, returned"
                )
                return
            proc.decide(
                f"{node} failed qualification ({verdict.detail}): it stays out for the {fault_class} follow-up",
                {"failures": list(verdict.failures)},
            )
            await proc.notify(
                f"qualification-failed-{node}-{attempt}",
                f"[fleetmend] {self._pool.key}: {node} failed qualification: {verdict.detail}. It stays "
                f"quarantined; follow-up: {follow_up}",
            )
            if attempt + 1 >= timings.qualification_attempts:
                return
            current = await self._await_repair(node, machine, uid, fault_class)
            if current is None:
                return
            uid = current

    async def await_slot(self, node: str) -> bool:
        """Bounded remediation, fleet-wide: wait, queued and visibly, until fewer qualification Jobs run
        than the cap (``fleet.qualification.qualification_slot``). A slot is freed by a Job ending, so
        two Job lifetimes bound the wait; False: still queued then, and the node stays quarantined
        until an operator acts."""
        proc, timings = self._proc, self._timings

        async def look() -> QualificationSlots:
            slots: QualificationSlots = await proc.observe(
                QualificationActivities.qualification_slots,
                node,
                f"qualification Jobs running fleet-wide ({node})",
            )
            return slots

        wait_s = 2 * timings.qualification_timeout_s
        return await proc.await_slot(
            look,
            lambda slots: qualification_slot(node, slots),
            queued=lambda: self.stage(
                Phase.QUALIFYING, f"Queued for qualification: **{node}** waits for a slot"
            ),
            interval_s=max(timings.poll_interval_s, 1.0),
            wait_s=wait_s,
            summary=f"wait for a qualification slot for {node}",
            still_queued=f"still queued after {wait_s:.0f} s: it stays quarantined until an operator acts",
        )

    async def await_job(self, name: str, node: str, machine: str) -> Verdict:
        proc, timeout_s = self._proc, self._timings.qualification_timeout_s
        reading, done = await proc.poll(
            lambda: proc.observe(
                QualificationActivities.read_qualification_job,
                QualificationRead(name=name, node=node, machine=machine),
                f"qualification Job {name}",
            ),
            lambda r: r.verdict.state != QualificationState.RUNNING,
            interval_s=max(self._timings.poll_interval_s, 1.0),
            deadline=proc.now() + timeout_s,
            summary=f"qualification of {node}",
        )
        if done:
            return reading.verdict
        return reading.verdict.model_copy(
            update={
                "state": QualificationState.FAILED,
                "detail": f"no verdict after {timeout_s:.0f} s: {reading.verdict.detail}",
            }
        )

    async def _await_repair(self, node: str, machine: str, uid: str, fault_class: str) -> str | None:
        """Watch for the follow-up's repair (no Xid, every GPU offered, node free) of *this machine*.

        Returns the node object's uid to qualify (a re-created object of the same machine is
        quarantined again first), or None: no repair in time, or the name now holds another machine.
        The looks back off (``repair_look_cap``): a watch of any length takes at most
        ``repair_looks_max(repair_wait_s, interval)`` looks, about 46 (500 history events) for a day.
        """
        proc = self._proc
        wait_s = self._timings.repair_wait_s
        if wait_s <= 0:
            return None
        interval_s = max(self._timings.poll_interval_s, 1.0)
        deadline = proc.now() + wait_s
        proc.decide(f"watching {node} for a repair for up to {wait_s:.0f} s before qualifying it again")
        await self.stage(Phase.AWAITING_REPAIR, f"Watching **{node}** for a repair (up to {wait_s:.0f} s)")
        watch = _RepairWatch(uid=uid)

        async def look() -> bool:
            """One look at the machine; True when the watch is over (``watch.outcome`` says how)."""
            health = await proc.observe(ObserveActivities.read_node_health, node, f"repair of {node}?")
            seen = identity(machine, watch.uid, health.machine, health.uid)
            if seen is Identity.GONE:
                if not watch.gone_seen:
                    proc.decide(
                        f"{node} has no node object now; machine {machine} stays quarantined (ledger)"
                    )
                watch.gone_seen, watch.last = True, "no node object"
                return False
            if seen is Identity.REPLACED:
                await self._release(node)  # the quarantined machine left; verification checks names
                proc.decide(
                    f"{node} is now machine {health.machine}, not the quarantined {machine}: a new machine, "
                    "neither quarantined nor qualified on the old one's behalf; the old machine's quarantine "
                    "stays on record"
                )
                watch.outcome = None
                return True
            if seen is Identity.RECREATED:
                assert health.uid is not None
                await self.quarantine(node, machine, fault_class, step=f"quarantine-{health.uid[:8]}")
                proc.decide(
                    f"{node} was re-created (uid {health.uid}) for the same machine {machine}: still "
                    "quarantined, cordoned and tainted again"
                )
                watch.uid = health.uid
                watch.last = f"re-created as uid {health.uid}, quarantined again"
                return False
            xids = {g.gpu: g.last_xid or 0 for g in health.telemetry.gpus} if health.telemetry else {"?": 1}
            if not repaired(health.conditions, xids, health.gpu_capacity, health.gpu_allocatable):
                watch.last = (
                    f"GPU problem still shown ({health.gpu_allocatable}/{health.gpu_capacity} GPUs offered, "
                    f"Xid {max(xids.values(), default=0)})"
                )
                return False
            if health.gpu_holders:
                watch.last = await self._clear_for_qualification(node, health.gpu_holders, watch.told)
                return False
            proc.decide(
                f"{node} looks repaired (no Xid, {health.gpu_allocatable}/{health.gpu_capacity} GPUs "
                "offered, no pods): qualifying again"
            )
            watch.outcome = watch.uid
            return True

        # The watch starts with an interval: the follow-up needs a moment after the failed qualification.
        await workflow.sleep(interval_s, summary=f"wait for the repair of {node}")
        # patched: a watch that started polling at a fixed interval replays as it ran.
        bounded = workflow.patched("repair-watch-backs-off")
        _, over = await proc.poll(
            look,
            lambda ended: ended,
            interval_s=interval_s,
            deadline=deadline,
            summary=f"wait for the repair of {node}",
            backoff_to_s=repair_look_cap(wait_s, interval_s) if bounded else None,
        )
        if over:
            return watch.outcome
        proc.decide(
            f"no repair of {node} seen within {wait_s:.0f} s (last seen: {watch.last}): it stays quarantined "
            "until an operator acts"
        )
        return None

    async def _clear_for_qualification(self, node: str, holders: list[GpuHolder], told: set[str]) -> str:
        """A repaired machine still holding pods (a warm spare left on it, or one placed while a
        re-created node object was not yet quarantined): qualification needs every GPU. Warm spares
        are deleted gracefully (a spare on quarantined hardware is no spare; cordoned, the node gets
        none back); anything else only an operator moves. Returns what still holds the machine."""
        proc = self._proc
        clearing = clear_for_qualification(holders)
        spares = [h for h in clearing.delete if h.pod not in told]  # still terminating: asked already
        for held in spares:
            await proc.act(
                ActActivities.delete_pod,
                PodDeletion(step=f"clear-{node}", namespace=held.namespace, pod=held.pod, grace_period_s=5),
                f"delete warm spare {held.pod} on quarantined {node}: qualification needs all its GPUs",
            )
            told.add(held.pod)
        if spares:
            proc.decide(
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
            proc.decide(text)
            await proc.notify(f"occupied-{node}-{len(told)}", f"[fleetmend] {self._pool.key}: {text}")
        return "pods hold its GPUs: " + ", ".join(f"{h.pod} ({h.gpus})" for h in holders)


# The repair watch's looks at their cap: a repair is seen within 1/REPAIR_LOOKS_AT_CAP of the wait
# (45 min of a day's wait, 4 min of two hours).
REPAIR_LOOKS_AT_CAP = 32


def repair_look_cap(wait_s: float, interval_s: float) -> float:
    """The repair watch's longest interval: its looks double from ``interval_s`` up to this."""
    return max(interval_s, wait_s / REPAIR_LOOKS_AT_CAP)


def repair_looks_max(wait_s: float, interval_s: float) -> int:
    """The most looks a repair watch of ``wait_s`` takes (the bound the history keeps under)."""
    cap = repair_look_cap(wait_s, interval_s)
    return math.ceil(math.log2(cap / interval_s)) + REPAIR_LOOKS_AT_CAP + 2


class _RepairWatch:
    """What the repair watch carries from one look to the next."""

    def __init__(self, uid: str) -> None:
        self.uid = uid
        self.gone_seen = False
        self.last = "no reading yet"
        self.told: set[str] = set()
        self.outcome: str | None = None


@workflow.defn(name="NodeQualification")
class NodeQualification(Procedure):
    """A failed node's hardware path as its own workflow (``<recovery id>/node/<node>``)."""

    @workflow.init
    def __init__(self, inp: NodeQualificationInput) -> None:
        timings, figures = inp.timings, {"node": inp.node, "recovery": inp.recovery_id}
        status = ProcedureStatus(
            workflow=workflow.info().workflow_id, pool=inp.pool, phase=Phase.TRIAGING, figures=figures
        )
        status.dry_run = inp.dry_run
        super().__init__(
            status, budget=timings.retry, dry_run=inp.dry_run, operator_wait_s=timings.approval_timeout_s
        )
        self._inp = inp
        self._quarantined: list[str] = []

    @property
    def scope(self) -> str:
        """The recovery's scope: the node's effects are the incident's (unique per incident, as inline)."""
        return self._inp.scope

    async def notify(self, topic: str, text: str) -> None:
        # The recovery posts under the same scope: this node's topics carry its name.
        await super().notify(f"{self._inp.node}-{topic}", text)

    @workflow.run
    async def run(self, inp: NodeQualificationInput) -> ProcedureStatus:
        self.begin("node-qualification", inp.pool)
        try:
            await self.stage(Phase.TRIAGING, f"Triaging **{inp.node}** for recovery {inp.recovery_id}")
            await NodeLifecycle(self, inp.pool, inp.timings, self._quarantined, hooks=self).run(
                inp.node, inp.hint
            )
            self.figure("quarantined", list(self._quarantined))
            return self.finish(Phase.DONE)
        except Aborted:
            return self.finish(Phase.ABORTED)

    async def triaged(self, report: NodeTriaged) -> None:
        await self._tell_recovery("node_triaged", report)

    async def released(self, node: str) -> None:
        await self._tell_recovery("node_released", node)

    async def stage(self, phase: Phase, details: str) -> None:
        await self.enter(phase, details)

    async def _tell_recovery(self, signal: str, arg: Any) -> None:
        """The recovery may have ended (it does not wait for qualification): then nobody needs telling."""
        try:
            await workflow.get_external_workflow_handle(self._inp.recovery_id).signal(signal, arg)
        except FailureError as err:
            self.decide(f"recovery {self._inp.recovery_id} not told {signal} ({err}): it has ended")


def child_id(recovery_id: str, node: str) -> str:
    """A node's qualification workflow id: under its recovery's (unique per incident)."""
    return f"{recovery_id}/node/{node}"


class NodeWorkflows:
    """The recovery's side of its nodes' workflows: start one per failed node, take their reports, and
    wait for every triage report (the quarantine in place) - never for a qualification or a repair."""

    def __init__(
        self, proc: Procedure, inp: RecoveryInput, state: RecoveryState, aborted: Callable[[], bool]
    ) -> None:
        self._proc = proc
        self._aborted = aborted
        # Every node's workflow gets the recovery's timings and operation-id scope; node and hint per node.
        self._template = NodeQualificationInput(
            pool=inp.pool,
            node="",
            timings=inp.timings,
            dry_run=inp.dry_run,
            recovery_id=workflow.info().workflow_id,
            scope=proc.scope,
        )
        self._state = state
        self._handles: dict[str, ChildWorkflowHandle[NodeQualification, ProcedureStatus]] = {}

    async def fence(self, obs: PoolObservation, lost: list[ReplicaGroup], look: Look) -> None:
        """Step 6: cordon nodes that failed (not Ready, or a GPU/fabric fault) before anything is scheduled.

        Until the node controller marks a silent node unreachable, the scheduler may
        still bind a replacement to it; cordoning first keeps replacements off it.
        Triage adds the taint and label later.

        A dead machine's pods still read Running and ready for the node-monitor grace: when a lost
        pod's engine is silent and Kubernetes shows no death, the node is judged on an observation
        taken once a live kubelet would have reported a crashed container (``kubelet_report_s``
        after the loss was confirmed), so an OOM-killed engine does not fence its node.
        """
        st, proc = self._state, self._proc
        failed = failed_nodes(lost, obs.snapshot, st.reports)
        maybe_silent = set(silent_nodes(lost, obs.pods)) - set(failed)
        # patched: a recovery that was already past this point when the worker was upgraded replays
        # as it ran (no extra look), and only new passes take it.
        if maybe_silent and workflow.patched("fence-silent-nodes"):
            wait = st.confirmed_at + self._template.timings.kubelet_report_s - proc.now()
            if wait > 0:
                await workflow.sleep(wait, summary="fence: give a live kubelet time to report a crash")
            obs = with_lost(await look(f"fence: did {', '.join(sorted(maybe_silent))} go silent?"), lost)
            failed = failed_nodes(lost, obs.snapshot, st.reports, silent_nodes(lost, obs.pods))
        st.failed_nodes = failed
        for node, why in failed.items():
            info = obs.snapshot.node(node)
            if info is not None and info.unschedulable:
                proc.decide(
                    f"{node} already cordoned ({why}): fenced at detection (NodeFence) or by an operator"
                )
                continue
            if info is not None and info.ready is True and workflow.patched("recovery-fence-device-scope"):
                hint = next((r.fault_hint for r in st.reports if r.fault_hint), None)
                scope = await device_scope(proc, node, self._template.timings, "fence", hint)
                if scope is not None and scope.spares_node:
                    continue
            await proc.act(
                ActActivities.cordon_node,
                NodeCordon(step="fence", node=node),
                f"cordon failed node {node} so no replacement lands on it",
            )
            proc.decide(f"cordoned {node} ({why}): replacements must not land on the failed node")

    async def triage(self, obs: PoolObservation, lost: list[ReplicaGroup]) -> None:
        """Step 8: each failed node's hardware path runs as its own ``NodeQualification`` workflow; the
        recovery waits for each one's triage report (the quarantine in place), not for its qualification."""
        st, proc = self._state, self._proc
        hint = next((r.fault_hint for r in st.reports if r.fault_hint), None)
        failed = {**failed_nodes(lost, obs.snapshot, st.reports), **st.failed_nodes}
        scope = nodes_to_triage(lost, failed, hint)
        for node in scope.kept:
            proc.decide(
                f"{node} is Ready and no report is about it: the loss is a pod-level fault, "
                "the node stays in service (no quarantine)"
            )
        if not workflow.patched("node-qualification-child"):
            # A recovery started before the child workflow existed replays its hardware path inline.
            for node in scope.triage:
                await NodeLifecycle(proc, self._template.pool, self._template.timings, st.quarantined).run(
                    node, hint
                )
            return
        await self.start(scope.triage, hint)
        await self.await_triage()

    async def start(self, nodes: Iterable[str], hint: str | None) -> None:
        recovery = self._template.recovery_id
        for node in nodes:
            handle = await workflow.start_child_workflow(
                NodeQualification.run,
                self._template.model_copy(update={"node": node, "hint": hint}),
                id=child_id(recovery, node),
                task_queue=workflow.info().task_queue,
                # Qualification and the repair watch may outlast the recovery by hours.
                parent_close_policy=ParentClosePolicy.ABANDON,
                # Its search attributes (kind, pool, phase) are set by its first task (``begin``).
                static_summary=f"Hardware path of {node}: triage, quarantine, qualification ({recovery})",
            )
            self._handles[node] = handle
            self._state.node_workflows[node] = handle.id
            self._proc.decide(f"{node}: triage, quarantine and qualification run in workflow {handle.id}")
        self._proc.figure("node_workflows", dict(self._state.node_workflows))

    async def await_triage(self) -> None:
        """Until every node's workflow reported its triage (or ended without: that is said); an abort
        of the recovery ends the wait."""
        st = self._state
        await workflow.wait_condition(
            lambda: self._aborted() or all(n in st.triaged or h.done() for n, h in self._handles.items())
        )
        await self._proc.checkpoint()
        for node, handle in self._handles.items():
            if node in st.triaged:
                continue
            try:
                ended = (await handle).phase.value
            except ChildWorkflowError as err:
                ended = f"failed ({err.cause or err})"
            self._proc.decide(f"{node}: its workflow {handle.id} ended ({ended}) before reporting its triage")

    def triaged(self, report: NodeTriaged) -> None:
        """A node's triage report: the recovery's record says what was found; verification checks the quarantine."""
        st, proc = self._state, self._proc
        proc.decide(report.summary, {**report.figures, "workflow": report.workflow_id})
        proc.figure("fault_class", report.fault_class)
        if report.quarantined and report.node not in st.quarantined:
            st.quarantined.append(report.node)
        if report.needs_operator:
            proc.figure("needs_operator", report.needs_operator)
            proc.decide(
                f"{report.needs_operator}; it stays quarantined ({report.workflow_id} asks an operator)"
            )
        st.triaged.append(report.node)

    def released(self, node: str) -> None:
        """The node's workflow returned it, or its name now holds another machine: no longer quarantined."""
        if node in self._state.quarantined:
            self._state.quarantined.remove(node)
            self._proc.decide(
                f"{node} left quarantine ({self._state.node_workflows.get(node, 'its workflow')})"
            )
