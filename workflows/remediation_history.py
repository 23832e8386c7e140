"""A machine's remediation history and the loop cap's gate on it, read the same way by the node's
hardware path and by the fences' scope check (``workflows.device_quarantine.device_scope``)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.qualification import MachineQuery, QualificationActivities
    from fleet.qualification import RemediationGate, RemediationRecord, remediation_gate
    from fleet.recovery import RecoveryTimings
    from workflows.procedure import Procedure


async def machine_gate(
    proc: Procedure, machine: str | None, timings: RecoveryTimings
) -> tuple[list[RemediationRecord], RemediationGate]:
    """The machine's remediations in the ledger and whether the loop cap allows another (a node no
    machine identity is known for has no history: allowed)."""
    history = (
        await proc.observe(
            QualificationActivities.machine_history,
            MachineQuery(machine=machine),
            f"remediation history of machine {machine}",
        )
        if machine
        else []
    )
    gate = remediation_gate(
        history,
        proc.now(),
        cap=timings.remediation_cap,
        window_s=timings.repeat_fault_window_s,
        current_workflow=workflow.info().workflow_id,
    )
    return history, gate
