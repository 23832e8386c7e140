"""A quarantine is keyed on the machine: the node object re-created under the same name for the same
machine (same providerID) is still quarantined; another machine under that name is a new machine.
Real Temporal, real Postgres, the simulated fleet and its API server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle

from fleet.incident import LossReport
from fleet.recovery import Phase
from fleet.vocabulary import QUARANTINE_LABEL, QUARANTINE_TAINT_KEY, FaultKind
from tests.recovery.support import NODE_LEVEL_TIMINGS, hardware_scenario, node_workflow, procedure_rows
from tests.support import POOL, decisions, finish, incident_config, wait_for_child
from worker.devstack.rig import FleetRig, fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def _said(child: WorkflowHandle[Any, Any], words: str, timeout_s: float = 90) -> None:
    for _ in range(int(timeout_s / 0.3)):
        status = await child.query("status")
        if any(words in d["summary"] for d in status["decisions"]):
            return
        await asyncio.sleep(0.3)
    raise AssertionError(f"the recovery never said {words!r}")


async def _recreate(rig: FleetRig, node: str, provider_id: str) -> str:
    """Delete the Node object and register it again (a kubelet re-registering); returns the new uid."""
    core = rig.core
    raw = await asyncio.to_thread(core.read_node, node, _preload_content=False)
    obj = json.loads(raw.data)
    await asyncio.to_thread(core.delete_node, node)
    meta = obj["metadata"]
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node,
            "labels": {k: v for k, v in meta["labels"].items() if k != QUARANTINE_LABEL},
        },
        "spec": {"providerID": provider_id},
        "status": {k: obj["status"][k] for k in ("capacity", "allocatable", "addresses", "nodeInfo")},
    }
    created = await asyncio.to_thread(core.create_node, body)
    return str(created.metadata.uid)


async def test_a_node_recreated_for_the_same_machine_stays_quarantined_until_it_passes(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with fleet_rig(
        temporal_client, scenario=hardware_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        leader = sorted(await rig.pool_ready(POOL, 5))[0]
        core = rig.core
        node = str((await asyncio.to_thread(core.read_namespaced_pod, leader, POOL.namespace)).spec.node_name)
        machine = str((await asyncio.to_thread(core.read_node, node)).spec.provider_id)
        await rig.start_load(rate=20, duration_s=200, seed=9)
        await rig.inject(FaultKind.GPU_XID, node, code=79, gpu=0)
        report = LossReport(pool=POOL, fingerprint="fp-same-machine", alert_name="FleetmendGpuXid", node=node)
        # The repair watch must still be watching when the node object comes back: a watch of 60 s
        # ran out once on a CI machine running four test processes on two cores (the repair ends it).
        timings = NODE_LEVEL_TIMINGS.model_copy(update={"repair_wait_s": 240})
        child = await wait_for_child(
            temporal_client, await rig.report_loss(report, incident_config(timings=timings))
        )
        qualification = await node_workflow(temporal_client, child, node)
        await _said(qualification, "failed qualification")
        # The machine reboots and its kubelet registers a new Node object: same name, same providerID.
        uid = await _recreate(rig, node, machine)
        await _said(qualification, "still quarantined, cordoned and tainted again", timeout_s=180)
        obj = await asyncio.to_thread(core.read_node, node)
        assert obj.metadata.uid == uid and obj.spec.unschedulable
        assert QUARANTINE_TAINT_KEY in {t.key for t in obj.spec.taints or []}
        assert obj.metadata.labels.get(QUARANTINE_LABEL) == "xid-ecc"
        await rig.inject(FaultKind.GPU_XID, node, clear=True)  # the repair
        assert (await finish(child, timeout_s=180)).phase == Phase.DONE
        status = await finish(qualification, timeout_s=180)
        text_ = decisions(status)
        assert status.phase == Phase.DONE and "passed qualification" in text_, text_
        obj = await asyncio.to_thread(core.read_node, node)
        assert not obj.spec.unschedulable and QUARANTINE_TAINT_KEY not in {
            t.key for t in obj.spec.taints or []
        }
        steps = [
            op.split("@", 1)[1].split("/")[1]
            for op, _, target, _ in procedure_rows(ledger_url, child.id)
            if target == f"node/{node}"
        ]
        assert f"quarantine-{uid[:8]}" in steps and f"quarantine-{uid[:8]}-taint" in steps, steps
        assert steps.count("return-node") == 1, steps


async def test_another_machine_under_the_same_name_is_a_new_machine(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with fleet_rig(
        temporal_client, scenario=hardware_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        leader = sorted(await rig.pool_ready(POOL, 5))[0]
        core = rig.core
        node = str((await asyncio.to_thread(core.read_namespaced_pod, leader, POOL.namespace)).spec.node_name)
        await rig.start_load(rate=20, duration_s=200, seed=9)
        await rig.inject(FaultKind.GPU_XID, node, code=79, gpu=0)
        report = LossReport(pool=POOL, fingerprint="fp-new-machine", alert_name="FleetmendGpuXid", node=node)
        child = await wait_for_child(
            temporal_client, await rig.report_loss(report, incident_config(timings=NODE_LEVEL_TIMINGS))
        )
        qualification = await node_workflow(temporal_client, child, node)
        await _said(qualification, "failed qualification")
        # The broken machine is replaced: a new instance registers under the same node name.
        await _recreate(rig, node, "aws:///zone-a/i-replacement0000001")
        assert (await finish(child, timeout_s=180)).phase == Phase.DONE
        status = await finish(qualification, timeout_s=180)
        text_ = decisions(status)
        assert "a new machine, neither quarantined nor qualified" in text_, text_
        assert "passed qualification" not in text_, text_
        # fleetmend never touched the new machine: it is schedulable, untainted, unlabelled.
        obj = await asyncio.to_thread(core.read_node, node)
        assert not obj.spec.unschedulable and QUARANTINE_LABEL not in (obj.metadata.labels or {})
        assert QUARANTINE_TAINT_KEY not in {t.key for t in obj.spec.taints or []}
        steps = [
            op.split("@", 1)[1].split("/")[1]
            for op, _, target, _ in procedure_rows(ledger_url, child.id)
            if target == f"node/{node}"
        ]
        assert "return-node" not in steps and sorted(steps) == ["fence", "quarantine", "quarantine-taint"], (
            steps
        )
