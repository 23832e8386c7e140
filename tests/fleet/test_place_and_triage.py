"""Steps 7-8: whole-shape placement (fragmentation reported as such) and fault triage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.engine_metrics import GpuTelemetry, NodeGpuTelemetry
from fleet.placement import GroupShape, Toleration, place_group
from fleet.pool import NodeInfo, Taint
from fleet.qualification import QualificationState
from fleet.triage import Action, FaultClass, PodFault, is_repeat_fault, return_decision, triage_node
from fleet.vocabulary import NVLINK_DOMAIN_LABEL

from .fleets import node

DAY = 86400.0


def test_single_pod_group_fits_best_fit() -> None:
    nodes = [node("big", gpus=8, used=0), node("tight", gpus=8, used=4), node("full", gpus=8, used=8)]
    r = place_group(GroupShape(pods=1, gpus_per_pod=4), nodes)
    assert r.admissible and r.nodes == ("tight",)  # keeps the 8-GPU hole whole
    assert "fits on tight" in r.reason


def test_free_gpus_scattered_is_reported_as_fragmentation() -> None:
    nodes = [node(f"n{i}", gpus=8, used=6) for i in range(4)]  # 8 free GPUs, 2 per node
    r = place_group(GroupShape(pods=1, gpus_per_pod=4), nodes)
    assert not r.admissible and r.fragmented
    assert r.free_gpus == 8
    assert r.reason.startswith("8 free GPUs, no admissible group for shape 1 pod(s) x 4 GPU")
    assert "largest free block on one node is 2 GPU(s)" in r.reason


def test_multi_node_group_must_fit_inside_one_nvlink_domain() -> None:
    nodes = [
        node("a1", "nvl-a", gpus=8, used=0),
        node("b1", "nvl-b", gpus=8, used=0),
        node("b2", "nvl-b", gpus=8, used=8),
    ]
    shape = GroupShape(pods=2, gpus_per_pod=8, max_pods_per_node=1)
    r = place_group(shape, nodes)
    assert not r.admissible and r.fragmented
    assert "16 free GPUs, no admissible group for shape 2 pod(s) x 8 GPU" in r.reason
    assert f"all in one {NVLINK_DOMAIN_LABEL}" in r.reason
    nodes.append(node("a2", "nvl-a", gpus=8, used=0))
    r = place_group(shape, nodes)
    assert r.admissible and set(r.nodes) == {"a1", "a2"} and r.domain == "nvl-a"


def test_not_enough_gpus_is_not_called_fragmentation() -> None:
    r = place_group(GroupShape(pods=1, gpus_per_pod=8), [node("n1", gpus=8, used=4)])
    assert not r.admissible and not r.fragmented
    assert "only 4 free GPUs" in r.reason and "provisioned" in r.reason


def test_unschedulable_tainted_quarantined_and_failed_nodes_are_excluded() -> None:
    nodes = [
        node("cordoned", gpus=8, used=0, unschedulable=True),
        node(
            "tainted", gpus=8, used=0, taints=(Taint(key="nvidia.com/gpu", value="bad", effect="NoSchedule"),)
        ),
        node("quarantined", gpus=8, used=0, labels={"fleetmend.io/quarantine": "xid"}),
        node("notready", gpus=8, used=0, ready=None),
        node("failed", gpus=8, used=0),
        node("prefer", gpus=8, used=0, taints=(Taint(key="x", effect="PreferNoSchedule"),)),
    ]
    r = place_group(GroupShape(pods=1, gpus_per_pod=8), nodes, exclude=["failed"])
    assert r.admissible and r.nodes == ("prefer",)
    assert r.excluded == {
        "cordoned": "cordoned",
        "tainted": "taint nvidia.com/gpu=bad:NoSchedule not tolerated",
        "quarantined": "quarantined",
        "notready": "not Ready",
        "failed": "excluded (failed node)",
    }
    tolerant = GroupShape(
        pods=1, gpus_per_pod=8, tolerations=(Toleration(key="nvidia.com/gpu", operator="Exists"),)
    )
    assert place_group(tolerant, nodes[1:2]).admissible


def test_node_selector() -> None:
    nodes = [
        node("h100", gpus=8, used=0, labels={"gpu": "h100"}),
        node("a10", gpus=8, used=0, labels={"gpu": "a10"}),
    ]
    r = place_group(GroupShape(gpus_per_pod=8, node_selector={"gpu": "a10"}), nodes)
    assert r.nodes == ("a10",)


@settings(max_examples=150, deadline=None)
@given(
    free=st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=10),
    domains=st.lists(st.sampled_from(["d1", "d2", "d3"]), min_size=10, max_size=10),
    pods=st.integers(min_value=1, max_value=4),
    gpp=st.sampled_from([1, 2, 4, 8]),
)
def test_any_admissible_placement_really_fits(
    free: list[int], domains: list[str], pods: int, gpp: int
) -> None:
    nodes = [node(f"n{i}", domains[i], gpus=8, used=8 - f) for i, f in enumerate(free)]
    shape = GroupShape(pods=pods, gpus_per_pod=gpp)
    r = place_group(shape, nodes)
    by_name = {n.name: n for n in nodes}
    if r.admissible:
        assert len(r.nodes) == pods
        for name in set(r.nodes):
            assert r.nodes.count(name) * gpp <= by_name[name].free_gpus
        if pods > 1:
            assert len({by_name[n].labels[NVLINK_DOMAIN_LABEL] for n in r.nodes}) == 1
    else:
        # Nothing fits: then no domain has enough per-node slots.
        for d in set(domains[: len(free)]):
            slots = sum(by_name[f"n{i}"].free_gpus // gpp for i in range(len(free)) if domains[i] == d)
            assert slots < pods or pods == 1
        assert r.fragmented == (r.free_gpus >= shape.total_gpus)


def tel(*gpus: GpuTelemetry) -> NodeGpuTelemetry:
    return NodeGpuTelemetry(node="gpu-7", gpus=gpus)


@pytest.mark.parametrize(
    "xid,cls,action,quarantine",
    [
        (79, FaultClass.XID_ECC, Action.RESTART_BM, True),
        (48, FaultClass.XID_ECC, Action.RESET_GPU, True),
        (74, FaultClass.FABRIC, Action.RESET_GPU, True),
        (119, FaultClass.DRIVER, Action.RESET_GPU, True),
        (13, FaultClass.APPLICATION, Action.RESTART_APP, False),
        (31, FaultClass.APPLICATION, Action.RESTART_APP, False),
        (94, FaultClass.APPLICATION, Action.RESTART_APP, False),
        (95, FaultClass.XID_ECC, Action.RESET_GPU, True),
    ],
)
def test_xid_classes_follow_the_catalog(xid: int, cls: FaultClass, action: Action, quarantine: bool) -> None:
    r = triage_node("gpu-7", now=0, telemetry=tel(GpuTelemetry(gpu="2", last_xid=xid)))
    assert (r.fault_class, r.action, r.quarantine) == (cls, action, quarantine)
    assert r.xids == {"2": xid}
    assert r.follow_up


def test_worst_evidence_wins_and_all_is_recorded() -> None:
    t = tel(GpuTelemetry(gpu="0", last_xid=13), GpuTelemetry(gpu="1", last_xid=79, ecc_dbe_volatile=3))
    r = triage_node("gpu-7", now=0, telemetry=t, pods=[PodFault(pod="p", terminated_reason="OOMKilled")])
    assert r.fault_class is FaultClass.XID_ECC and r.action is Action.RESTART_BM
    assert any("Xid 79 GPU_HAS_FALLEN_OFF_THE_BUS" in e for e in r.evidence)
    assert any("DBE" in e for e in r.evidence) and any("OOMKilled" in e for e in r.evidence)


def test_thermal_from_temperature_or_condition() -> None:
    hot = triage_node("gpu-7", now=0, telemetry=tel(GpuTelemetry(gpu="0", temperature_c=93)))
    assert hot.fault_class is FaultClass.THERMAL and hot.action is Action.CHECK_MECHANICALS and hot.quarantine
    cond = triage_node("gpu-7", now=0, node_conditions={"Ready": "True", "GpuThermalPressure": "True"})
    assert cond.fault_class is FaultClass.THERMAL


def test_nvlink_counters_and_driver_admission_errors() -> None:
    r = triage_node("gpu-7", now=0, telemetry=tel(GpuTelemetry(gpu="0", nvlink_errors=5000)))
    assert r.fault_class is FaultClass.FABRIC
    d = triage_node("gpu-7", now=0, pods=[PodFault(pod="p", status_reason="UnexpectedAdmissionError")])
    assert d.fault_class is FaultClass.DRIVER


def test_application_fault_keeps_the_node_in_the_pool() -> None:
    r = triage_node("gpu-7", now=0, pods=[PodFault(pod="p", waiting_reason="CrashLoopBackOff")])
    assert r.fault_class is FaultClass.APPLICATION and not r.quarantine
    assert return_decision(r, None).return_to_pool


def test_silent_node_is_unknown_and_quarantined() -> None:
    r = triage_node("gpu-7", now=0, node_conditions={"Ready": "Unknown"})
    assert r.fault_class is FaultClass.UNKNOWN and r.quarantine
    assert "Ready=Unknown" in r.reason
    assert "BMC" in r.follow_up


def test_alert_hint_is_used_when_telemetry_is_unreadable() -> None:
    r = triage_node("gpu-7", now=0, node_conditions={"Ready": "Unknown"}, hint="gpu-xid:79")
    assert r.fault_class is FaultClass.XID_ECC and r.action is Action.RESTART_BM
    r = triage_node("gpu-7", now=0, hint="nvlink-error")
    assert r.fault_class is FaultClass.FABRIC


def test_repeat_fault_within_the_window_needs_an_operator() -> None:
    t = tel(GpuTelemetry(gpu="0", last_xid=48))
    r = triage_node("gpu-7", now=10 * DAY, telemetry=t, remediated_at=8 * DAY)
    assert r.repeat_fault and r.needs_operator
    assert "remediated 2.0 day(s) ago, within the 7-day window - needs an operator" in r.reason
    d = return_decision(r, QualificationState.PASSED)
    assert not d.return_to_pool and d.needs_operator
    old = triage_node("gpu-7", now=30 * DAY, telemetry=t, remediated_at=8 * DAY)
    assert not old.repeat_fault
    assert is_repeat_fault(None, 5, 10) is False


def test_node_returns_only_after_qualification_passes() -> None:
    r = triage_node("gpu-7", now=0, telemetry=tel(GpuTelemetry(gpu="0", last_xid=48)))
    assert not return_decision(r, None).return_to_pool
    assert not return_decision(r, QualificationState.RUNNING).return_to_pool
    failed = return_decision(r, QualificationState.FAILED)
    assert not failed.return_to_pool and failed.needs_operator
    assert return_decision(r, QualificationState.PASSED).return_to_pool


def test_nodeinfo_free_gpus() -> None:
    assert NodeInfo(name="n", gpu_allocatable=8, gpu_allocated=10).free_gpus == 0
