"""One failed GPU's way out and back (``fleet.device_fault``): the device path of a node's hardware path.

A fault that belongs to one GPU fences that GPU, not the node: the node stays schedulable, its
other replicas keep serving and are never moved. ``DeviceLifecycle.run`` reads as the runbook:

1. **record** the quarantine on the node, keyed on the GPU's UUID (the ledger row carries the machine);
2. **fence** it: on a DRA cluster a DeviceTaintRule names that one device (``None`` in a dry run,
   with the rule's report of what NoExecute would evict; ``NoExecute`` while a pod still holds it;
   else ``NoSchedule``). On a device-plugin cluster the plugin's own health already withholds it
   (allocatable drops, the scheduler cannot place on it) and the record is the fence;
3. **qualify** that device: on DRA, a Job whose ResourceClaim selects the GPU by UUID runs
   ``dcgmi diag -r <level> -i <index>``. A device-plugin cluster cannot give a Job one chosen GPU
   while the rest of the node serves, so the device stays fenced and the incident says so: it is
   qualified with the node at its next drain, or by an operator;
4. a **pass** deletes the rule and closes the record: the device serves again. A **fail** keeps it
   out, posts the DCGM output, and (``repair_wait_s`` > 0) watches the GPU for a repair before the
   next attempt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.device_quarantine import (
        DeviceActivities,
        DeviceClaimRef,
        DeviceQualificationRequest,
        DeviceRecord,
        DeviceTaintRef,
        DeviceTaintRequest,
    )
    from activities.observe import NodeHealth, ObserveActivities
    from activities.qualification import QualificationActivities, QualificationJobRef
    from fleet.device_fault import (
        DraDevice,
        FaultedDevice,
        ScopeDecision,
        device_for,
        device_policy,
        fenceable,
        hardware_evidence,
        holders_of,
        judge_node,
    )
    from fleet.device_taint import rule_report, taint_effect
    from fleet.incident import PoolRef
    from fleet.qualification import QualificationState
    from fleet.recovery import Phase, RecoveryTimings
    from fleet.runbook import pod_faults
    from fleet.triage import TriageResult
    from workflows.procedure import Procedure
    from workflows.remediation_history import machine_gate

if TYPE_CHECKING:
    from workflows.node_qualification import NodeLifecycle


async def device_scope(
    proc: Procedure, node: str, timings: RecoveryTimings, step: str, hint: str | None = None
) -> ScopeDecision | None:
    """Before a fence cordons a Ready node for a GPU fault: is the fault one GPU's (or only GPUs already
    fenced)? Read the node's DCGM series, conditions and DRA slice and decide (``fleet.device_fault``);
    the decision is recorded. ``spares_node``: do not cordon (the node's hardware path fences the
    device). None: the policy is node-level."""
    if not timings.device_quarantine:
        return None
    health = await proc.observe(
        ObserveActivities.read_node_health, node, f"{step}: read DCGM and conditions of {node}"
    )
    # A machine at the loop cap takes the node path at once (its hardware path would cordon it anyway).
    # Behind a patch: a fence or recovery that read the node before this looks it up replays without it.
    history_allows = True
    if workflow.patched("device-scope-loop-cap"):
        _, gate = await machine_gate(proc, health.machine, timings)
        history_allows = gate.allowed
    _, scope = judge_node(
        node,
        proc.now(),
        telemetry=health.telemetry,
        conditions=health.conditions,
        ready=health.node.ready if health.node else None,
        annotations=health.annotations,
        policy=device_policy(timings),
        pods=pod_faults(health.pod_reasons),
        hint=hint,
        history_allows=history_allows,
    )
    scope = fenceable(scope, health.dra_devices)
    proc.decide(scope.reason, {"scope": scope.model_dump(mode="json")})
    if scope.spares_node:
        proc.figure("fault_scope", scope.scope.value)
        proc.decide(f"{node} is not cordoned: no fault reaches past one GPU, its other GPUs keep serving")
    return scope


class DeviceLifecycle:
    """The device path, acting through the node lifecycle's procedure toolkit."""

    def __init__(
        self, node_path: NodeLifecycle, proc: Procedure, pool: PoolRef, timings: RecoveryTimings
    ) -> None:
        self._node_path, self._proc, self._pool, self._timings = node_path, proc, pool, timings

    async def run(self, node: str, health: NodeHealth, triage: TriageResult, device: FaultedDevice) -> bool:
        """Fence ``device`` and qualify it; True when it passed and serves again."""
        proc, machine = self._proc, health.machine or f"node:{node}"
        proc.figure("fault_scope", "device")
        proc.figure("device", device.model_dump(mode="json"))
        # 1. Record the quarantine, keyed on the machine and the GPU's UUID.
        await proc.act(
            DeviceActivities.record_device_quarantine,
            DeviceRecord(
                step="quarantine-device",
                node=node,
                machine=machine,
                device=device,
                fault_class=triage.fault_class.value,
                at=proc.now(),
            ),
            f"quarantine GPU {device.index} ({device.uuid}) of {node}: the node stays schedulable",
        )
        # 2. Fence it.
        dra = device_for(health.dra_devices, device) if health.dra_devices else None
        ids = {device.uuid} | ({dra.resource_id} if dra else set())
        users = holders_of(((h.pod, h.devices) for h in health.gpu_holders), ids)
        others = sorted(h.pod for h in health.gpu_holders if h.pod not in users)
        proc.figure("device_users", users)
        proc.decide(
            f"{node}: only GPU {device.index} is out; "
            + (
                f"{', '.join(others)} keep(s) serving on the node, never moved"
                if others
                else "no other pod holds a GPU there"
            ),
            {"users": users, "others": others},
        )
        if dra is None:  # no ResourceSlice: the device plugin (fleet.device_fault.fenceable saw to DRA)
            proc.decide(
                f"{node} runs the device plugin: its health check withholds GPU {device.index} "
                f"({health.gpu_allocatable}/{health.gpu_capacity} GPUs offered), so nothing is placed on it"
            )
            await self._device_plugin_stays(node, device)
            return False
        await self._fence(node, machine, device, dra, triage.fault_class.value, users)
        if proc.dry_run:
            return False
        # 3-4. Qualify that one device.
        return await self._qualify(node, machine, device, dra)

    async def _fence(
        self,
        node: str,
        machine: str,
        device: FaultedDevice,
        dra: DraDevice,
        fault_class: str,
        users: list[str],
    ) -> None:
        proc = self._proc
        effect = taint_effect(proc.dry_run, users)
        why = {
            "None": "a dry run: the rule reports what NoExecute would evict and changes nothing",
            "NoExecute": f"{', '.join(users)} still hold(s) it: a replica on a dead GPU serves nothing",
            "NoSchedule": "nothing holds it now: no new claim gets it",
        }[effect]
        await proc.act(
            DeviceActivities.create_device_taint_rule,
            DeviceTaintRequest(
                step="taint-device",
                node=node,
                machine=machine,
                device=device,
                dra=dra,
                fault_class=fault_class,
                effect=effect,
            ),
            f"DeviceTaintRule on {dra.driver}/{dra.pool}/{dra.name} ({effect}): {why}",
            report_only=effect == "None",
        )
        proc.figure("device_taint", {"device": dra.resource_id, "effect": effect})
        if effect != "None":
            return
        ref = DeviceTaintRef(step="read", node=node, uuid=device.uuid)

        async def look() -> str | None:
            rule = await proc.observe(
                DeviceActivities.read_device_taint_rule, ref, "the DeviceTaintRule's report"
            )
            return rule_report(rule)

        report, _ = await proc.poll(
            look,
            lambda r: r is not None,
            interval_s=max(self._timings.poll_interval_s, 0.5),
            deadline=proc.now() + 60,
            summary="wait for the DeviceTaintRule's report",
        )
        proc.figure("would_evict", report)
        proc.decide(
            f"dry run: with NoExecute, the rule on {dra.resource_id} would: {report or 'report nothing yet'}"
        )
        # Its report read, the dry run's rule goes: a later real run creates its own.
        await proc.act(
            DeviceActivities.delete_device_taint_rule,
            DeviceTaintRef(step="untaint-dry-run", node=node, uuid=device.uuid),
            f"delete the dry run's DeviceTaintRule on {dra.resource_id} (effect None)",
            report_only=True,
        )

    async def _device_plugin_stays(self, node: str, device: FaultedDevice) -> None:
        text = (
            f"{node}: GPU {device.index} ({device.uuid}) stays fenced (device plugin health + quarantine record "
            f"gpu-quarantine.fleetmend.io/{device.uuid}); a device plugin cannot hand a Job that one GPU while "
            "the node serves, so it is qualified with the node at its next drain, or by an operator"
        )
        self._proc.decide(text)
        await self._proc.notify(
            f"device-fenced-{node}-{device.index}", f"[fleetmend] {self._pool.key}: {text}"
        )

    async def _qualify(self, node: str, machine: str, device: FaultedDevice, dra: DraDevice) -> bool:
        proc, timings = self._proc, self._timings
        for attempt in range(timings.qualification_attempts):
            await self._node_path.stage(
                Phase.QUALIFYING,
                f"Qualifying GPU {device.index} of **{node}** ({device.uuid}), attempt {attempt + 1}",
            )
            if not await self._node_path.await_slot(node):  # the fleet-wide cap on qualification Jobs
                return False
            created = await proc.act(
                DeviceActivities.create_device_qualification,
                DeviceQualificationRequest(
                    step=f"qualify-gpu-{attempt}",
                    node=node,
                    machine=machine,
                    device=device,
                    dra=dra,
                    attempt=attempt,
                ),
                f"qualification Job for GPU {device.index} of {node}: a claim on {device.uuid}, dcgmi diag -i {device.index}",
            )
            if created.state != "applied":
                proc.decide(
                    f"{node}: no qualification Job for GPU {device.index} ({created.state}); it stays fenced"
                )
                return False
            name, claim = str((created.result or {}).get("name")), str((created.result or {}).get("claim"))
            verdict = await self._node_path.await_job(name, node, machine)
            claimed = await proc.observe(
                DeviceActivities.read_device_claim, claim, f"the devices claim {claim} got"
            )
            proc.figure("claimed", claimed)
            # (A claim no pod reserves any more may be deallocated already: only a wrong device fails it.)
            if claimed and [(r.get("pool"), r.get("device")) for r in claimed] != [(dra.pool, dra.name)]:
                verdict = verdict.model_copy(
                    update={
                        "state": QualificationState.FAILED,
                        "detail": f"the claim was allocated {claimed}, not {dra.resource_id}: the result does "
                        f"not qualify GPU {device.index}",
                    }
                )
            await proc.act(
                QualificationActivities.delete_qualification_job,
                QualificationJobRef(step=f"qualify-gpu-{attempt}-delete", name=name, node=node),
                f"delete qualification Job {name}",
            )
            await proc.act(
                DeviceActivities.delete_device_claim,
                DeviceClaimRef(step=f"qualify-gpu-{attempt}-unclaim", name=claim),
                f"delete the qualification's ResourceClaim {claim}",
            )
            proc.figure(
                "qualification",
                {
                    "node": node,
                    "gpu": device.index,
                    "attempt": attempt + 1,
                    **verdict.model_dump(mode="json"),
                },
            )
            if verdict.state == QualificationState.PASSED:
                await self._lift(node, machine, device)
                proc.decide(
                    f"GPU {device.index} of {node} passed qualification ({verdict.detail}): untainted, serves again"
                )
                return True
            text = (
                f"GPU {device.index} of {node} ({device.uuid}) failed qualification: {verdict.detail}. "
                "It stays fenced (DeviceTaintRule kept)"
            )
            proc.decide(text, {"failures": list(verdict.failures)})
            await proc.notify(
                f"device-qualification-failed-{node}-{device.index}-{attempt}",
                f"[fleetmend] {self._pool.key}: {text}",
            )
            if attempt + 1 >= timings.qualification_attempts or not await self._await_repair(node, device):
                return False
        return False

    async def _lift(self, node: str, machine: str, device: FaultedDevice) -> None:
        proc = self._proc
        await proc.act(
            DeviceActivities.delete_device_taint_rule,
            DeviceTaintRef(step="untaint-device", node=node, uuid=device.uuid),
            f"delete the DeviceTaintRule on GPU {device.index} of {node}: it passed",
        )
        await proc.act(
            DeviceActivities.record_device_quarantine,
            DeviceRecord(
                step="release-device",
                node=node,
                machine=machine,
                device=device,
                fault_class="",
                at=proc.now(),
                release=True,
            ),
            f"close the quarantine record of GPU {device.index} ({device.uuid}) on {node}",
        )
        proc.figure("device_returned", device.uuid)

    async def _await_repair(self, node: str, device: FaultedDevice) -> bool:
        """Watch the GPU's own DCGM series for the follow-up's repair: none of the hardware evidence that
        fenced it (``fleet.device_fault.hardware_evidence``) is left."""
        proc, wait_s = self._proc, self._timings.repair_wait_s
        if wait_s <= 0:
            return False
        await self._node_path.stage(
            Phase.AWAITING_REPAIR, f"Watching GPU {device.index} of **{node}** for a repair"
        )

        async def look() -> bool:
            health = await proc.observe(
                ObserveActivities.read_node_health, node, f"repair of GPU {device.index} of {node}?"
            )
            gpu = next(
                (g for g in (health.telemetry.gpus if health.telemetry else ()) if g.uuid == device.uuid),
                None,
            )
            return gpu is not None and not hardware_evidence(gpu)

        _, repaired = await proc.poll(
            look,
            lambda ok: ok,
            interval_s=max(self._timings.poll_interval_s, 1.0),
            deadline=proc.now() + wait_s,
            summary=f"wait for the repair of GPU {device.index} of {node}",
        )
        if not repaired:
            proc.decide(f"no repair of GPU {device.index} of {node} within {wait_s:.0f} s: it stays fenced")
        return repaired
