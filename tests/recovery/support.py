"""What the hardware-path recoveries (``test_hardware_*.py``) share: their world and timings, and the
ledger rows of one procedure. Package-local support (see ``tests/support.py`` for the rule)."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import create_engine, text
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from fleet.incident import LossReport
from fleet.recovery import RecoveryTimings
from fleet.vocabulary import PROCEDURE_OPERATION_PREFIX, ROLE_LABEL, ROLE_SPARE, FaultKind
from tests.support import FAST, POOL, incident_config, wait_for_child
from worker.devstack.rig import FleetRig, compressed_scenario
from workflows.node_qualification import child_id

IDS = "workflow-ids.json"  # beside the recorded histories: file name -> the workflow's id
# Qualification Jobs take 2 s in this world; a failed one is followed by a repair watched for up to 60 s.
DEVICE_TIMINGS = FAST.model_copy(update={"qualification_timeout_s": 30, "repair_wait_s": 60})
# The node path, whatever the fault's scope: the node-level policy (``device_quarantine`` off), which the
# tests of a whole node's quarantine, qualification and repair watch run under.
NODE_LEVEL_TIMINGS = DEVICE_TIMINGS.model_copy(update={"device_quarantine": False})


def hardware_scenario() -> Any:
    """The compressed gpu-node-loss world with 2-second qualification Jobs."""
    scenario = compressed_scenario("gpu-node-loss")
    return scenario.model_copy(update={"load": {**(scenario.load or {}), "qualification_s": 2.0}})


def procedure_rows(url: str, scope: str) -> list[tuple[str, str, str, str]]:
    """``(op_id, kind, target, state)`` of every ledger effect of the procedure ``scope``, oldest first."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT op_id, kind, target, state FROM ledger_effects WHERE op_id LIKE :p ORDER BY created_at"
                ),
                {"p": f"{PROCEDURE_OPERATION_PREFIX}{scope}@%"},
            ).all()
        return [(r[0], r[1], r[2], r[3]) for r in rows]
    finally:
        engine.dispose()


async def node_workflow(
    client: Client, recovery: WorkflowHandle[Any, Any], node: str, timeout_s: float = 90
) -> WorkflowHandle[Any, Any]:
    """The node's own hardware-path workflow (``NodeQualification``) the recovery started, once it exists."""
    handle = client.get_workflow_handle(child_id(recovery.id, node))
    for _ in range(int(timeout_s / 0.3)):
        try:
            await handle.describe()
            return handle
        except RPCError:
            await asyncio.sleep(0.3)
    raise AssertionError(f"{recovery.id} started no workflow for {node} within {timeout_s} s")


async def fault_reported(
    rig: FleetRig,
    client: Client,
    kind: FaultKind,
    node: str,
    *,
    fingerprint: str,
    timings: RecoveryTimings,
    dry_run: bool = False,
    **fault: Any,
) -> WorkflowHandle[Any, Any]:
    """A hardware fault on ``node`` (``fault``: code, gpu, keep_alive, ...) reported as a pool loss the
    way the Xid alert reports it: the recovery that answers it, once started."""
    await rig.inject(kind, node, **fault)
    report = LossReport(pool=POOL, fingerprint=fingerprint, alert_name="FleetmendGpuXid", node=node)
    incident = await rig.report_loss(report, incident_config(dry_run=dry_run, timings=timings))
    return await wait_for_child(client, incident)


async def two_replica_node(rig: FleetRig) -> tuple[str, dict[str, Any]]:
    """A node holding two serving TP=4 replicas, and its pods by name."""
    pods = (await asyncio.to_thread(rig.core.list_namespaced_pod, POOL.namespace)).items
    by_node: dict[str, dict[str, Any]] = {}
    for p in pods:
        if (p.metadata.labels or {}).get(ROLE_LABEL) != ROLE_SPARE and p.spec.node_name:
            by_node.setdefault(p.spec.node_name, {})[p.metadata.name] = p
    node = next(n for n, on in sorted(by_node.items()) if len(on) == 2)
    return node, by_node[node]


def effects_on(rows: list[tuple[str, str, str, str]], *targets: str) -> list[tuple[str, str, str, str]]:
    return [r for r in rows if any(r[2] == t or r[2].startswith(t + "/") for t in targets)]
