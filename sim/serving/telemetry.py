"""Node telemetry as dcgm-exporter shows it, and cluster state as kube-state-metrics shows it.

DCGM (NVIDIA/dcgm-exporter, reference §4): per GPU, with labels ``gpu``, ``UUID``,
``pci_bus_id``, ``device``, ``modelName``, ``Hostname`` (+ ``pod``/``namespace``/
``container`` for GPUs a pod holds). ``DCGM_FI_DEV_XID_ERRORS`` is a gauge holding
the *last* Xid (with ``err_code``/``err_msg``) until the driver restarts. ECC
counters are exported as counters with their upper-case ``_TOTAL`` names, the way
the Go client prints them — ``prometheus_client`` cannot produce such names, so
this one page is rendered here (in the Go client's format) and verified with
``prometheus_client``'s parser in the tests.

kube-state-metrics: the handful of series fleetmend's alert rules use
(``kube_node_status_condition``, ``kube_node_spec_unschedulable``,
``kube_pod_status_ready``, ``kube_pod_container_status_waiting_reason``,
``kube_pod_container_status_last_terminated_reason``,
``kube_pod_container_status_restarts_total``, ``kube_pod_info``), built with
``prometheus_client`` from the cluster objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from fleet.vocabulary import GPU_RESOURCE
from sim.clock import parse_timestamp
from sim.k8s.devices import gpu_uuid
from sim.serving.kubeview import KubeView

Obj = dict[str, Any]

# Xid -> dcgm-exporter err_msg (from dcgm's xid text table).
XID_MESSAGES: dict[int, str] = {
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    32: "Invalid or corrupted push buffer stream",
    43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors -- Most likely to see when running multiple cuda applications and hitting a DBE",
    46: "GPU stopped processing",
    48: "Double Bit ECC Error",
    62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLink Error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    109: "Context Switch Timeout Error",
    119: "GSP RPC Timeout",
    120: "GSP Error",
    140: "Unrecovered ECC Error",
    143: "GPU Initialization Failure",
}
# Application-class Xids: the k8s device plugin keeps the GPU healthy (reference §5).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
# Informational: nothing crashes.
INFORMATIONAL_XIDS = frozenset({43, 63, 92})

CLOCK_EVENT_SW_THERMAL = 0x20
CLOCK_EVENT_HW_THERMAL = 0x40


@dataclass
class GpuState:
    index: int
    uuid: str
    pci_bus_id: str
    last_xid: int = 0
    ecc_sbe_vol: int = 0
    ecc_dbe_vol: int = 0
    ecc_sbe_agg: int = 0
    ecc_dbe_agg: int = 0
    nvlink_crc_errors: int = 0
    nvlink_replay_errors: int = 0
    remapped_uncorrectable: int = 0
    row_remap_failure: int = 0
    temp_c: float = 38.0
    clock_events: int = 0
    thermal_violation_us: float = 0.0  # accumulated while throttled (up to thermal_since)
    thermal_since: float | None = None
    remapped_correctable: int = 0
    nvlink_crc_data_errors: int = 0
    nvlink_recovery_errors: int = 0
    broken: str | None = None  # hardware fault that survives a process restart
    under_load_defect: str | None = None  # idles clean (no Xid, clean series); fails when loaded


@dataclass
class NodeTelemetry:
    node: str
    product: str
    gpus: list[GpuState] = field(default_factory=list)

    @classmethod
    def for_node(cls, node: str, count: int, product: str) -> NodeTelemetry:
        gpus = []
        for i in range(count):
            gpus.append(
                GpuState(index=i, uuid=gpu_uuid(node, i), pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0")
            )
        return cls(node=node, product=product, gpus=gpus)

    def healthy(self) -> bool:
        return all(g.broken is None for g in self.gpus) and not any(g.clock_events for g in self.gpus)

    def problems(self) -> list[str]:
        out = [f"GPU {g.index}: {g.broken}" for g in self.gpus if g.broken]
        out += [f"GPU {g.index}: thermal slowdown at {g.temp_c:g} C" for g in self.gpus if g.clock_events]
        return out


def node_gpu_count(node: Obj) -> int:
    """The node's GPUs: its ``nvidia.com/gpu`` capacity, or (DRA: no such capacity) GPU feature discovery's
    ``nvidia.com/gpu.count`` label."""
    capacity = (node.get("status") or {}).get("capacity") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    try:
        return int(capacity.get(GPU_RESOURCE, labels.get("nvidia.com/gpu.count", 0)))
    except (TypeError, ValueError):
        return 0


def node_gpu_product(node: Obj) -> str:
    labels = node.get("metadata", {}).get("labels") or {}
    return labels.get("nvidia.com/gpu.product", "NVIDIA H100 80GB HBM3").replace("-", " ")


def pod_gpu_request(pod: Obj) -> int:
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        value = (
            (res.get("limits") or {}).get(GPU_RESOURCE) or (res.get("requests") or {}).get(GPU_RESOURCE) or 0
        )
        try:
            total += int(value)
        except (TypeError, ValueError):
            pass
    return total


def gpu_assignment(kube: KubeView, node: str) -> dict[int, Obj]:
    """Which pod holds each GPU index of a node: the indices the device plugin gave a pod when it was
    bound (kept until it ends), or a DRA pod's allocated claim devices (``gpu-<i>`` is index ``i``)."""
    obj = kube.node(node)
    capacity = node_gpu_count(obj) if obj is not None else 0
    return kube.devices.assignment(node, kube.pods(), capacity)


