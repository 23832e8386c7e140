"""Step 8's way back: the qualification Job, its verdict, the machine a quarantine is keyed on,
and the remediation loop cap.

**Qualification = a Kubernetes Job** (``batch/v1``) pinned to the quarantined node (required
node affinity on ``kubernetes.io/hostname``), tolerating fleetmend's quarantine taint and the
cordon, requesting *all* of the node's GPUs (capacity, not allocatable: a GPU the device plugin
withholds as unhealthy means the diagnostic cannot get the whole node, and that is a failure,
not a partial pass), running NVIDIA DCGM diagnostics (default ``dcgmi diag -r 2 -j``, the level
NVSentinel's validation runs) with ``activeDeadlineSeconds`` and ``backoffLimit: 0``.
``job_manifest`` builds it; ``judge_qualification`` reads the outcome from the Job's
conditions, its pod and **the pod's log** (the JSON report ``dcgmi diag -j`` prints on
stdout; no ConfigMap, so the diagnostic needs no API rights of its own).

**Quarantine is keyed on the machine** (``machine_id``: ``spec.providerID``, else the node's
UID): a node re-created under the same name with a new providerID is a new machine; a node
object re-created for the same machine is still the quarantined machine.

**Loop cap** (``remediation_gate``): a machine fleetmend quarantined ``cap`` times within the
window (default 2 in 7 days) is not remediated a third time automatically; an operator
decides, and the ledger's rows for that machine are the history.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleet.slots import SlotDecision, Slots, SlotWork, take_slot
from fleet.vocabulary import GPU_RESOURCE, QUARANTINE_TAINT_KEY

HOSTNAME_LABEL = "kubernetes.io/hostname"
QUALIFICATION_LABEL = "fleetmend.io/qualification"
MACHINE_ANNOTATION = "fleetmend.io/machine"
OPERATION_ANNOTATION = "fleetmend.io/operation-id"
DEFAULT_DCGM_IMAGE = "nvcr.io/nvidia/cloud-native/dcgm:3.3.9-1-ubuntu22.04"


class QualificationState(StrEnum):
    RUNNING = "running"
    PASSED = "passed"
    FAILED = "failed"


class QualificationSpec(BaseModel):
    """How fleetmend qualifies a node (worker configuration; defaults: DCGM level 2, 30 min)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str = Field(
        "fleetmend", min_length=1, description="Where qualification Jobs run (fleetmend's own)"
    )
    image: str = Field(DEFAULT_DCGM_IMAGE, min_length=1)
    level: int = Field(2, ge=1, le=4, description="dcgmi diag -r <level> (1 quick ... 4 extended)")
    command: tuple[str, ...] = Field(
        (), description="Replaces `dcgmi diag -r <level> -j`; it must print dcgmi's JSON report"
    )
    deadline_s: int = Field(1800, ge=10, description="The Job's activeDeadlineSeconds")
    service_account: str | None = None
    concurrency: int = Field(
        8,
        ge=1,
        description="Qualification Jobs running at once, fleet-wide; a node beyond it waits, queued, "
        "in its workflow's status (fleet.qualification.qualification_slot)",
    )

    def container_command(self, gpu_index: int | None = None) -> list[str]:
        """The diagnostic's command; ``gpu_index``: only that GPU (``dcgmi diag -i``). A custom
        ``command`` runs as given: it is the operator's to scope."""
        if self.command:
            return list(self.command)
        scope = ["-i", str(gpu_index)] if gpu_index is not None else []
        return ["dcgmi", "diag", "-r", str(self.level), *scope, "-j"]


# The fleet's qualification Jobs running now (the world's own record: Jobs carrying
# ``QUALIFICATION_LABEL`` in the qualification namespace, not yet Complete or Failed), and the cap.
QualificationSlots = Slots

QUALIFYING = SlotWork(
    running="qualification Job(s) running fleet-wide",
    already="qualification Job(s) already run fleet-wide",
    goes="qualifies now",
    queued_for="qualification",
    starts="it starts when one ends",
)


