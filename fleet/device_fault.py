"""A fault's scope: one GPU, or the node. Lose one GPU, not eight.

Single-GPU faults (Xid 79 "fallen off the bus", uncorrectable ECC, a row-remap failure, Xid
48/64/95...) are the common hardware event of a GPU fleet. Quarantining the whole node for one
costs every replica on it: 8 GPUs instead of 4 on a node of two TP=4 replicas, 8 instead of 1
on a node of eight TP=1 replicas. ``fault_scope`` decides from the evidence whether the fault
belongs to one device or to the node:

* **device** - exactly one GPU carries hardware evidence (an Xid of the GPU-hardware class, an
  uncorrectable ECC count, a row-remap failure), the node is Ready, its DCGM exporter answers,
  nothing else on it is wrong, and the GPUs already fenced on it stay under the policy's share
  (``max_fraction``, default half: a node losing half its GPUs is a node problem);
* **node** - everything else: the NVLink / NVSwitch fabric (Xid 74, 144-150, NVLink error counts:
  a link has two ends), the driver or kernel (GSP, KernelDeadlock: one driver serves every GPU),
  thermal (cooling is the chassis'), several GPUs at once, a silent kubelet, an unreadable exporter
  (no way to tell which GPU), and the machine's history (the remediation loop cap: a machine that
  keeps failing is the operator's, whole).

A device quarantine keeps the node schedulable and every other replica on it serving. It is
recorded on the node, one annotation per GPU keyed on the GPU's UUID
(``gpu-quarantine.fleetmend.io/<uuid>``; the ledger's effect rows carry the machine), so a
later fault on the same node counts the GPUs already out. On a device-plugin cluster the plugin
already withholds the unhealthy GPU (allocatable drops); on a DRA cluster a DeviceTaintRule
names the one device (``fleet.device_taint``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_metrics import (
    CLOCK_EVENT_HW_THERMAL,
    CLOCK_EVENT_SW_THERMAL,
    GpuTelemetry,
    NodeGpuTelemetry,
)
from fleet.triage import KERNEL_CONDITIONS, XID_TABLE, FaultClass, PodFault, TriageResult, triage_node

if TYPE_CHECKING:
    from fleet.recovery import RecoveryTimings

DEVICE_QUARANTINE_PREFIX = "gpu-quarantine.fleetmend.io/"


class FaultScope(StrEnum):
    DEVICE = "device"
    NODE = "node"
    FENCED = "fenced"  # the only evidence is on GPUs already quarantined: nothing new to do


class DevicePolicy(BaseModel):
    """How far a single-GPU fault reaches (``RecoveryTimings.device_quarantine`` and ``device_fence_max_fraction``)."""

    model_config = ConfigDict(frozen=True)

    device_level: bool = True
    max_fraction: float = Field(0.5, gt=0, le=1.0)
    nvlink_errors: float = 100.0


def device_policy(timings: RecoveryTimings) -> DevicePolicy:
    return DevicePolicy(
        device_level=timings.device_quarantine, max_fraction=timings.device_fence_max_fraction
    )


class FaultedDevice(BaseModel):
    """The one GPU a device-scoped fault belongs to, as DCGM names it."""

    model_config = ConfigDict(frozen=True)

    index: int
    uuid: str
    xid: int | None = None
    evidence: tuple[str, ...] = ()


class ScopeDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    scope: FaultScope
    device: FaultedDevice | None = None
    fenced: tuple[str, ...] = Field(default=(), description="UUIDs of the node's GPUs already quarantined")
    reason: str

    @property
    def spares_node(self) -> bool:
        """The node is not cordoned: one GPU's fault, or only GPUs already fenced."""
        return self.scope is not FaultScope.NODE


def quarantine_annotation(uuid: str) -> str:
    """The node annotation that records one GPU's quarantine (value: ``<fault class>@<unix seconds>``)."""
    return f"{DEVICE_QUARANTINE_PREFIX}{uuid}"


def quarantined_devices(annotations: Mapping[str, str]) -> dict[str, str]:
    """The node's quarantined GPUs (UUID -> record) from its annotations."""
    return {
        k[len(DEVICE_QUARANTINE_PREFIX) :]: v
        for k, v in annotations.items()
        if k.startswith(DEVICE_QUARANTINE_PREFIX)
    }


