"""Driving a replica-loss recovery end to end against the simulated fleet, as an SRE would check it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy import create_engine
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from fleet.incident import LossReport, PoolRef
from fleet.recovery import IncidentInput, Phase, ProcedureStatus, RecoveryTimings, ServingObjectives
from ledger.reconcile import reconcile, world_actions_from_sim
from worker.devstack.rig import FleetRig

POOL = PoolRef(namespace="inference", service="llama")
# ~400 tokens/s per replica in the compressed scenarios: about 15 requests/s of 8-32 tokens.
GROUP_CAPACITY_RPS = 15.0

FAST = RecoveryTimings(
    correlation_window_s=5,
    poll_interval_s=0.5,
    deroute_timeout_s=10,
    replacement_timeout_s=60,
    ramp_interval_s=2,
    ramp_max_s=60,
    verify_timeout_s=60,
    approval_timeout_s=120,
    cooldown_s=1,
    qualification_timeout_s=20,
)


def incident_config(pool: PoolRef = POOL, *, dry_run: bool = False, **objectives: Any) -> IncidentInput:
    return IncidentInput(
        pool=pool,
        dry_run=dry_run,
        timings=FAST,
        objectives=ServingObjectives(group_capacity_rps=GROUP_CAPACITY_RPS, **objectives),
    )


def node_report(node: str, fingerprint: str = "fp-node", pool: PoolRef = POOL) -> LossReport:
    return LossReport(pool=pool, fingerprint=fingerprint, alert_name="KubeNodeNotReady", node=node)


def pod_report(
    pod: str, fingerprint: str, alert: str = "FleetmendEndpointUnroutable", pool: PoolRef = POOL
) -> LossReport:
    return LossReport(pool=pool, fingerprint=fingerprint, alert_name=alert, pod=pod)


async def wait_for_child(
    client: Client, incident: WorkflowHandle[Any, Any], timeout_s: float = 30
) -> WorkflowHandle[Any, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await incident.query("status", result_type=ProcedureStatus)
        if status.children:
            handle = client.get_workflow_handle(status.children[-1])
            try:
                await handle.describe()  # the incident names its child just before starting it
                return handle
            except RPCError:
                pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"no recovery started within {timeout_s} s")


async def child_status(handle: WorkflowHandle[Any, Any]) -> ProcedureStatus:
    return await handle.query("status", result_type=ProcedureStatus)


async def wait_for_phase(
    handle: WorkflowHandle[Any, Any], phase: Phase, timeout_s: float = 60
) -> ProcedureStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await child_status(handle)
        if status.phase == phase:
            return status
        await asyncio.sleep(0.25)
    raise AssertionError(f"phase {phase.value} not reached within {timeout_s} s (now {status.phase.value})")


async def finish(handle: WorkflowHandle[Any, Any], timeout_s: float = 150) -> ProcedureStatus:
    """The recovery's final status (its result), failing the test with its decisions if it failed."""
    try:
        result = await asyncio.wait_for(handle.result(), timeout_s)
        return result if isinstance(result, ProcedureStatus) else ProcedureStatus.model_validate(result)
    except Exception as exc:
        status = await child_status(handle)
        lines = "\n".join(f"  [{d.phase.value}] {d.summary}" for d in status.decisions)
        desc = await handle.describe()
        pending = [
            f"{a.activity_type.name} attempt {a.attempt}: {a.last_failure.message if a.HasField('last_failure') else ''}"
            for a in desc.raw_description.pending_activities
        ]
        raise AssertionError(f"recovery did not complete: {exc!r}\n{lines}\npending: {pending}") from exc


def decisions(status: ProcedureStatus) -> str:
    return "\n".join(d.summary for d in status.decisions)


async def fleetmend_actions(rig: FleetRig) -> list[dict[str, Any]]:
    """The mutating requests fleetmend's worker made, from the world's own log."""
    return [a for a in await rig.actions() if "fleetmend-worker" in a["client"]]


async def reconcile_with_world(rig: FleetRig, database_url: str) -> Any:
    """The ledger reconciled against the simulator's own log of fleetmend's requests."""
    world = rig.base_url.split("://", 1)[1]
    engine = create_engine(database_url)
    try:
        return reconcile(
            engine, world=world, actions=world_actions_from_sim(world, await fleetmend_actions(rig))
        )
    finally:
        engine.dispose()