def job_finished(job: Mapping[str, Any]) -> bool:
    """A Job is finished once its ``Complete`` or ``Failed`` condition is True (batch/v1 JobStatus)."""
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conditions)


def qualification_slot(node: str, slots: QualificationSlots) -> SlotDecision:
    """May ``node``'s qualification Job start now? Bounded remediation fleet-wide: at most ``cap``
    Jobs run at once (a burst of repaired nodes does not start a hundred burn-ins together); beyond
    it the node waits, queued, and says so (``fleet.slots``)."""
    return take_slot(node, slots, QUALIFYING)


def machine_id(provider_id: str | None, uid: str) -> str:
    """The machine a node object stands for: its providerID, else (no cloud provider) its UID."""
    return provider_id if provider_id else f"uid:{uid}"


class Identity(StrEnum):
    SAME = "same"  # the node object that was quarantined
    RECREATED = "recreated"  # a new object for the same machine: still quarantined (quarantine it again)
    REPLACED = "replaced"  # another machine under the same name: a new machine, not this quarantine's
    GONE = "gone"  # no node object of that name right now


def identity(
    quarantined_machine: str, quarantined_uid: str, machine: str | None, uid: str | None
) -> Identity:
    """What the node object named like the quarantined one is now, judged by machine then by uid."""
    if machine is None or uid is None:
        return Identity.GONE
    if machine != quarantined_machine:
        return Identity.REPLACED
    return Identity.SAME if uid == quarantined_uid else Identity.RECREATED


def job_name(node: str, op_id: str) -> str:
    """A DNS-1123 name (<= 63 chars) unique per operation id, readable by node."""
    digest = hashlib.sha256(op_id.encode()).hexdigest()[:8]
    return f"fm-qualify-{node[:40].rstrip('-.')}-{digest}".lower()


def job_manifest(
    spec: QualificationSpec,
    *,
    node: str,
    machine: str,
    gpus: int,
    name: str,
    op_id: str,
    claim: str | None = None,
    gpu_index: int | None = None,
) -> dict[str, Any]:
    """The batch/v1 Job that qualifies ``node`` (``gpus``: the node's GPU capacity). With ``claim``
    (a DRA ResourceClaim that selects one device) it qualifies that device only: the pod claims it
    and runs ``dcgmi diag -i <gpu_index>``; no device-plugin GPUs are asked for."""
    if gpus < 1 and claim is None:
        raise ValueError(f"node {node} advertises no {GPU_RESOURCE} capacity: nothing to qualify")
    labels = {QUALIFICATION_LABEL: "true", "app.kubernetes.io/managed-by": "fleetmend"}
    annotations = {MACHINE_ANNOTATION: machine, OPERATION_ANNOTATION: op_id}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "In", "values": [node]}]}
                    ]
                }
            }
        },
        "tolerations": [
            {"key": QUARANTINE_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
        ],
        "containers": [
            {
                "name": "dcgm-diag",
                "image": spec.image,
                "command": spec.container_command(gpu_index),
                "resources": (
                    {"claims": [{"name": "gpu"}]}
                    if claim
                    else {"limits": {GPU_RESOURCE: str(gpus)}, "requests": {GPU_RESOURCE: str(gpus)}}
                ),
                "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}},
            }
        ],
    }
    if claim:
        pod_spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    if spec.service_account:
        pod_spec["serviceAccountName"] = spec.service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": spec.namespace, "labels": labels, "annotations": annotations},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": spec.deadline_s,
            "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec},
        },
    }


class DiagReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    passed: bool
    tests: int
    failures: tuple[str, ...] = ()


