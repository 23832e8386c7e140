"""The device path on a DRA cluster (``resource.k8s.io/v1``, the ``gpu-node-loss-dra`` twin): a
DeviceTaintRule names the failed GPU only, a Job whose ResourceClaim selects that GPU by UUID
qualifies it, a fail keeps it out, a pass after the repair deletes the rule; a dry run creates the
rule with effect None and reports what NoExecute would evict. Real Temporal, real Postgres, the
simulated fleet and its API server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kubernetes import client as kc
from sqlalchemy import create_engine, text
from temporalio.client import Client

from fleet.recovery import Phase
from fleet.vocabulary import QUARANTINE_TAINT_KEY, FaultKind
from tests.recovery.support import (
    DEVICE_TIMINGS,
    NODE_LEVEL_TIMINGS,
    effects_on,
    fault_reported,
    node_workflow,
    procedure_rows,
    two_replica_node,
)
from tests.support import POOL, decisions, finish, load_reaches
from worker.devstack.rig import compressed_scenario, fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def dra_scenario() -> Any:
    scenario = compressed_scenario("gpu-node-loss-dra")
    return scenario.model_copy(update={"load": {**(scenario.load or {}), "qualification_s": 2.0}})


def _params(url: str, op_id: str) -> dict[str, Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            raw = conn.execute(
                text("SELECT params FROM ledger_effects WHERE op_id = :o"), {"o": op_id}
            ).scalar()
            return raw if isinstance(raw, dict) else json.loads(str(raw))
    finally:
        engine.dispose()


async def test_one_gpu_is_tainted_qualified_by_uuid_kept_out_on_a_fail_and_returned_after_a_pass(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with fleet_rig(
        temporal_client, scenario=dra_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        await rig.pool_ready(POOL, 5)
        node, before = await two_replica_node(rig)
        resource = kc.ResourceV1Api(rig.core.api_client)
        await rig.start_load(rate=20, duration_s=200, seed=5)
        await load_reaches(rig)
        child = await fault_reported(
            rig,
            temporal_client,
            FaultKind.GPU_XID,
            node,
            fingerprint="fp-dra",
            timings=DEVICE_TIMINGS,
            code=79,
            gpu=0,
        )
        qualification = await node_workflow(temporal_client, child, node)

        async def repair_after_the_failed_qualification() -> None:
            while not any(
                "failed qualification" in d["summary"]
                for d in (await qualification.query("status"))["decisions"]
            ):
                await asyncio.sleep(0.3)
            # The rule still fences the device after the fail.
            rules = (await asyncio.to_thread(resource.list_device_taint_rule)).items
            assert [r.spec.device_selector.device for r in rules] == ["gpu-0"], rules
            await rig.inject(FaultKind.GPU_XID, node, clear=True)

        repair = asyncio.create_task(repair_after_the_failed_qualification())
        status = await finish(child, timeout_s=240)
        node_status = await finish(qualification, timeout_s=240)
        await repair
        text_ = decisions(status)
        node_text = decisions(node_status)
        assert status.phase == Phase.DONE and status.figures["groups_lost"] == 1, text_
        (survivor,) = set(before) - set(status.figures["lost_pods"])
        assert node_status.figures["fault_scope"] == "device", node_text
        uuid = node_status.figures["device"]["uuid"]
        # The rule named that device only (driver, pool = the node, gpu-0), and enforced it.
        taint = node_status.figures["device_taint"]
        assert taint["device"] == f"gpu.nvidia.com/{node}/gpu-0" and taint["effect"] in (
            "NoSchedule",
            "NoExecute",
        )
        rows = procedure_rows(ledger_url, child.id)
        (rule_row,) = [r for r in rows if r[1] == "k8s.devicetaintrule.create"]
        params = _params(ledger_url, rule_row[0])
        assert params["selector"] == {"driver": "gpu.nvidia.com", "pool": node, "device": "gpu-0"}, params
        assert params["taint"]["key"] == QUARANTINE_TAINT_KEY
        # Qualified by UUID: the claim's CEL selector names the GPU; the first Job failed, the second passed.
        claims = [_params(ledger_url, r[0]) for r in rows if r[1] == "k8s.resourceclaim.create"]
        assert len(claims) == 2 and all(
            uuid in c["selector"]["selectors"][0]["cel"]["expression"] for c in claims
        )
        assert "failed qualification" in node_text and "passed qualification" in node_text, node_text
        assert node_status.figures["device_returned"] == uuid
        # After the pass: no rule, no claim left, the record closed; the node was never cordoned.
        assert (await asyncio.to_thread(resource.list_device_taint_rule)).items == []
        assert (await asyncio.to_thread(resource.list_namespaced_resource_claim, "fleetmend")).items == []
        # The device serves again: a claim for exactly that GPU is allocated it (nothing taints it now).
        claim: Any = {  # a manifest (the client takes dicts too)
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "after-the-pass", "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1,
                "selectors": [{"cel": {"expression": f'device.attributes["gpu.nvidia.com"].uuid == "{uuid}"'}}],
            }}]}},
        }  # fmt: skip
        await asyncio.to_thread(resource.create_namespaced_resource_claim, "default", claim)
        probe: Any = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "after-the-pass", "namespace": "default"},
            "spec": {
                "restartPolicy": "Never",
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "after-the-pass"}],
                "containers": [{"name": "c", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}],
            },
        }
        await asyncio.to_thread(rig.core.create_namespaced_pod, "default", probe)
        for _ in range(300):
            got = await asyncio.to_thread(
                resource.read_namespaced_resource_claim, "after-the-pass", "default"
            )
            if got.status and got.status.allocation:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"the passed GPU {uuid} was not allocated to a new claim: {got.status}")
        devices = got.status.allocation.devices
        (result,) = (devices.results if devices else None) or []
        assert (result.pool, result.device) == (node, "gpu-0"), result
        obj = await asyncio.to_thread(rig.core.read_node, node)
        assert not obj.spec.unschedulable
        assert not [k for k in obj.metadata.annotations or {} if uuid in k]
        assert not effects_on(rows, f"pod/{POOL.namespace}/{survivor}"), rows
        assert [r[1] for r in effects_on(rows, f"node/{node}")] == [
            "k8s.node.quarantine-device",
            "k8s.node.release-device",
        ]


async def test_a_dry_run_creates_the_rule_with_effect_none_and_reports_what_noexecute_would_evict(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with fleet_rig(
        temporal_client, scenario=dra_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        await rig.pool_ready(POOL, 5)
        node, before = await two_replica_node(rig)
        child = await fault_reported(
            rig, temporal_client, FaultKind.GPU_XID, node, fingerprint="fp-dra-dry", timings=DEVICE_TIMINGS,
            dry_run=True, code=79, gpu=0, keep_alive=True,
        )  # fmt: skip
        node_status = await finish(await node_workflow(temporal_client, child, node), timeout_s=120)
        node_text = decisions(node_status)
        assert node_status.figures["device_taint"]["effect"] == "None", node_text
        # The rule's report names the pod that still holds the dead GPU (kept alive, answering 503).
        assert "1 pods would be evicted" in str(node_status.figures["would_evict"]), node_text
        rows = procedure_rows(ledger_url, child.id)
        (created,) = [r for r in rows if r[1] == "k8s.devicetaintrule.create"]
        params = _params(ledger_url, created[0])
        assert created[3] == "applied" and params["taint"]["effect"] == "None", (created, params)
        assert params["selector"] == {"driver": "gpu.nvidia.com", "pool": node, "device": "gpu-0"}, params
        # Its report read, the dry run's rule is gone; nothing was evicted, cordoned or recorded on the node.
        resource = kc.ResourceV1Api(rig.core.api_client)
        assert (await asyncio.to_thread(resource.list_device_taint_rule)).items == []
        for name, pod in before.items():
            now = await asyncio.to_thread(rig.core.read_namespaced_pod, name, POOL.namespace)
            assert now.metadata.uid == pod.metadata.uid, name
        obj = await asyncio.to_thread(rig.core.read_node, node)
        assert not obj.spec.unschedulable and not [
            k for k in obj.metadata.annotations or {} if "gpu-quarantine" in k
        ]


async def test_the_node_level_policy_on_dra_quarantines_the_node_and_says_its_qualification_is_an_operators(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    """A DRA node advertises no device-plugin GPUs: the node path quarantines it and ends with the reason,
    never a Job asking for zero GPUs."""
    async with fleet_rig(
        temporal_client, scenario=dra_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        await rig.pool_ready(POOL, 5)
        node, _ = await two_replica_node(rig)
        child = await fault_reported(
            rig, temporal_client, FaultKind.GPU_XID, node, fingerprint="fp-dra-node", timings=NODE_LEVEL_TIMINGS,
            code=79, gpu=0,
        )  # fmt: skip
        node_status = await finish(await node_workflow(temporal_client, child, node), timeout_s=120)
        node_text = decisions(node_status)
        assert node_status.phase == Phase.DONE, node_text
        assert "publishes its GPUs through DRA" in node_text and "stays quarantined" in node_text, node_text
        obj = await asyncio.to_thread(rig.core.read_node, node)
        assert obj.spec.unschedulable and QUARANTINE_TAINT_KEY in {t.key for t in obj.spec.taints or []}
