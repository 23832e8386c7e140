"""Step 8 on real interfaces: triage from dcgm-exporter series and node conditions, quarantine keyed
on the machine, a DCGM qualification Job on that node only, the node back only after a pass, and
the remediation loop cap. Real Temporal, real Postgres, the simulated fleet and its API server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client as kc
from sqlalchemy import create_engine, text
from temporalio.client import Client, WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy

from fleet.breaker import (
    BreakerDecision,
    BreakerInput,
    BreakerStatus,
    RemovalRequest,
    breaker_workflow_id,
)
from fleet.incident import LossReport
from fleet.recovery import Phase
from fleet.vocabulary import (
    QUARANTINE_LABEL,
    QUARANTINE_TAINT_KEY,
    ROLE_LABEL,
    ROLE_SPARE,
    FaultKind,
)
from tests.recovery.support import NODE_LEVEL_TIMINGS, hardware_scenario, node_workflow, procedure_rows
from tests.support import POOL, decisions, finish, incident_config, load_reaches, wait_for_child
from worker.devstack.rig import FleetRig, fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _job_node(url: str, op_id: str) -> str:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return str(
                conn.execute(
                    text("SELECT params->>'node' FROM ledger_effects WHERE op_id = :o"), {"o": op_id}
                ).scalar()
            )
    finally:
        engine.dispose()


async def _follow_up_repairs(rig: FleetRig, node: str, seen_failure: asyncio.Event) -> None:
    """The GPU-fault follow-up, after fleetmend said the node failed: move the serving pods off the
    node, replace the GPU. The warm spare on it is left where it is: clearing that is fleetmend's job."""
    await seen_failure.wait()
    core = rig.core
    pods = await asyncio.to_thread(
        core.list_namespaced_pod, POOL.namespace, field_selector=f"spec.nodeName={node}"
    )
    for pod in pods.items:
        if (pod.metadata.labels or {}).get(ROLE_LABEL) == ROLE_SPARE:
            continue
        await asyncio.to_thread(
            core.delete_namespaced_pod, pod.metadata.name, POOL.namespace, grace_period_seconds=0
        )
    await rig.inject(FaultKind.GPU_XID, node, clear=True)


async def _trip_the_removal_breaker(client: Client, task_queue: str) -> None:
    """A bad signal elsewhere in the fleet: two serving nodes asked to be cordoned in a 4-node fleet (cap 1)."""
    for node in ("elsewhere-1", "elsewhere-2"):
        start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
            "RemovalBreaker",
            BreakerInput(),
            id=breaker_workflow_id(task_queue),
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        ask = RemovalRequest(
            node=node,
            action="cordon",
            signal="GpuXid=True (a bad health check)",
            requester=f"test/{node}",
            engines=2,
            answering=2,
            fleet_gpu_nodes=4,
        )
        await client.execute_update_with_start_workflow(
            "ask", ask, start_workflow_operation=start, result_type=BreakerDecision
        )
    status = await client.get_workflow_handle(breaker_workflow_id(task_queue)).query(
        "status", result_type=BreakerStatus
    )
    assert status.tripped, status