def _labels(pairs: dict[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs.items()) + "}"


def render_dcgm(
    tel: NodeTelemetry, holders: dict[int, Obj], utilisation: dict[int, float], now: float
) -> bytes:
    """dcgm-exporter's page for one node, in the Go client's text format."""

    def violation_us(g: GpuState) -> float:
        running = (now - g.thermal_since) * 1e6 if g.thermal_since is not None else 0.0
        return g.thermal_violation_us + max(0.0, running)

    families: list[tuple[str, str, str, list[tuple[dict[str, str], float]]]] = []

    def base(g: GpuState) -> dict[str, str]:
        labels = {
            "gpu": str(g.index),
            "UUID": g.uuid,
            "pci_bus_id": g.pci_bus_id,
            "device": f"nvidia{g.index}",
            "modelName": tel.product,
            "Hostname": tel.node,
        }
        pod = holders.get(g.index)
        if pod is not None:
            labels.update(
                container=((pod.get("spec") or {}).get("containers") or [{}])[0].get("name", "vllm"),
                namespace=pod["metadata"]["namespace"],
                pod=pod["metadata"]["name"],
            )
        return labels

    def fam(name: str, kind: str, help_text: str, value_of: Any, extra: Any = None) -> None:
        samples = []
        for g in tel.gpus:
            labels = base(g)
            if extra is not None:
                labels.update(extra(g))
            samples.append((labels, float(value_of(g))))
        families.append((name, kind, help_text, samples))

    fam("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda g: g.temp_c)
    fam(
        "DCGM_FI_DEV_POWER_USAGE",
        "gauge",
        "Power draw (in W).",
        lambda g: 90.0 + 500.0 * utilisation.get(g.index, 0.0),
    )
    fam(
        "DCGM_FI_DEV_GPU_UTIL",
        "gauge",
        "GPU utilization (in %).",
        lambda g: round(100 * utilisation.get(g.index, 0.0)),
    )
    fam(
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        "gauge",
        "Throttling reasons for GPU clocks.",
        lambda g: g.clock_events,
    )
    fam(
        "DCGM_FI_DEV_XID_ERRORS",
        "gauge",
        "Value of the last XID error encountered.",
        lambda g: g.last_xid,
        lambda g: (
            {"err_code": str(g.last_xid), "err_msg": XID_MESSAGES.get(g.last_xid, "Unknown Error")}
            if g.last_xid
            else {}
        ),
    )
    fam(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "counter",
        "Total number of single-bit volatile ECC errors.",
        lambda g: g.ecc_sbe_vol,
    )
    fam(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "counter",
        "Total number of double-bit volatile ECC errors.",
        lambda g: g.ecc_dbe_vol,
    )
    fam(
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "counter",
        "Total number of single-bit persistent ECC errors.",
        lambda g: g.ecc_sbe_agg,
    )
    fam(
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "counter",
        "Total number of double-bit persistent ECC errors.",
        lambda g: g.ecc_dbe_agg,
    )
    fam(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
        lambda g: g.remapped_uncorrectable,
    )
    fam(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for correctable errors",
        lambda g: g.remapped_correctable,
    )
    fam(
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "gauge",
        "Whether remapping of rows has failed",
        lambda g: g.row_remap_failure,
    )
    fam(
        "DCGM_FI_DEV_THERMAL_VIOLATION",
        "counter",
        "Throttling duration due to thermal constraints (in us).",
        violation_us,
    )
    fam(
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink flow-control CRC errors.",
        lambda g: g.nvlink_crc_errors,
    )
    fam(
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink data CRC errors.",
        lambda g: g.nvlink_crc_data_errors,
    )
    fam(
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink recovery errors.",
        lambda g: g.nvlink_recovery_errors,
    )
    fam(
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink retries.",
        lambda g: g.nvlink_replay_errors,
    )
    lines: list[str] = []
    for name, kind, help_text, samples in families:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{_labels(labels)} {floatToGoString(value)}")
    return ("\n".join(lines) + "\n").encode()


class KubeStateCollector(Collector):
    """kube-state-metrics-style series from the simulated cluster's objects."""

    def __init__(self, kube: KubeView) -> None:
        self.kube = kube

    def collect(self) -> Any:
        node_cond = GaugeMetricFamily(
            "kube_node_status_condition",
            "The condition of a cluster node.",
            labels=["node", "condition", "status"],
        )
        unsched = GaugeMetricFamily(
            "kube_node_spec_unschedulable", "Whether a node can schedule new pods.", labels=["node"]
        )
        taint = GaugeMetricFamily(
            "kube_node_spec_taint", "The taint of a cluster node.", labels=["node", "key", "value", "effect"]
        )
        for node in sorted(self.kube.nodes(), key=lambda n: n["metadata"]["name"]):
            name = node["metadata"]["name"]
            for cond in (node.get("status") or {}).get("conditions") or []:
                for value in ("true", "false", "unknown"):
                    node_cond.add_metric(
                        [name, cond["type"], value],
                        1.0 if str(cond.get("status", "")).lower() == value else 0.0,
                    )
            unsched.add_metric([name], 1.0 if (node.get("spec") or {}).get("unschedulable") else 0.0)
            for t in (node.get("spec") or {}).get("taints") or []:
                taint.add_metric([name, t.get("key", ""), t.get("value", ""), t.get("effect", "")], 1.0)
        ready = GaugeMetricFamily(
            "kube_pod_status_ready", "Describes whether the pod is ready to serve requests.",
            labels=["namespace", "pod", "uid", "condition"],
        )  # fmt: skip
        phase = GaugeMetricFamily(
            "kube_pod_status_phase", "The pods current phase.", labels=["namespace", "pod", "uid", "phase"]
        )
        info = GaugeMetricFamily(
            "kube_pod_info",
            "Information about pod.",
            labels=[
                "namespace",
                "pod",
                "uid",
                "host_ip",
                "pod_ip",
                "node",
                "created_by_kind",
                "created_by_name",
            ],
        )
        waiting = GaugeMetricFamily(
            "kube_pod_container_status_waiting_reason",
            "Describes the reason the container is currently in waiting state.",
            labels=["namespace", "pod", "uid", "container", "reason"],
        )
        last_term = GaugeMetricFamily(
            "kube_pod_container_status_last_terminated_reason",
            "Describes the last reason the container was in terminated state.",
            labels=["namespace", "pod", "uid", "container", "reason"],
        )
        restarts = CounterMetricFamily(
            "kube_pod_container_status_restarts",
            "The number of container restarts per container.",
            labels=["namespace", "pod", "uid", "container"],
        )
        deletion = GaugeMetricFamily(
            "kube_pod_deletion_timestamp", "Unix deletion timestamp", labels=["namespace", "pod", "uid"]
        )
        for pod in sorted(
            self.kube.pods(), key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"])
        ):
            meta: Obj = pod["metadata"]
            spec: Obj = pod.get("spec") or {}
            status: Obj = pod.get("status") or {}
            ns, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
            ready_status = "unknown"
            for cond in status.get("conditions") or []:
                if cond.get("type") == "Ready":
                    ready_status = str(cond.get("status", "Unknown")).lower()
            for s in ("true", "false", "unknown"):
                ready.add_metric([ns, name, uid, s], 1.0 if ready_status == s else 0.0)
            current_phase = status.get("phase", "Pending")
            for p in ("Pending", "Running", "Succeeded", "Failed", "Unknown"):
                phase.add_metric([ns, name, uid, p], 1.0 if current_phase == p else 0.0)
            owner = (meta.get("ownerReferences") or [{}])[0]
            info.add_metric(
                [
                    ns,
                    name,
                    uid,
                    status.get("hostIP", ""),
                    status.get("podIP", ""),
                    spec.get("nodeName", ""),
                    owner.get("kind", "<none>"),
                    owner.get("name", "<none>"),
                ],
                1.0,
            )
            if meta.get("deletionTimestamp"):
                deletion.add_metric([ns, name, uid], parse_timestamp(meta["deletionTimestamp"]))
            for cs in status.get("containerStatuses") or []:
                cname = cs.get("name", "")
                reason = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
                if reason:
                    waiting.add_metric([ns, name, uid, cname, reason], 1.0)
                last = ((cs.get("lastState") or {}).get("terminated") or {}).get("reason")
                if last:
                    last_term.add_metric([ns, name, uid, cname, last], 1.0)
                restarts.add_metric([ns, name, uid, cname], float(cs.get("restartCount", 0)))
        yield from (node_cond, unsched, taint, ready, phase, info, waiting, last_term, restarts, deletion)


def render_kube_state(kube: KubeView) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KubeStateCollector(kube))
    return generate_latest(registry)
