"""The qualification Job, its verdict, the machine a quarantine is keyed on, and the loop cap (pure)."""

from __future__ import annotations

import json

import pytest

from fleet.qualification import (
    GpuHolder,
    Identity,
    JobView,
    QualificationSlots,
    QualificationSpec,
    QualificationState,
    RemediationRecord,
    clear_for_qualification,
    identity,
    job_finished,
    job_manifest,
    job_name,
    judge_qualification,
    machine_id,
    parse_dcgm_diag,
    qualification_slot,
    remediation_gate,
    repaired,
)
from fleet.triage import Action, FaultClass, triage_node
from fleet.vocabulary import QUARANTINE_TAINT_KEY

DAY = 86400.0
MACHINE = "aws:///zone-a/i-0abc"


def _report(*results: tuple[str, str, str | None]) -> str:
    tests = [
        {
            "name": name,
            "results": [{"gpu_id": "0", "status": status, **({"warnings": [{"warning": w}]} if w else {})}],
        }
        for name, status, w in results
    ]
    return json.dumps(
        {"DCGM GPU Diagnostic": {"test_categories": [{"category": "Hardware", "tests": tests}]}}
    )


def test_the_job_is_pinned_to_the_node_tolerates_the_quarantine_and_takes_every_gpu() -> None:
    job = job_manifest(QualificationSpec(), node="gpu-node-1", machine=MACHINE, gpus=8, name="n", op_id="op")
    pod = job["spec"]["template"]["spec"]
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term == [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-node-1"]}]}
    ]
    assert {t["key"] for t in pod["tolerations"]} == {
        QUARANTINE_TAINT_KEY,
        "node.kubernetes.io/unschedulable",
    }
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert pod["containers"][0]["command"] == ["dcgmi", "diag", "-r", "2", "-j"]  # the default level: 2
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
    assert job["spec"]["activeDeadlineSeconds"] == 1800
    level3 = job_manifest(
        QualificationSpec(level=3, deadline_s=60), node="n", machine=MACHINE, gpus=1, name="n", op_id="o"
    )
    assert level3["spec"]["template"]["spec"]["containers"][0]["command"][3] == "3"
    with pytest.raises(ValueError, match=r"no nvidia\.com/gpu capacity"):
        job_manifest(QualificationSpec(), node="cpu-node", machine=MACHINE, gpus=0, name="n", op_id="o")


def test_job_names_are_dns_names_unique_per_operation() -> None:
    a = job_name("gpu-node-1", "fleetmend:wf@run/qualify-0/job")
    b = job_name("gpu-node-1", "fleetmend:wf@run/qualify-1/job")
    assert a != b and len(a) <= 63 and a == a.lower()
    assert len(job_name("x" * 200, "op")) <= 63


def test_the_machine_is_the_provider_id_else_the_uid() -> None:
    assert machine_id(MACHINE, "uid-1") == MACHINE
    assert machine_id(None, "uid-1") == "uid:uid-1"
    assert machine_id("", "uid-1") == "uid:uid-1"


def test_the_dcgm_report_is_read_for_failures_and_unreadable_output_is_an_error() -> None:
    ok = parse_dcgm_diag("Successfully ran diagnostic\n" + _report(("PCIe", "Pass", None)))
    assert ok.passed and ok.tests == 1
    bad = parse_dcgm_diag(_report(("PCIe", "Pass", None), ("GPU Memory", "Fail", "GPU 0: DBE")))
    assert not bad.passed and bad.failures == ("Hardware/GPU Memory (GPU 0): GPU 0: DBE",)
    with pytest.raises(ValueError, match="run with -j"):
        parse_dcgm_diag("Error: unable to connect to host engine")
    with pytest.raises(ValueError, match="test_categories"):
        parse_dcgm_diag('{"something": 1}')


def _view(**kw: object) -> JobView:
    return JobView(name="j", pod="j-abc", pod_node="gpu-node-1", node_machine=MACHINE, **kw)  # type: ignore[arg-type]


def test_a_node_passes_only_on_a_complete_job_with_a_clean_report_from_this_machine() -> None:
    clean = _report(("PCIe", "Pass", None))
    passed = judge_qualification(
        _view(conditions={"Complete": "True"}, pod_phase="Succeeded", exit_code=0, log=clean),
        "gpu-node-1",
        MACHINE,
    )
    assert passed.state == QualificationState.PASSED
    # Same report, but the node is now another machine (replaced under the same name): not a pass.
    other = _view(conditions={"Complete": "True"}, pod_phase="Succeeded", log=clean)
    other = other.model_copy(update={"node_machine": "aws:///zone-a/i-new"})
    assert judge_qualification(other, "gpu-node-1", MACHINE).state == QualificationState.FAILED
    # Exit code 0 with a failing test: the report wins.
    lying = _view(conditions={"Complete": "True"}, pod_phase="Succeeded", log=_report(("PCIe", "Fail", "x")))
    assert judge_qualification(lying, "gpu-node-1", MACHINE).state == QualificationState.FAILED
    running = _view(pod_phase="Running")
    assert judge_qualification(running, "gpu-node-1", MACHINE).state == QualificationState.RUNNING


