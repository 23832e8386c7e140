"""A node's repair watch over a whole day keeps its history under a stated bound.

An Xid 79 under load: the recovery quarantines the node, its ``NodeQualification`` child
qualifies it, the qualification fails (the GPU is off the bus) and the child watches for a repair
for up to ``repair_wait_s`` = 24 h. Nobody repairs it. The time-skipping dev server (DESIGN.md
§6b) fast-forwards the child's own clock through the day: its looks back off
(``repair_look_cap``) and number at most ``repair_looks_max(24 h, 1 s)`` (46); before the
back-off the watch looked every second, 86 400 looks (about 950 000 events, past the server's
51 200-event limit). The watch ends saying what it last saw, the node still quarantined.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client as kc
from kubernetes import config as kconfig
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from fleet.incident import LossReport
from fleet.recovery import Phase
from fleet.vocabulary import QUARANTINE_LABEL, QUARANTINE_TAINT_KEY, FaultKind
from tests.support import FAST, POOL, decisions, finish, incident_config, wait_for_child, wait_for_phase
from worker.devstack.rig import FleetRig, compressed_scenario, fleet_rig
from workflows.node_qualification import child_id, repair_looks_max

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

A_DAY_S = 24 * 3600.0
# The node path (node-level policy): this is a whole node's repair watch.
TIMINGS = FAST.model_copy(
    update={"qualification_timeout_s": 30, "repair_wait_s": A_DAY_S, "device_quarantine": False}
)


def _core(rig: FleetRig) -> kc.CoreV1Api:
    cfg = kc.Configuration()
    kconfig.load_kube_config(config_file=str(rig.sim.kubeconfig), client_configuration=cfg)
    return kc.CoreV1Api(kc.ApiClient(cfg))


async def _node_workflow(env: WorkflowEnvironment, recovery_id: str, node: str) -> WorkflowHandle[Any, Any]:
    handle = env.client.get_workflow_handle(child_id(recovery_id, node))
    for _ in range(300):
        try:
            await handle.describe()
            return handle
        except RPCError:
            await asyncio.sleep(0.3)
    raise AssertionError(f"{recovery_id} started no workflow for {node}")


async def test_a_day_watching_an_unrepaired_node_takes_a_bounded_number_of_looks(
    time_skipping_env: WorkflowEnvironment, task_queue: str, ledger_url: str
) -> None:
    env = time_skipping_env
    scenario = compressed_scenario("gpu-node-loss")
    scenario = scenario.model_copy(update={"load": {**(scenario.load or {}), "qualification_s": 2.0}})
    async with fleet_rig(
        env.client, scenario=scenario, database_url=ledger_url, task_queue=task_queue
    ) as rig:
        while len(await rig.routing_set(POOL)) < 5:
            await asyncio.sleep(0.5)
        core = _core(rig)
        leader = sorted(await rig.routing_set(POOL))[0]
        node = str((await asyncio.to_thread(core.read_namespaced_pod, leader, POOL.namespace)).spec.node_name)
        await rig.start_load(rate=20, duration_s=60, seed=5)
        await rig.inject(FaultKind.GPU_XID, node, code=79, gpu=0)
        report = LossReport(pool=POOL, fingerprint="fp-xid", alert_name="FleetmendGpuXid", node=node)
        # The incident, the recovery and the node's workflow run on wall-clock time until the watch.
        with env.with_time_skipping_disabled():
            incident = await rig.report_loss(report, incident_config(timings=TIMINGS))
        recovery = await wait_for_child(env.client, incident)
        watch = await _node_workflow(env, recovery.id, node)
        await wait_for_phase(watch, Phase.AWAITING_REPAIR, timeout_s=120)
        began = len([e async for e in watch.fetch_history_events()])

        await env.fast_forward(watch, None)  # skip through the day until the workflow ends

        status = await finish(watch, timeout_s=60)
        events = [e async for e in watch.fetch_history_events()]
        looks = [
            e
            for e in events[began:]
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == "read_node_health"
        ]
        bound = repair_looks_max(A_DAY_S, max(TIMINGS.poll_interval_s, 1.0))  # the watch's own base
        print(
            f"\nrepair watch: {len(looks)} looks over 24 h (bound {bound}); node workflow history "
            f"{began} events when the watch began, {len(events)} at its end"
        )
        text = decisions(status)
        assert f"no repair of {node} seen within {A_DAY_S:.0f} s" in text, text
        assert 2 <= len(looks) <= bound, text
        # Still out of service: quarantined until an operator acts.
        obj = await asyncio.to_thread(core.read_node, node)
        assert obj.spec.unschedulable and QUARANTINE_LABEL in (obj.metadata.labels or {})
        assert QUARANTINE_TAINT_KEY in {t.key for t in obj.spec.taints or []}