async def test_an_xid_79_under_load_is_quarantined_fails_qualification_then_returns_after_the_repair(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    """All of it while the removal breaker is tripped by a bad signal elsewhere: a real loss is handled
    at full speed, and a node's return after it passes qualification never asks the breaker."""
    async with fleet_rig(
        temporal_client, scenario=hardware_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        leader = sorted(await rig.pool_ready(POOL, 5))[0]
        await _trip_the_removal_breaker(temporal_client, task_queue)
        core = rig.core
        pod = await asyncio.to_thread(core.read_namespaced_pod, leader, POOL.namespace)
        node = str(pod.spec.node_name)
        machine = (await asyncio.to_thread(core.read_node, node)).spec.provider_id
        await rig.start_load(rate=20, duration_s=200, seed=5)
        await load_reaches(rig)
        await rig.inject(FaultKind.GPU_XID, node, code=79, gpu=0)  # under load: the replica on GPU 0 dies
        report = LossReport(pool=POOL, fingerprint="fp-xid", alert_name="FleetmendGpuXid", node=node)
        incident = await rig.report_loss(report, incident_config(timings=NODE_LEVEL_TIMINGS))
        child = await wait_for_child(temporal_client, incident)

        failed = asyncio.Event()
        qualification = await node_workflow(temporal_client, child, node)

        async def watch() -> None:
            while True:
                status = await qualification.query("status")
                if any("failed qualification" in d["summary"] for d in status["decisions"]):
                    failed.set()
                    return
                await asyncio.sleep(0.3)

        watcher = asyncio.create_task(watch())
        repair = asyncio.create_task(_follow_up_repairs(rig, node, failed))
        status = await finish(child, timeout_s=240)
        node_status = await finish(qualification, timeout_s=240)
        watcher.cancel()
        await repair
        text_ = decisions(status)
        assert status.phase == Phase.DONE, text_
        # Triage from the exporter's Xid series: the GPU-fault path, with the evidence recorded.
        assert status.figures["fault_class"] == "xid-ecc", text_
        triage = next(d for d in status.decisions if d.summary.startswith(f"triage {node}"))
        assert any("Xid 79 GPU_HAS_FALLEN_OFF_THE_BUS" in e for e in triage.figures["triage"]["evidence"]), (
            triage
        )
        assert triage.figures["machine"] == machine
        # First qualification failed (the node could not give the diagnostic its GPUs), the node stayed out;
        # after the repair the next one passed and the node returned: uncordoned, untainted, unlabelled.
        # That is the node's own workflow: the recovery verified with the quarantine in place.
        assert node_status.phase == Phase.DONE, decisions(node_status)
        text_ = decisions(node_status)
        assert (
            "failed qualification" in text_ and "looks repaired" in text_ and "passed qualification" in text_
        )
        obj = await asyncio.to_thread(core.read_node, node)
        assert not obj.spec.unschedulable
        assert QUARANTINE_TAINT_KEY not in {t.key for t in obj.spec.taints or []}
        assert QUARANTINE_LABEL not in (obj.metadata.labels or {})
        # Returned although the breaker is still tripped: returning capacity never asks it.
        breaker = await temporal_client.get_workflow_handle(breaker_workflow_id(task_queue)).query(
            "status", result_type=BreakerStatus
        )
        assert breaker.tripped and node not in {h.request.node for h in breaker.held}, breaker
        # The Jobs ran on that node only and were deleted afterwards.
        jobs = kc.BatchV1Api(core.api_client)
        assert (await asyncio.to_thread(jobs.list_namespaced_job, "fleetmend")).items == []
        rows = procedure_rows(ledger_url, child.id)
        node_steps = [
            op.split("@", 1)[1].split("/")[1] for op, _, target, _ in rows if target == f"node/{node}"
        ]
        # Each step once: the early fence (cordon), the quarantine (cordon + label, taint), the return.
        assert sorted(node_steps) == ["fence", "quarantine", "quarantine-taint", "return-node"], rows
        # The warm spare left on the repaired machine was deleted by fleetmend, once, before qualifying:
        # a spare on quarantined hardware is no spare, and the diagnostic needs every GPU.
        cleared = [r for r in rows if r[1] == "k8s.pod.delete" and "/clear-" in r[0]]
        assert len(cleared) == 1 and cleared[0][3] == "applied", rows
        assert "holds warm spare(s)" in text_, text_
        spare = cleared[0][2].rsplit("/", 1)[1]
        assert all(
            p.metadata.name != spare
            for p in (
                await asyncio.to_thread(
                    core.list_namespaced_pod, POOL.namespace, field_selector=f"spec.nodeName={node}"
                )
            ).items
        )
        creates = [r for r in rows if r[1] == "k8s.job.create"]
        deletes = [r for r in rows if r[1] == "k8s.job.delete"]
        assert len(creates) == 2 and len(deletes) == 2, rows
        assert {r[3] for r in creates + deletes} == {"applied"}
        assert {_job_node(ledger_url, r[0]) for r in creates} == {node}  # pinned to that node only
