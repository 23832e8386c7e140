"""Lose one GPU, not eight: a single-GPU fault fences the device, the node and its other replicas keep
serving; a fault across GPUs still takes the node path. Real Temporal, real Postgres, the simulated
fleet and its API server (device plugin here; the DRA twin in ``test_device_fault_dra.py``)."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import Client
from temporalio.service import RPCError

from fleet.device_fault import quarantine_annotation
from fleet.fence import fence_workflow_id
from fleet.recovery import Phase
from fleet.vocabulary import QUARANTINE_TAINT_KEY, ROUTER_LABEL, FaultKind
from tests.recovery.support import (
    DEVICE_TIMINGS,
    effects_on,
    fault_reported,
    hardware_scenario,
    node_workflow,
    procedure_rows,
    two_replica_node,
)
from tests.support import POOL, decisions, finish, gpu_pool, load_reaches
from worker.devstack.rig import fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_xid_79_on_one_gpu_recovers_one_replica_and_never_touches_the_other_or_the_node(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with fleet_rig(
        temporal_client, scenario=hardware_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        await rig.pool_ready(POOL, 5)
        node, before = await two_replica_node(rig)
        await rig.start_load(rate=20, duration_s=200, seed=5)
        await load_reaches(rig)
        child = await fault_reported(  # the replica on GPU 0 dies
            rig,
            temporal_client,
            FaultKind.GPU_XID,
            node,
            fingerprint="fp-gpu",
            timings=DEVICE_TIMINGS,
            code=79,
            gpu=0,
        )
        status = await finish(child, timeout_s=240)
        text_ = decisions(status)
        assert status.phase == Phase.DONE, text_
        assert status.figures["groups_lost"] == 1, text_
        lost = set(status.figures["lost_pods"])
        (survivor,) = set(before) - lost
        node_status = await finish(await node_workflow(temporal_client, child, node), timeout_s=120)
        node_text = decisions(node_status)
        assert node_status.figures["fault_scope"] == "device", node_text
        device = node_status.figures["device"]
        assert device["index"] == 0 and device["xid"] == 79, device
        assert "stays fenced" in node_text and "device plugin" in node_text, node_text
        # The node: never cordoned, tainted or labelled; the device's quarantine is recorded on it.
        obj = await asyncio.to_thread(rig.core.read_node, node)
        assert not obj.spec.unschedulable
        assert QUARANTINE_TAINT_KEY not in {t.key for t in obj.spec.taints or []}
        assert (
            (obj.metadata.annotations or {})
            .get(quarantine_annotation(device["uuid"]), "")
            .startswith("xid-ecc@")
        ), obj.metadata.annotations
        # The other replica: the same pod, still routed, and no effect of either workflow names it.
        pod = await asyncio.to_thread(rig.core.read_namespaced_pod, survivor, POOL.namespace)
        assert pod.metadata.uid == before[survivor].metadata.uid
        assert (pod.metadata.labels or {}).get(ROUTER_LABEL) == "true"
        rows = procedure_rows(ledger_url, child.id)  # the node's workflow acts in its recovery's scope
        assert not effects_on(rows, f"pod/{POOL.namespace}/{survivor}"), rows
        node_rows = effects_on(rows, f"node/{node}")
        assert [r[1] for r in node_rows] == ["k8s.node.quarantine-device"], node_rows


async def test_an_nvlink_error_takes_the_node_path(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    """A fabric fault reaches past one GPU (a link has two ends): the node is quarantined whole, under
    the same device-level policy."""
    async with fleet_rig(
        temporal_client, scenario=hardware_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        await rig.pool_ready(POOL, 5)
        node, _ = await two_replica_node(rig)
        child = await fault_reported(
            rig,
            temporal_client,
            FaultKind.NVLINK_ERROR,
            node,
            fingerprint="fp-nvlink",
            timings=DEVICE_TIMINGS,
            gpu=0,
        )
        qualification = await node_workflow(temporal_client, child, node)
        for _ in range(
            600
        ):  # until its triage quarantined the node (its qualification and repair watch go on)
            obj = await asyncio.to_thread(rig.core.read_node, node)
            if obj.spec.unschedulable and QUARANTINE_TAINT_KEY in {t.key for t in obj.spec.taints or []}:
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"{node} was not quarantined: {await qualification.query('status')}")
        summaries = [d["summary"] for d in (await qualification.query("status"))["decisions"]]
        assert f"{node}: the fault class (fabric) is not one GPU's: the node path" in summaries, summaries
        assert not any("the device path" in s for s in summaries), summaries


async def test_the_fast_paths_fence_leaves_a_node_with_one_failed_gpu_schedulable(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    """The fast path starts a NodeFence for the GpuXid condition on a Ready node: it reads the node's
    DCGM series, finds one GPU's fault, and does not cordon (the pool's recovery fences the device)."""
    async with gpu_pool(temporal_client, task_queue, ledger_url) as rig, rig.fast_path():
        node, _ = await two_replica_node(rig)
        await rig.inject(FaultKind.GPU_XID, node, code=79, gpu=0)
        handle = temporal_client.get_workflow_handle(fence_workflow_id(node))
        for _ in range(300):
            try:
                await handle.describe()
                break
            except RPCError:
                await asyncio.sleep(0.2)
        status = await finish(handle, 60)
        assert status.phase == Phase.DONE, decisions(status)
        assert status.figures.get("fault_scope") == "device", decisions(status)
        assert not (await asyncio.to_thread(rig.core.read_node, node)).spec.unschedulable
