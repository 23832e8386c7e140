"""Step 8 of the replica-loss procedure: classify the fault and decide the node's way back.

``triage_node(...)`` classifies what broke on a node from the evidence fleetmend
can read - the DCGM exporter's Xid and ECC/row-remap counters, temperature and
NVLink counters, node conditions, and the lost pods' status - into one of:

* ``xid-ecc``   GPU hardware (Xid 46/48/62/64/79/95/109/140/143, DBE, row-remap failure)
* ``fabric``    NVLink / NVSwitch (Xid 74, 144-150, NVLink error counters)
* ``driver``    driver / GSP firmware / kernel (Xid 119/120, driver conditions, NPD's ``KernelDeadlock`` and
                ``ReadonlyFilesystem``, device admission errors)
* ``thermal``   over temperature or thermal clock slowdown (clock-event reasons)
* ``application`` the engine, not the GPU (Xid 13/31/32/43/45/68/94, OOMKilled, crash loop)
* ``unknown``   the node went silent with no readable evidence

The Xid rows follow NVIDIA's Xid catalog as summarised in reference
fleet-protocols.md §5 (immediate action per Xid). The result carries the
follow-up procedure an operator (or a remediation system) runs, and whether the
node is quarantined (cordon + taint + label): every class except
``application`` - the GPU is fine there and the node stays in the pool.

**Repeat faults**: a node remediated within the repeat window (default 7 days,
``fleetmend.io/remediated-at``) needs an operator; ``return_decision`` never
returns it automatically. Otherwise a node returns only after its
qualification check passed - never on a clean ``nvidia-smi`` alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_metrics import CLOCK_EVENT_HW_THERMAL, CLOCK_EVENT_SW_THERMAL, NodeGpuTelemetry
from fleet.qualification import QualificationState


class FaultClass(StrEnum):
    XID_ECC = "xid-ecc"
    FABRIC = "fabric"
    DRIVER = "driver"
    THERMAL = "thermal"
    APPLICATION = "application"
    UNKNOWN = "unknown"


class Action(StrEnum):
    """NVIDIA resolution buckets (immediate action)."""

    RESTART_BM = "RESTART_BM"  # power-cycle the bare-metal node
    RESET_GPU = "RESET_GPU"
    RESTART_APP = "RESTART_APP"
    CHECK_MECHANICALS = "CHECK_MECHANICALS"
    INVESTIGATE = "INVESTIGATE"
    IGNORE = "IGNORE"


class XidInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    mnemonic: str
    fault_class: FaultClass | None  # None = informational, not a fault by itself
    action: Action


def _x(mnemonic: str, cls: FaultClass | None, action: Action) -> XidInfo:
    return XidInfo(mnemonic=mnemonic, fault_class=cls, action=action)


_A, _H, _F, _D = FaultClass.APPLICATION, FaultClass.XID_ECC, FaultClass.FABRIC, FaultClass.DRIVER
XID_TABLE: dict[int, XidInfo] = {
    13: _x("GR_EXCEPTION", _A, Action.RESTART_APP),
    31: _x("FIFO_ERROR_MMU_ERR_FLT (GPU memory page fault)", _A, Action.RESTART_APP),
    32: _x("PBDMA_ERROR (corrupted push buffer; PCI quality)", _A, Action.RESTART_APP),
    43: _x("RESETCHANNEL_VERIF_ERROR (GPU stopped processing; GPU healthy)", _A, Action.IGNORE),
    45: _x("PREEMPTIVE_REMOVAL (secondary: follow the primary Xid)", _A, Action.IGNORE),
    46: _x("GPU_TIMEOUT_ERROR", _H, Action.RESET_GPU),
    48: _x("GPU_ECC_DBE (double-bit ECC error)", _H, Action.RESET_GPU),
    61: _x("PMU_BREAKPOINT", _H, Action.INVESTIGATE),
    62: _x("PMU_HALT_ERROR", _H, Action.RESET_GPU),
    63: _x("INFOROM_DRAM_RETIREMENT_EVENT (row remap pending)", None, Action.IGNORE),
    64: _x("INFOROM_DRAM_RETIREMENT_FAILURE (row remap failure)", _H, Action.RESET_GPU),
    68: _x("NVDEC/video engine error (application)", _A, Action.RESTART_APP),
    74: _x("NVLINK_ERROR", _F, Action.RESET_GPU),
    79: _x("GPU_HAS_FALLEN_OFF_THE_BUS", _H, Action.RESTART_BM),
    92: _x("EXCESSIVE_SBE_INTERRUPTS (high single-bit ECC rate)", None, Action.IGNORE),
    94: _x("CONTAINED_ERROR (contained memory error)", _A, Action.RESTART_APP),
    95: _x("UNCONTAINED_ERROR (uncontained memory error)", _H, Action.RESET_GPU),
    109: _x("CTXSW_TIMEOUT_ERROR", _H, Action.RESET_GPU),
    119: _x("GSP_RPC_TIMEOUT", _D, Action.RESET_GPU),
    120: _x("GSP_ERROR", _D, Action.RESET_GPU),
    140: _x("UNRECOVERABLE_ECC_ERROR_ESCAPE", _H, Action.RESET_GPU),
    143: _x("GPU_INIT_ERROR", _H, Action.RESET_GPU),
    154: _x("GPU_RECOVERY_ACTION_CHANGED", None, Action.IGNORE),
    **{x: _x(f"NVLINK5 error (Xid {x})", _F, Action.RESET_GPU) for x in range(144, 151)},
}

# Most severe first: the class of a multi-symptom fault is the worst one seen.
_PRECEDENCE = (
    FaultClass.XID_ECC,
    FaultClass.FABRIC,
    FaultClass.DRIVER,
    FaultClass.THERMAL,
    FaultClass.APPLICATION,
    FaultClass.UNKNOWN,
)
_ACTION_SEVERITY = (Action.RESTART_BM, Action.RESET_GPU, Action.CHECK_MECHANICALS, Action.INVESTIGATE)

FOLLOW_UP: dict[FaultClass, str] = {
    FaultClass.XID_ECC: (
        "GPU hardware: drain the node, reset the GPU (nvidia-smi -r; power-cycle for Xid 79); if the error "
        "persists reboot, then open an RMA; qualify with dcgmi diag -r 3 before it returns"
    ),
    FaultClass.FABRIC: (
        "NVLink fabric: reset the GPUs and restart Fabric Manager, check the link peer (errors can be "
        "sympathetic); qualify with dcgmi diag and an NCCL all-reduce test across the domain"
    ),
    FaultClass.DRIVER: (
        "driver/firmware: collect nvidia-bug-report, reset the GPU; if it persists reload or upgrade the "
        "driver/GSP firmware; qualify with dcgmi diag -r 3"
    ),
    FaultClass.THERMAL: (
        "thermal: check cooling, fans and airflow (CHECK_MECHANICALS), then qualify under sustained load "
        "(dcgmi diag -r 3) watching temperature and throttle reasons"
    ),
    FaultClass.APPLICATION: (
        "application: restart the engine; the GPU is healthy and the node stays in the pool - if the same "
        "GPU repeats the error, treat it as hardware"
    ),
    FaultClass.UNKNOWN: (
        "unknown: the node went silent - check it out of band (BMC), power-cycle, collect kernel and "
        "driver logs; qualify before it returns"
    ),
}


# node-problem-detector kernel-monitor conditions (True = the problem stands) and what they mean.
KERNEL_CONDITIONS: dict[str, str] = {
    "KernelDeadlock": "a task hung in the kernel (the driver's ioctl can be the one stuck)",
    "ReadonlyFilesystem": "the root filesystem was remounted read-only",
}


class PodFault(BaseModel):
    """Status of a lost pod that bears on the fault class."""

    model_config = ConfigDict(frozen=True)

    pod: str
    terminated_reason: str | None = None  # OOMKilled, Error, ...
    waiting_reason: str | None = None  # CrashLoopBackOff, ...
    status_reason: str | None = None  # Evicted, NodeLost, UnexpectedAdmissionError, ...
    exit_code: int | None = None


class TriageThresholds(BaseModel):
    model_config = ConfigDict(frozen=True)

    thermal_limit_c: float = Field(default=88.0, gt=0)
    nvlink_errors: float = Field(
        default=100.0, ge=0, description="NVLink error counter total that counts as a fault"
    )
    repeat_window_s: float = Field(default=7 * 24 * 3600.0, gt=0)


class TriageResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    node: str
    fault_class: FaultClass
    action: Action
    xids: dict[str, int] = Field(default_factory=dict, description="GPU -> Xid")
    evidence: tuple[str, ...] = ()
    follow_up: str
    quarantine: bool
    repeat_fault: bool
    needs_operator: bool
    reason: str


def is_repeat_fault(remediated_at: float | None, now: float, window_s: float) -> bool:
    """Was the node remediated within the window before ``now``?"""
    return remediated_at is not None and 0 <= now - remediated_at < window_s


def _hint_evidence(hint: str) -> tuple[FaultClass | None, int | None]:
    h = hint.strip().lower()
    if h.startswith("gpu-xid"):
        _, _, code = h.partition(":")
        return (None, int(code)) if code.isdigit() else (FaultClass.XID_ECC, None)
    return {
        "thermal": (FaultClass.THERMAL, None),
        "nvlink-error": (FaultClass.FABRIC, None),
        "pod-oomkilled": (FaultClass.APPLICATION, None),
        "wedged-engine": (FaultClass.APPLICATION, None),
        "bad-rollout": (FaultClass.APPLICATION, None),
    }.get(h, (None, None))


def triage_node(
    node: str,
    now: float,
    telemetry: NodeGpuTelemetry | None = None,
    node_conditions: Mapping[str, str] | None = None,
    pods: Iterable[PodFault] = (),
    remediated_at: float | None = None,
    hint: str | None = None,
    thresholds: TriageThresholds | None = None,
) -> TriageResult:
    """Classify the node's fault. ``node_conditions``: type -> "True"/"False"/"Unknown"."""
    t = thresholds or TriageThresholds()
    conditions = dict(node_conditions or {})
    found: dict[FaultClass, list[str]] = {c: [] for c in _PRECEDENCE}
    actions: list[Action] = []
    xids: dict[str, int] = {}

    def xid_evidence(where: str, xid: int) -> None:
        info = XID_TABLE.get(xid)
        if info is None:
            found[FaultClass.XID_ECC].append(f"{where}: Xid {xid} (not in the catalog table)")
            actions.append(Action.INVESTIGATE)
        elif info.fault_class is None:
            found[FaultClass.UNKNOWN].append(f"{where}: Xid {xid} {info.mnemonic} (informational)")
        else:
            found[info.fault_class].append(f"{where}: Xid {xid} {info.mnemonic} -> {info.action.value}")
            actions.append(info.action)

    for gpu in telemetry.gpus if telemetry else ():
        where = f"GPU {gpu.gpu}"
        if gpu.last_xid:
            xids[gpu.gpu] = gpu.last_xid
            xid_evidence(where, gpu.last_xid)
        if (gpu.ecc_dbe_volatile or 0) > 0:
            found[FaultClass.XID_ECC].append(
                f"{where}: {gpu.ecc_dbe_volatile:g} uncorrectable (DBE) ECC errors"
            )
            actions.append(Action.RESET_GPU)
        if (gpu.row_remap_failure or 0) > 0:
            found[FaultClass.XID_ECC].append(f"{where}: row remap failure")
            actions.append(Action.RESET_GPU)
        if (gpu.remapped_rows_uncorrectable or 0) > 0 and not gpu.last_xid:
            found[FaultClass.XID_ECC].append(
                f"{where}: {gpu.remapped_rows_uncorrectable:g} rows remapped for uncorrectable errors"
            )
        if gpu.nvlink_errors is not None and gpu.nvlink_errors >= t.nvlink_errors > 0:
            found[FaultClass.FABRIC].append(f"{where}: {gpu.nvlink_errors:g} NVLink errors")
            actions.append(Action.RESET_GPU)
        if gpu.temperature_c is not None and gpu.temperature_c >= t.thermal_limit_c:
            found[FaultClass.THERMAL].append(f"{where}: {gpu.temperature_c:g} C >= {t.thermal_limit_c:g} C")
            actions.append(Action.CHECK_MECHANICALS)
        elif (gpu.clock_event_reasons or 0) & (CLOCK_EVENT_SW_THERMAL | CLOCK_EVENT_HW_THERMAL):
            found[FaultClass.THERMAL].append(
                f"{where}: clocks held down for temperature ({gpu.temperature_c} C)"
            )
            actions.append(Action.CHECK_MECHANICALS)
        elif (gpu.thermal_violation_us or 0) > 0:
            found[FaultClass.THERMAL].append(
                f"{where}: thermal throttling for {gpu.thermal_violation_us:g} us"
            )
            actions.append(Action.CHECK_MECHANICALS)

    for ctype, status in conditions.items():
        low = ctype.lower()
        if ctype == "Ready":
            if status != "True":
                state = "Unknown (kubelet silent)" if status == "Unknown" else "False"
                found[FaultClass.UNKNOWN].append(f"node Ready={state}")
            continue
        if status != "True":  # problem conditions (node-problem-detector style) are True when bad
            continue
        if ctype in KERNEL_CONDITIONS:
            # node-problem-detector's kernel monitor: the OS under the driver is wedged or read-only.
            found[FaultClass.DRIVER].append(
                f"node condition {ctype}=True (kernel: {KERNEL_CONDITIONS[ctype]})"
            )
            actions.append(Action.RESTART_BM)
        elif "thermal" in low or "temperature" in low:
            found[FaultClass.THERMAL].append(f"node condition {ctype}=True")
            actions.append(Action.CHECK_MECHANICALS)
        elif "nvlink" in low or "fabric" in low:
            found[FaultClass.FABRIC].append(f"node condition {ctype}=True")
        elif "driver" in low or "gsp" in low:
            found[FaultClass.DRIVER].append(f"node condition {ctype}=True")
        elif "xid" in low or "ecc" in low or "gpu" in low:
            found[FaultClass.XID_ECC].append(f"node condition {ctype}=True")

    for pod in pods:
        if pod.terminated_reason == "OOMKilled":
            found[FaultClass.APPLICATION].append(f"pod {pod.pod} OOMKilled")
            actions.append(Action.RESTART_APP)
        if pod.waiting_reason == "CrashLoopBackOff":
            found[FaultClass.APPLICATION].append(f"pod {pod.pod} in CrashLoopBackOff")
            actions.append(Action.RESTART_APP)
        if pod.status_reason == "UnexpectedAdmissionError":
            found[FaultClass.DRIVER].append(
                f"pod {pod.pod} UnexpectedAdmissionError (device plugin / driver)"
            )

    if hint:
        cls, xid = _hint_evidence(hint)
        if xid is not None and not xids:
            xids["unknown-gpu"] = xid
            xid_evidence("alert", xid)
        elif cls is not None and not any(found[c] for c in _PRECEDENCE if c is not FaultClass.UNKNOWN):
            found[cls].append(f"alert hint {hint!r}")

    fault_class = next(
        (c for c in _PRECEDENCE if c is not FaultClass.UNKNOWN and found[c]), FaultClass.UNKNOWN
    )
    action = next((a for a in _ACTION_SEVERITY if a in actions), None)
    if action is None:
        action = Action.RESTART_APP if fault_class is FaultClass.APPLICATION else Action.INVESTIGATE
    evidence = tuple(e for c in _PRECEDENCE for e in found[c])
    if not evidence:
        evidence = ("no Xid, ECC, thermal, fabric, driver or pod evidence readable",)
    repeat = is_repeat_fault(remediated_at, now, t.repeat_window_s)
    quarantine = fault_class is not FaultClass.APPLICATION
    reason = f"{node}: {fault_class.value} ({evidence[0]}); immediate action {action.value}"
    if repeat and remediated_at is not None:
        days = (now - remediated_at) / 86400
        reason += (
            f"; repeat fault: remediated {days:.1f} day(s) ago, within the "
            f"{t.repeat_window_s / 86400:g}-day window - needs an operator"
        )
    return TriageResult(
        node=node,
        fault_class=fault_class,
        action=action,
        xids=xids,
        evidence=evidence,
        follow_up=FOLLOW_UP[fault_class],
        quarantine=quarantine or repeat,
        repeat_fault=repeat,
        needs_operator=repeat,
        reason=reason,
    )


class ReturnDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    return_to_pool: bool
    needs_operator: bool
    reason: str


def return_decision(triage: TriageResult, qualification: QualificationState | None) -> ReturnDecision:
    """May the quarantined node go back into the pool (uncordon, untaint)?"""
    if not triage.quarantine:
        return ReturnDecision(
            return_to_pool=True, needs_operator=False, reason="not quarantined (application fault)"
        )
    if triage.repeat_fault:
        return ReturnDecision(
            return_to_pool=False,
            needs_operator=True,
            reason=f"{triage.node} is a repeat fault: an operator decides, whatever the qualification says",
        )
    if qualification is QualificationState.PASSED:
        return ReturnDecision(
            return_to_pool=True, needs_operator=False, reason=f"{triage.node} passed qualification"
        )
    if qualification is QualificationState.FAILED:
        return ReturnDecision(
            return_to_pool=False,
            needs_operator=True,
            reason=f"{triage.node} failed qualification: stays quarantined; follow-up: {triage.follow_up}",
        )
    return ReturnDecision(
        return_to_pool=False,
        needs_operator=False,
        reason=f"{triage.node} stays quarantined until its qualification check passes",
    )