def test_failures_name_why_deadline_unschedulable_and_failed_tests() -> None:
    deadline = _view(conditions={"Failed": "True"}, condition_reasons={"Failed": "DeadlineExceeded"})
    assert "deadline" in judge_qualification(deadline, "gpu-node-1", MACHINE).detail
    pending = JobView(
        name="j", pod="j-abc", pod_phase="Pending", unschedulable="0/4 nodes: 1 Insufficient nvidia.com/gpu"
    )
    verdict = judge_qualification(pending, "gpu-node-1", MACHINE)
    assert (
        verdict.state == QualificationState.FAILED and "cannot get all of gpu-node-1's GPUs" in verdict.detail
    )
    failed = _view(
        conditions={"Failed": "True"},
        pod_phase="Failed",
        exit_code=226,
        log=_report(("PCIe", "Fail", "GPU 0: Xid 79")),
    )
    verdict = judge_qualification(failed, "gpu-node-1", MACHINE)
    assert verdict.state == QualificationState.FAILED and "Xid 79" in verdict.detail
    gone = JobView(name="j", exists=False)
    assert judge_qualification(gone, "gpu-node-1", MACHINE).state == QualificationState.FAILED


def _record(at: float, wf: str) -> RemediationRecord:
    return RemediationRecord(op_id=f"op-{wf}", at=at, node="gpu-node-1", workflow_id=wf)


def test_the_loop_cap_stops_the_third_remediation_inside_the_window() -> None:
    now = 10 * DAY
    history = [_record(now - 3 * DAY, "a"), _record(now - 1 * DAY, "b")]
    assert remediation_gate(history[:1], now, cap=2, window_s=7 * DAY).allowed
    third = remediation_gate(history, now, cap=2, window_s=7 * DAY)
    assert not third.allowed and third.in_window == 2 and "an operator decides" in third.reason
    # Outside the window they no longer count; the current incident's own rows never count.
    assert remediation_gate(history, now + 5 * DAY, cap=2, window_s=7 * DAY).allowed
    assert remediation_gate(history, now, cap=2, window_s=7 * DAY, current_workflow="b").allowed


def test_repair_evidence_needs_no_xid_no_gpu_condition_and_every_gpu_offered() -> None:
    assert repaired({"Ready": "True", "GpuXid": "False"}, {"0": 0}, 8, 8)
    assert not repaired({"GpuXid": "True"}, {"0": 0}, 8, 8)
    assert not repaired({}, {"0": 79}, 8, 8)
    assert not repaired({}, {"0": 0}, 8, 7)  # the device plugin still withholds a GPU


def test_a_node_object_is_judged_by_its_machine_then_its_uid() -> None:
    assert identity(MACHINE, "u1", MACHINE, "u1") is Identity.SAME
    assert identity(MACHINE, "u1", MACHINE, "u2") is Identity.RECREATED  # same machine: still quarantined
    assert identity(MACHINE, "u1", "aws:///zone-a/i-new", "u2") is Identity.REPLACED  # a new machine
    assert identity(MACHINE, "u1", None, None) is Identity.GONE


def test_problem_detector_conditions_route_to_the_right_follow_up() -> None:
    kernel = triage_node("gpu-3", now=0, node_conditions={"Ready": "True", "KernelDeadlock": "True"})
    assert kernel.fault_class is FaultClass.DRIVER and kernel.action is Action.RESTART_BM
    assert "kernel" in kernel.evidence[0] and kernel.quarantine
    ro = triage_node("gpu-3", now=0, node_conditions={"ReadonlyFilesystem": "True"})
    assert ro.fault_class is FaultClass.DRIVER
    xid = triage_node("gpu-3", now=0, node_conditions={"GpuXid": "True", "KernelDeadlock": "False"})
    assert xid.fault_class is FaultClass.XID_ECC and "GPU hardware" in xid.follow_up
    calm = triage_node("gpu-3", now=0, node_conditions={"Ready": "True", "KernelDeadlock": "False"})
    assert calm.fault_class is FaultClass.UNKNOWN


def test_a_repaired_machine_is_cleared_of_warm_spares_and_nothing_else() -> None:
    spare = GpuHolder(namespace="inference", pod="llama-spare-a", gpus=2, spare=True)
    serving = GpuHolder(namespace="inference", pod="llama-x", gpus=2, spare=False)
    other = GpuHolder(namespace="batch", pod="trainer-0", gpus=4, spare=False)
    clearing = clear_for_qualification([spare, serving, other])
    assert [h.pod for h in clearing.delete] == ["llama-spare-a"]
    assert [h.pod for h in clearing.operator] == ["llama-x", "trainer-0"]
    assert clear_for_qualification([]).delete == [] and clear_for_qualification([]).operator == []


def test_a_qualification_starts_below_the_fleet_wide_cap_and_queues_at_it_naming_the_running_jobs() -> None:
    free = qualification_slot("gpu-node-3", QualificationSlots(running=["qualify-a"], cap=2))
    assert (
        free.free
        and "1 of 2 qualification Job(s) running fleet-wide: gpu-node-3 qualifies now" in free.reason
    )
    running = [f"qualify-{i}" for i in range(7)]
    queued = qualification_slot("gpu-node-3", QualificationSlots(running=running, cap=7))
    assert not queued.free
    assert queued.reason.startswith("gpu-node-3 queued for qualification: 7 of 7 qualification Job(s)")
    assert "qualify-0, qualify-1, qualify-2, qualify-3, qualify-4 and 2 more" in queued.reason


def test_a_job_is_running_until_its_complete_or_failed_condition_is_true() -> None:
    assert not job_finished({"status": {}})
    assert not job_finished(
        {"status": {"active": 1, "conditions": [{"type": "Suspended", "status": "True"}]}}
    )
    assert not job_finished({"status": {"conditions": [{"type": "Complete", "status": "False"}]}})
    assert job_finished({"status": {"conditions": [{"type": "Complete", "status": "True"}]}})
    assert job_finished({"status": {"conditions": [{"type": "Failed", "status": "True"}]}})