def hardware_evidence(gpu: GpuTelemetry) -> list[str]:
    """What says this GPU's own hardware failed (the xid-ecc class), in words."""
    out: list[str] = []
    info = XID_TABLE.get(gpu.last_xid or 0)
    if info is not None and info.fault_class is FaultClass.XID_ECC:
        out.append(f"Xid {gpu.last_xid} {info.mnemonic}")
    if (gpu.ecc_dbe_volatile or 0) > 0:
        out.append(f"{gpu.ecc_dbe_volatile:g} uncorrectable ECC errors")
    if (gpu.row_remap_failure or 0) > 0:
        out.append("row remap failure")
    return out


def _node_wide(telemetry: NodeGpuTelemetry, conditions: Mapping[str, str], policy: DevicePolicy) -> list[str]:
    """Evidence that reaches past one GPU: fabric, driver, thermal, kernel."""
    out: list[str] = []
    for gpu in telemetry.gpus:
        info = XID_TABLE.get(gpu.last_xid or 0)
        if info is not None and info.fault_class in (FaultClass.FABRIC, FaultClass.DRIVER):
            out.append(f"GPU {gpu.gpu}: Xid {gpu.last_xid} {info.mnemonic} ({info.fault_class.value})")
        if gpu.nvlink_errors is not None and gpu.nvlink_errors >= policy.nvlink_errors > 0:
            out.append(f"GPU {gpu.gpu}: {gpu.nvlink_errors:g} NVLink errors (fabric)")
        if (gpu.clock_event_reasons or 0) & (CLOCK_EVENT_SW_THERMAL | CLOCK_EVENT_HW_THERMAL):
            out.append(f"GPU {gpu.gpu}: thermal slowdown")
    out.extend(
        f"node condition {c}=True" for c, s in conditions.items() if c in KERNEL_CONDITIONS and s == "True"
    )
    return out


def fault_scope(
    triage: TriageResult,
    telemetry: NodeGpuTelemetry | None,
    conditions: Mapping[str, str],
    *,
    ready: bool | None,
    annotations: Mapping[str, str] | None = None,
    policy: DevicePolicy | None = None,
    history_allows: bool = True,
) -> ScopeDecision:
    """Device or node? (``history_allows``: the machine is under its remediation loop cap.)"""
    p = policy or DevicePolicy()
    node = triage.node
    fenced = quarantined_devices(annotations or {})

    def on_node(why: str) -> ScopeDecision:
        return ScopeDecision(
            scope=FaultScope.NODE, fenced=tuple(sorted(fenced)), reason=f"{node}: {why}: the node path"
        )

    if not p.device_level:
        return on_node("the policy quarantines whole nodes (device_quarantine off)")
    if triage.fault_class is not FaultClass.XID_ECC:
        return on_node(f"the fault class ({triage.fault_class.value}) is not one GPU's")
    if ready is not True:
        return on_node(f"the node is not Ready ({ready})")
    if telemetry is None or not telemetry.gpus:
        return on_node("its DCGM exporter cannot be read, so no single GPU can be named")
    wide = _node_wide(telemetry, conditions, p)
    if wide:
        return on_node("the fault reaches past one GPU (" + "; ".join(wide[:3]) + ")")
    evident = [(g, ev) for g in telemetry.gpus if (ev := hardware_evidence(g))]
    faulted = [(g, ev) for g, ev in evident if (g.uuid or "") not in fenced]
    if evident and not faulted:
        # A fenced GPU's Xid is sticky until its driver restarts: seeing it again is no new fault.
        return ScopeDecision(
            scope=FaultScope.FENCED,
            fenced=tuple(sorted(fenced)),
            reason=f"{node}: the only hardware evidence is on GPU(s) already quarantined "
            f"({', '.join(g.gpu for g, _ in evident)}): nothing new, the node keeps serving",
        )
    if not faulted:
        return on_node("no single GPU carries the hardware evidence")
    if len(faulted) > 1:
        return on_node(
            f"{len(faulted)} GPUs carry hardware evidence ({', '.join(g.gpu for g, _ in faulted)})"
        )
    gpu, evidence = faulted[0]
    if not gpu.uuid or not gpu.gpu.isdigit():
        return on_node(f"GPU {gpu.gpu} has no UUID or index in the exporter's page")
    out = len(fenced) + 1
    if out > p.max_fraction * len(telemetry.gpus):
        return on_node(f"{out} of its {len(telemetry.gpus)} GPUs would be fenced (over {p.max_fraction:.0%})")
    if not history_allows:
        return on_node("the machine is at its remediation loop cap")
    device = FaultedDevice(
        index=int(gpu.gpu), uuid=gpu.uuid, xid=gpu.last_xid or None, evidence=tuple(evidence)
    )
    return ScopeDecision(
        scope=FaultScope.DEVICE,
        device=device,
        fenced=tuple(sorted(fenced)),
        reason=f"{node}: one GPU failed (GPU {gpu.gpu}, {gpu.uuid}: {'; '.join(evidence)}); the node and its "
        "other replicas keep serving: the device path",
    )


