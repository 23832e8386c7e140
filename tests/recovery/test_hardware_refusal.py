"""The world refuses the qualification Job (403: RBAC lost the jobs/create permission): the step stops
and asks an operator; the node is never returned without a passing Job. Before that, the fleet-wide
cap on qualifications at once (here 1) holds the node's qualification queued, visibly, while another
qualification Job runs, and lets it go when that Job is gone. Real Temporal, real Postgres, the
simulated fleet and its API server (its Job controller)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client as kc
from temporalio.client import Client

from fleet.incident import LossReport
from fleet.qualification import QUALIFICATION_LABEL, QualificationSpec
from fleet.recovery import OperatorAction, Phase
from fleet.vocabulary import QUARANTINE_TAINT_KEY, FaultKind
from tests.recovery.support import NODE_LEVEL_TIMINGS, hardware_scenario, node_workflow, procedure_rows
from tests.support import (
    POOL,
    decisions,
    execute_update,
    finish,
    incident_config,
    status_of,
    until,
    wait_for_child,
    wait_for_phase,
)
from worker.devstack.rig import fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BLOCKER: Any = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"name": "qualify-other", "labels": {QUALIFICATION_LABEL: "true"}},
    "spec": {
        "template": {
            "spec": {
                "restartPolicy": "Never",
                "nodeSelector": {"kubernetes.io/hostname": "a-node-not-in-this-cluster"},
                "containers": [
                    {"name": "diag", "image": "nvcr.io/nvidia/cloud-native/dcgm:4.2.3-1-ubuntu22.04"}
                ],
            }
        }
    },
}


async def test_a_refused_qualification_job_stops_and_asks_and_the_node_stays_out(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    spec = QualificationSpec(concurrency=1)
    async with fleet_rig(
        temporal_client,
        scenario=hardware_scenario(),
        database_url=ledger_url,
        task_queue=task_queue,
        qualification=spec,
    ) as rig:
        leader = sorted(await rig.pool_ready(POOL, 5))[0]
        core = rig.core
        node = str((await asyncio.to_thread(core.read_namespaced_pod, leader, POOL.namespace)).spec.node_name)
        # Another node's qualification runs (its pod waits for a node that is not there): the one slot.
        batch = kc.BatchV1Api(core.api_client)
        await asyncio.to_thread(batch.create_namespaced_job, spec.namespace, BLOCKER)
        await rig.start_load(rate=20, duration_s=200, seed=17)
        await rig.refuse({"verbs": ["POST"], "path_contains": "/jobs", "error": "403"})
        await rig.inject(FaultKind.GPU_XID, node, code=79, gpu=0)
        report = LossReport(pool=POOL, fingerprint="fp-refused-job", alert_name="FleetmendGpuXid", node=node)
        child = await wait_for_child(
            temporal_client, await rig.report_loss(report, incident_config(timings=NODE_LEVEL_TIMINGS))
        )
        # The node's own workflow stopped and asks; the recovery verified with the quarantine in place.
        qualification = await node_workflow(temporal_client, child, node)
        queued = f"{node} queued for qualification: 1 of 1 qualification Job(s) already run fleet-wide (qualify-other)"
        await until(
            lambda: status_of(qualification),
            lambda status: queued in decisions(status),
            lambda status: f"not queued behind qualify-other: {decisions(status) if status else ''}",
            timeout_s=120,
        )
        await asyncio.to_thread(
            batch.delete_namespaced_job, "qualify-other", spec.namespace, propagation_policy="Background"
        )
        waiting = await wait_for_phase(qualification, Phase.AWAITING_OPERATOR, timeout_s=120)
        assert f"0 of 1 qualification Job(s) running fleet-wide: {node} qualifies now" in decisions(waiting)
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