def parse_dcgm_diag(text: str) -> DiagReport:
    """``dcgmi diag -j`` output -> pass/fail and the failing tests' warnings. ValueError when unreadable."""
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON report in the diagnostic's output (was it run with -j?)")
    try:
        doc = json.loads(text[start:])
    except json.JSONDecodeError as exc:
        raise ValueError(f"the diagnostic's JSON report is unreadable: {exc}") from None
    diag = doc.get("DCGM GPU Diagnostic") if isinstance(doc, dict) else None
    if not isinstance(diag, dict) or not isinstance(diag.get("test_categories"), list):
        raise ValueError("the JSON report has no 'DCGM GPU Diagnostic'.test_categories")
    tests = 0
    failures: list[str] = []
    for category in diag["test_categories"]:
        for test in category.get("tests") or []:
            tests += 1
            for result in test.get("results") or []:
                if str(result.get("status", "")).lower() == "fail":
                    warnings = "; ".join(str(w.get("warning", "")) for w in result.get("warnings") or [])
                    gpu = result.get("gpu_id")
                    where = f" (GPU {gpu})" if gpu is not None else ""
                    failures.append(
                        f"{category.get('category')}/{test.get('name')}{where}: {warnings or 'Fail'}"
                    )
    if tests == 0:
        raise ValueError("the JSON report lists no tests")
    return DiagReport(passed=not failures, tests=tests, failures=tuple(failures))


class JobView(BaseModel):
    """What fleetmend read of one qualification Job (activities fill it from the API)."""

    name: str
    exists: bool = True
    conditions: dict[str, str] = Field(default_factory=dict, description="type -> status")
    condition_reasons: dict[str, str] = Field(default_factory=dict)
    pod: str | None = None
    pod_node: str | None = None
    pod_phase: str | None = None
    exit_code: int | None = None
    unschedulable: str | None = Field(None, description="The scheduler's message while the pod is Pending")
    log: str | None = None
    log_error: str | None = None
    node_machine: str | None = Field(None, description="The machine of the node the pod ran on, when read")


class Verdict(BaseModel):
    model_config = ConfigDict(frozen=True)

    state: QualificationState
    detail: str
    failures: tuple[str, ...] = ()


def judge_qualification(view: JobView, node: str, machine: str) -> Verdict:
    """Pass only on a Complete Job whose pod ran on this machine and whose report has no failure."""
    running = QualificationState.RUNNING
    failed = QualificationState.FAILED
    if not view.exists:
        return Verdict(
            state=failed, detail=f"qualification Job {view.name} is gone (deleted by someone else)"
        )
    if view.pod_node is not None and view.pod_node != node:
        return Verdict(state=failed, detail=f"the diagnostic pod ran on {view.pod_node}, not {node}")
    if view.node_machine is not None and view.node_machine != machine:
        return Verdict(
            state=failed,
            detail=f"{node} is now machine {view.node_machine}, not the quarantined {machine}: the result "
            "does not qualify the quarantined machine",
        )
    if view.conditions.get("Failed") == "True":
        reason = view.condition_reasons.get("Failed", "")
        if reason == "DeadlineExceeded":
            why = "did not finish within its deadline"
            if view.unschedulable:
                why += f" (never scheduled: {view.unschedulable})"
            return Verdict(state=failed, detail=f"Job {view.name} {why}")
    report: DiagReport | None = None
    if view.log is not None and view.pod_phase in ("Succeeded", "Failed"):
        try:
            report = parse_dcgm_diag(view.log)
        except ValueError as exc:
            return Verdict(state=failed, detail=f"diagnostic output unreadable: {exc}")
    if view.conditions.get("Complete") == "True":
        if report is None:
            return Verdict(state=running, detail="Job complete; reading the diagnostic's report")
        if not report.passed:  # exit 0 with failures: trust the report, not the exit code
            return Verdict(state=failed, detail=_failed_text(report), failures=report.failures)
        return Verdict(
            state=QualificationState.PASSED, detail=f"DCGM diagnostics passed ({report.tests} tests)"
        )
    if view.conditions.get("Failed") == "True" or view.pod_phase == "Failed":
        if report is not None and report.failures:
            return Verdict(state=failed, detail=_failed_text(report), failures=report.failures)
        code = f" with exit code {view.exit_code}" if view.exit_code is not None else ""
        return Verdict(state=failed, detail=f"diagnostic failed{code}: {view.log_error or 'no report'}")
    if view.unschedulable and "Insufficient" in view.unschedulable:
        # The pod fits nowhere but this node, and this node cannot give it all its GPUs.
        return Verdict(
            state=failed,
            detail=f"the diagnostic cannot get all of {node}'s GPUs ({view.unschedulable}): the device plugin "
            "withholds unhealthy GPUs, or other pods still hold some",
        )
    return Verdict(
        state=running,
        detail=f"Job {view.name}: pod {view.pod or '(not yet created)'} {view.pod_phase or ''}".strip(),
    )