def judge_node(
    node: str,
    now: float,
    *,
    telemetry: NodeGpuTelemetry | None,
    conditions: Mapping[str, str],
    ready: bool | None,
    annotations: Mapping[str, str],
    policy: DevicePolicy,
    pods: Iterable[PodFault] = (),
    hint: str | None = None,
    history_allows: bool = True,
) -> tuple[TriageResult, ScopeDecision]:
    """Triage (``fleet.triage``), then the fault's scope: what a fence or a node's hardware path decides on."""
    triage = triage_node(node, now=now, telemetry=telemetry, node_conditions=conditions, pods=pods, hint=hint)
    scope = fault_scope(
        triage,
        telemetry,
        conditions,
        ready=ready,
        annotations=annotations,
        policy=policy,
        history_allows=history_allows,
    )
    return triage, scope


class DraDevice(BaseModel):
    """One device of a node's ResourceSlice (``resource.k8s.io/v1``), as a DRA driver publishes it."""

    model_config = ConfigDict(frozen=True)

    driver: str
    pool: str
    name: str
    uuid: str | None = None
    index: int | None = None

    @property
    def resource_id(self) -> str:
        """How a kubelet names it in ``allocatedResourcesStatus`` (``<driver>/<pool>/<device>``)."""
        return f"{self.driver}/{self.pool}/{self.name}"


def _attribute(attrs: Mapping[str, object], driver: str, key: str) -> object:
    """An attribute by its bare name or qualified by the driver's domain (both are valid in a slice)."""
    raw = attrs.get(key, attrs.get(f"{driver}/{key}"))
    if isinstance(raw, Mapping):
        return next(iter(raw.values()), None)
    return None


def dra_device(raw: Mapping[str, object]) -> DraDevice:
    """A slice device as ``activities.kube_reads.node_devices`` returns it."""
    driver, pool = str(raw["driver"]), str(raw["pool"])
    attrs = raw.get("attributes")
    attrs = attrs if isinstance(attrs, Mapping) else {}
    uuid, index = _attribute(attrs, driver, "uuid"), _attribute(attrs, driver, "index")
    return DraDevice(
        driver=driver,
        pool=pool,
        name=str(raw["name"]),
        uuid=str(uuid) if uuid is not None else None,
        index=int(str(index)) if index is not None else None,
    )


def device_for(devices: Iterable[DraDevice], faulted: FaultedDevice) -> DraDevice | None:
    """The slice device that is the faulted GPU: by UUID, else by index."""
    devices = list(devices)
    return next((d for d in devices if d.uuid == faulted.uuid), None) or next(
        (d for d in devices if d.uuid is None and d.index == faulted.index), None
    )


def holders_of(holders: Iterable[tuple[str, Mapping[str, str]]], ids: Iterable[str]) -> list[str]:
    """The pods (name, resource ID -> health) whose kubelet reports one of ``ids`` allocated to them."""
    wanted = set(ids)
    return sorted(pod for pod, devices in holders if wanted & set(devices))


def fenceable(scope: ScopeDecision, devices: Iterable[DraDevice]) -> ScopeDecision:
    """On a DRA cluster (``devices``: the node's slice) one GPU can be fenced only if its slice names it:
    no device-plugin health check withholds it there. Without it, the node path."""
    devices = list(devices)
    if scope.device is None or not devices or device_for(devices, scope.device) is not None:
        return scope
    return scope.model_copy(
        update={
            "scope": FaultScope.NODE,
            "device": None,
            "reason": f"{scope.reason.split(':', 1)[0]}: its ResourceSlice names no device for "
            f"{scope.device.uuid}, so no DeviceTaintRule can fence that GPU alone: the node path",
        }
    )
