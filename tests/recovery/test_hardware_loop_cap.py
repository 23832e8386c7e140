"""The remediation loop cap: a machine fleetmend quarantined twice within the window is not remediated
a third time automatically - it stays out, no qualification Job runs, and an operator is asked; the
ledger holds the history. Real Temporal, real Postgres, the simulated fleet and its API server."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import Client

from activities.world_effects import NodePatch
from fleet.incident import LossReport
from fleet.recovery import Phase
from fleet.vocabulary import PROCEDURE_OPERATION_PREFIX, QUARANTINE_TAINT_KEY, FaultKind
from kube.client import kube_apis
from ledger.effect import EffectContext
from ledger.store import EffectLedger
from tests.recovery.support import NODE_LEVEL_TIMINGS, hardware_scenario, procedure_rows
from tests.support import POOL, decisions, finish, incident_config, wait_for_child
from worker.devstack.rig import FleetRig, fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _earlier_quarantines(rig: FleetRig, ledger_url: str, node: str, machine: str) -> None:
    """Two earlier incidents quarantined this machine (real cordons through the ledger); an operator
    returned it each time."""
    ledger = EffectLedger(ledger_url)
    kube = kube_apis(rig.settings)
    operator = rig.core  # the operator's own client (not fleetmend's user agent: not fleetmend's action)
    try:
        for n in (1, 2):
            workflow_id = f"incident/earlier-{n}/recovery-1"
            ledger.perform(
                f"{PROCEDURE_OPERATION_PREFIX}{workflow_id}@run-{n}/quarantine/node/{node}",
                "k8s.node.cordon",
                f"node/{node}",
                {"unschedulable": True, "machine": machine},
                NodePatch(kube, node, unschedulable=True),
                context=EffectContext(workflow_id=workflow_id, run_id=f"run-{n}", step="quarantine"),
            )
            operator.patch_node(node, {"spec": {"unschedulable": False}})  # the operator returns it
    finally:
        ledger.close()


async def test_the_third_remediation_inside_the_window_waits_for_an_operator(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with fleet_rig(
        temporal_client, scenario=hardware_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        leader = sorted(await rig.pool_ready(POOL, 5))[0]
        core = rig.core
        node = str((await asyncio.to_thread(core.read_namespaced_pod, leader, POOL.namespace)).spec.node_name)
        machine = str((await asyncio.to_thread(core.read_node, node)).spec.provider_id)
        await asyncio.to_thread(_earlier_quarantines, rig, ledger_url, node, machine)
        await rig.start_load(rate=20, duration_s=200, seed=13)
        await rig.inject(FaultKind.GPU_XID, node, code=79, gpu=0)
        report = LossReport(pool=POOL, fingerprint="fp-third", alert_name="FleetmendGpuXid", node=node)
        child = await wait_for_child(
            temporal_client, await rig.report_loss(report, incident_config(timings=NODE_LEVEL_TIMINGS))
        )
        status = await finish(child, timeout_s=180)
        text_ = decisions(status)
        assert status.phase == Phase.DONE, text_
        assert "remediated 2 time(s) in the last 7 day(s) (cap 2" in text_, text_
        assert "an operator decides" in status.figures["needs_operator"], status.figures
        # The node stays out (cordoned, tainted); no qualification Job was created for it.
        obj = await asyncio.to_thread(core.read_node, node)
        assert obj.spec.unschedulable and QUARANTINE_TAINT_KEY in {t.key for t in obj.spec.taints or []}
        rows = procedure_rows(ledger_url, child.id)
        assert not [r for r in rows if r[1].startswith("k8s.job.")], rows
        assert not [r for r in rows if r[1] == "k8s.node.uncordon"], rows
        # The operator is asked in the incident channel, with the machine named.
        asked = [m["text"] for m in await rig.notifications() if "an operator decides" in m["text"]]
        assert asked and machine in asked[0], asked