def _failed_text(report: DiagReport) -> str:
    head = "; ".join(report.failures[:3])
    more = f" (+{len(report.failures) - 3} more)" if len(report.failures) > 3 else ""
    return f"DCGM diagnostics failed: {head}{more}"


class RemediationRecord(BaseModel):
    """One quarantine fleetmend performed on a machine, from the ledger."""

    model_config = ConfigDict(frozen=True)

    op_id: str
    at: float
    node: str
    workflow_id: str | None = None
    released: bool = False


class RemediationGate(BaseModel):
    model_config = ConfigDict(frozen=True)

    allowed: bool
    in_window: int
    reason: str


def remediation_gate(
    history: Sequence[RemediationRecord],
    now: float,
    *,
    cap: int,
    window_s: float,
    current_workflow: str | None = None,
) -> RemediationGate:
    """May fleetmend remediate the machine again automatically? Not after ``cap`` within the window."""
    recent = [r for r in history if 0 <= now - r.at < window_s and r.workflow_id != current_workflow]
    days = window_s / 86400
    if len(recent) >= cap:
        when = ", ".join(f"{r.node} by {r.workflow_id or '?'}" for r in recent[-cap:])
        return RemediationGate(
            allowed=False,
            in_window=len(recent),
            reason=f"remediated {len(recent)} time(s) in the last {days:g} day(s) (cap {cap}: {when}); "
            "not remediated again automatically - an operator decides",
        )
    return RemediationGate(
        allowed=True,
        in_window=len(recent),
        reason=f"{len(recent)} earlier remediation(s) in {days:g} day(s), cap {cap}",
    )


def repaired(conditions: Mapping[str, str], xids: Mapping[str, int], capacity: int, allocatable: int) -> bool:
    """Evidence that a repair happened since a failed qualification: no Xid, no GPU problem condition,
    and the device plugin offers every GPU again."""
    return (
        not gpu_problem_conditions(conditions)
        and not any(xids.values())
        and capacity > 0
        and allocatable >= capacity
    )


def gpu_problem_conditions(conditions: Mapping[str, str]) -> list[str]:
    """The node-problem-detector conditions that say a GPU is in trouble (``GpuXid``, ``GpuEcc``,
    ``NvlinkError``...: a type naming xid / gpu / ecc / nvlink, status True)."""
    return sorted(
        ctype
        for ctype, status in conditions.items()
        if status == "True" and any(w in ctype.lower() for w in ("xid", "gpu", "ecc", "nvlink"))
    )


class GpuHolder(BaseModel):
    """A pod holding GPUs on a node (qualification Jobs excluded)."""

    namespace: str
    pod: str
    gpus: int
    spare: bool = Field(description="a warm spare (role label spare, not routed)")
    devices: dict[str, str] = Field(
        default_factory=dict,
        description="resource ID -> health, as the kubelet reports it (kube.allocation.device_health)",
    )


class MachineClearing(BaseModel):
    """What stands between a repaired machine and its qualification (it needs every GPU)."""

    delete: list[GpuHolder] = Field(
        default_factory=list,
        description="warm spares on the quarantined machine: a spare there is no spare (promoting it would "
        "route traffic onto failed hardware); deleted gracefully, their controller re-places them elsewhere "
        "since the node is cordoned",
    )
    operator: list[GpuHolder] = Field(
        default_factory=list,
        description="anything else (a routed replica, another workload): never deleted by fleetmend; the "
        "qualification waits and the operator is told",
    )


def clear_for_qualification(holders: Sequence[GpuHolder]) -> MachineClearing:
    """Split the pods still holding GPUs on a quarantined, repaired machine into the warm spares
    fleetmend deletes and the pods only an operator may move."""
    return MachineClearing(
        delete=[h for h in holders if h.spare], operator=[h for h in holders if not h.spare]
    )
