"""The world refuses the qualification Job (403: RBAC lost the jobs/create permission): the step stops
and asks an operator; the node is never returned without a passing Job. Real Temporal, real Postgres,
the simulated fleet and its API server."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import Client

from fleet.incident import LossReport
from fleet.recovery import OperatorAction, Phase
from fleet.vocabulary import QUARANTINE_TAINT_KEY, FaultKind
from tests.recovery.support import HARDWARE_TIMINGS, hardware_scenario, node_workflow, procedure_rows
from tests.support import (
    POOL,
    decisions,
    execute_update,
    finish,
    incident_config,
    wait_for_child,
    wait_for_phase,
)
from worker.devstack.rig import fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_a_refused_qualification_job_stops_and_asks_and_the_node_stays_out(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with fleet_rig(
        temporal_client, scenario=hardware_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        leader = sorted(await rig.pool_ready(POOL, 5))[0]
        core = rig.core
        node = str((await asyncio.to_thread(core.read_namespaced_pod, leader, POOL.namespace)).spec.node_name)
        await rig.start_load(rate=20, duration_s=200, seed=17)
        await rig.refuse({"verbs": ["POST"], "path_contains": "/jobs", "error": "403"})
        await rig.inject(FaultKind.GPU_XID, node, code=79, gpu=0)
        report = LossReport(pool=POOL, fingerprint="fp-refused-job", alert_name="FleetmendGpuXid", node=node)
        child = await wait_for_child(
            temporal_client, await rig.report_loss(report, incident_config(timings=HARDWARE_TIMINGS))
        )
        # The node's own workflow stopped and asks; the recovery verified with the quarantine in place.
        qualification = await node_workflow(temporal_client, child, node)
        waiting = await wait_for_phase(qualification, Phase.AWAITING_OPERATOR, timeout_s=120)
        assert waiting.refusal is not None and "qualification Job" in waiting.refusal.what, decisions(waiting)
        assert "403" in waiting.refusal.error, waiting.refusal
        recovery = await finish(child, timeout_s=180)
        assert recovery.phase == Phase.DONE, decisions(recovery)
        assert recovery.verification is not None and recovery.verification.passed, decisions(recovery)
        await execute_update(
            qualification,
            "skip",
            OperatorAction(operator="on-call", reason="no jobs/create in this cluster yet; qualify by hand"),
        )
        status = await finish(qualification, timeout_s=180)
        text_ = decisions(status)
        assert status.phase == Phase.DONE, text_
        assert "skipped by on-call" in text_ and "it stays quarantined" in text_, text_
        obj = await asyncio.to_thread(core.read_node, node)
        assert obj.spec.unschedulable and QUARANTINE_TAINT_KEY in {t.key for t in obj.spec.taints or []}
        rows = procedure_rows(ledger_url, child.id)
        assert [r[3] for r in rows if r[1] == "k8s.job.create"] == ["failed"], rows
        assert not [r for r in rows if r[1] in ("k8s.node.uncordon", "k8s.job.delete")], rows
