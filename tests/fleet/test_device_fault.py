"""The fault's scope (one GPU or the node) and the DRA objects that fence and qualify one GPU."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.device_fault import (
    DevicePolicy,
    FaultedDevice,
    FaultScope,
    ScopeDecision,
    device_for,
    dra_device,
    fenceable,
    holders_of,
    judge_node,
    quarantine_annotation,
    quarantined_devices,
)
from fleet.device_taint import claim_manifest, rule_manifest, rule_report, taint_effect
from fleet.engine_metrics import GpuTelemetry, NodeGpuTelemetry
from fleet.qualification import QualificationSpec, job_manifest
from kube.allocation import device_health, gpus_held

NODE = "gpu-node-2"


def telemetry(**faults: dict[str, Any]) -> NodeGpuTelemetry:
    """Eight GPUs; ``faults``: ``g<index>`` -> GpuTelemetry fields."""
    return NodeGpuTelemetry(
        node=NODE,
        gpus=tuple(
            GpuTelemetry(gpu=str(i), uuid=f"GPU-{i:04d}", **{"last_xid": 0, **faults.get(f"g{i}", {})})
            for i in range(8)
        ),
    )


def scope(
    tel: NodeGpuTelemetry | None,
    *,
    ready: bool | None = True,
    conditions: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    policy: DevicePolicy | None = None,
    history_allows: bool = True,
) -> ScopeDecision:
    _, decided = judge_node(
        NODE,
        1000.0,
        telemetry=tel,
        conditions={"Ready": "True" if ready else "Unknown", **(conditions or {})},
        ready=ready,
        annotations=annotations or {},
        policy=policy or DevicePolicy(),
        history_allows=history_allows,
    )
    return decided


def test_an_xid_79_on_one_gpu_is_that_devices_fault() -> None:
    decided = scope(telemetry(g3={"last_xid": 79}))
    assert decided.scope is FaultScope.DEVICE, decided.reason
    assert decided.device == FaultedDevice(
        index=3, uuid="GPU-0003", xid=79, evidence=("Xid 79 GPU_HAS_FALLEN_OFF_THE_BUS",)
    )


@pytest.mark.parametrize(
    ("faults", "why"),
    [
        ({"g0": {"last_xid": 74}}, "fabric"),
        ({"g0": {"nvlink_errors": 500.0}, "g1": {"last_xid": 79}}, "reaches past one GPU"),
        ({"g0": {"last_xid": 79}, "g5": {"ecc_dbe_volatile": 2.0}}, "2 GPUs carry hardware evidence"),
        ({"g0": {"last_xid": 119}}, "driver"),
        ({"g0": {"last_xid": 79}, "g1": {"clock_event_reasons": 0x20}}, "reaches past one GPU"),
    ],
)
def test_faults_that_reach_past_one_gpu_take_the_node_path(faults: dict[str, Any], why: str) -> None:
    decided = scope(telemetry(**faults))
    assert decided.scope is FaultScope.NODE and why in decided.reason, decided.reason


def test_a_silent_node_an_unreadable_exporter_a_kernel_fault_the_loop_cap_and_the_node_policy_take_the_node_path() -> (
    None
):
    one = telemetry(g3={"last_xid": 79})
    assert "not Ready" in scope(one, ready=None).reason
    assert "(unknown)" in scope(None).reason  # no DCGM page, no Xid: triage's own class is unknown
    assert "KernelDeadlock" in scope(one, conditions={"KernelDeadlock": "True"}).reason
    assert "loop cap" in scope(one, history_allows=False).reason
    assert "whole nodes" in scope(one, policy=DevicePolicy(device_level=False)).reason


def test_gpus_already_fenced_count_toward_the_nodes_share_and_are_not_faulted_again() -> None:
    # GPU 3 was fenced earlier (its Xid is sticky until the driver restarts); GPU 5 fails now.
    fenced = {quarantine_annotation("GPU-0003"): "xid-ecc@900"}
    decided = scope(telemetry(g3={"last_xid": 79}, g5={"last_xid": 48}), annotations=fenced)
    assert decided.scope is FaultScope.DEVICE and decided.device is not None and decided.device.index == 5
    assert decided.fenced == ("GPU-0003",)
    assert quarantined_devices(fenced) == {"GPU-0003": "xid-ecc@900"}
    # Four out already: a fifth of eight is over half - the node path.
    four = {quarantine_annotation(f"GPU-{i:04d}"): "xid-ecc@900" for i in range(4)}
    over = scope(telemetry(g5={"last_xid": 79}), annotations=four)
    assert over.scope is FaultScope.NODE and "5 of its 8 GPUs" in over.reason, over.reason


def test_evidence_only_on_gpus_already_fenced_is_nothing_new_and_spares_the_node() -> None:
    fenced = {quarantine_annotation("GPU-0003"): "xid-ecc@900"}
    decided = scope(telemetry(g3={"last_xid": 79}), annotations=fenced)  # the fenced GPU's sticky Xid
    assert decided.scope is FaultScope.FENCED and decided.spares_node, decided.reason
    assert not scope(telemetry(g0={"last_xid": 74})).spares_node


def test_on_dra_a_gpu_its_slice_does_not_name_cannot_be_fenced_alone() -> None:
    decided = scope(telemetry(g3={"last_xid": 79}))
    named = dra_device({"driver": "gpu.nvidia.com", "pool": NODE, "name": "gpu-3",
                        "attributes": {"uuid": {"string": "GPU-0003"}}})  # fmt: skip
    other = named.model_copy(update={"name": "gpu-4", "uuid": "GPU-0004"})
    assert fenceable(decided, [named]) == decided  # named in the slice: the device path
    assert fenceable(decided, []) == decided  # no slice: the device plugin withholds it
    moved = fenceable(decided, [other])
    assert moved.scope is FaultScope.NODE and moved.device is None and "names no device" in moved.reason


def test_the_taint_rule_names_one_device_and_its_effect_follows_the_run_and_the_holders() -> None:
    dra = dra_device(
        {"driver": "gpu.nvidia.com", "pool": NODE, "name": "gpu-3",
         "attributes": {"uuid": {"string": "GPU-0003"}, "gpu.nvidia.com/index": {"int": 3}}}
    )  # fmt: skip
    assert (dra.uuid, dra.index, dra.resource_id) == ("GPU-0003", 3, f"gpu.nvidia.com/{NODE}/gpu-3")
    faulted = FaultedDevice(index=3, uuid="GPU-0003")
    assert device_for([dra], faulted) == dra
    assert taint_effect(True, ["a"]) == "None"
    assert taint_effect(False, ["a"]) == "NoExecute"
    assert taint_effect(False, []) == "NoSchedule"
    rule = rule_manifest(dra, faulted, node=NODE, machine="m-1", fault_class="xid-ecc", effect="NoSchedule")
    assert rule["apiVersion"] == "resource.k8s.io/v1" and rule["kind"] == "DeviceTaintRule"
    assert rule["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-3"}
    assert rule["spec"]["taint"] == {
        "key": "fleetmend.io/quarantine",
        "value": "xid-ecc",
        "effect": "NoSchedule",
    }
    report = {
        "status": {"conditions": [{"type": "EvictionInProgress", "message": "1 pods would be evicted: a/b"}]}
    }
    assert rule_report(report) == "1 pods would be evicted: a/b" and rule_report({}) is None


def test_the_qualification_claims_the_gpu_by_uuid_and_the_job_runs_dcgmi_on_that_index_only() -> None:
    dra = dra_device({"driver": "gpu.nvidia.com", "pool": NODE, "name": "gpu-3", "attributes": {}})
    claim = claim_manifest(
        dra, FaultedDevice(index=3, uuid="GPU-0003"), namespace="fleetmend", name="c", op_id="op"
    )
    exactly = claim["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["count"] == 1 and exactly["deviceClassName"] == "gpu.nvidia.com"
    assert exactly["selectors"] == [
        {"cel": {"expression": 'device.attributes["gpu.nvidia.com"].uuid == "GPU-0003"'}}
    ]
    assert {t["key"] for t in exactly["tolerations"]} == {
        "fleetmend.io/quarantine",
        "gpu.nvidia.com/unhealthy",
    }
    job = job_manifest(
        QualificationSpec(), node=NODE, machine="m", gpus=1, name="j", op_id="op", claim="c", gpu_index=3
    )
    pod = job["spec"]["template"]["spec"]
    assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimName": "c"}]
    container = pod["containers"][0]
    assert container["resources"] == {"claims": [{"name": "gpu"}]}
    assert container["command"] == ["dcgmi", "diag", "-r", "2", "-i", "3", "-j"]


def test_which_pod_holds_a_device_comes_from_its_kubelets_health_report() -> None:
    pod = {
        "spec": {"containers": [{"name": "engine"}]},
        "status": {
            "containerStatuses": [
                {"allocatedResourcesStatus": [
                    {"name": "claim:gpus/gpus", "resources": [
                        {"resourceID": f"gpu.nvidia.com/{NODE}/gpu-3", "health": "Unhealthy"},
                        {"resourceID": f"gpu.nvidia.com/{NODE}/gpu-4", "health": "Healthy"},
                    ]}
                ]}
            ]
        },
    }  # fmt: skip
    health = device_health(pod)
    assert health == {f"gpu.nvidia.com/{NODE}/gpu-3": "Unhealthy", f"gpu.nvidia.com/{NODE}/gpu-4": "Healthy"}
    assert gpus_held(pod) == 2
    assert holders_of([("a", health), ("b", {"GPU-9": "Healthy"})], {f"gpu.nvidia.com/{NODE}/gpu-3"}) == ["a"]
