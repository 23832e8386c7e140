"""Realistic Alertmanager notifications for the alerts fleetmend routes.

``fleetmend alert --example NAME`` prints them, tests and the alert-storm
benchmark post them. Labels are what Prometheus attaches for the shipped rules
in ``deploy/prometheus/rules.yml``; fingerprints are computed the way
Alertmanager computes them, so the same labels always give the same fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# prometheus/common model.LabelSet.Fingerprint: FNV-1a 64 over sorted name/value pairs.
_FNV_OFFSET = 14695981039346656037
_FNV_PRIME = 1099511628211
_SEPARATOR = 0xFF
_GO_ZERO_TIME = "0001-01-01T00:00:00Z"


def alertmanager_fingerprint(labels: dict[str, str]) -> str:
    """The 16-hex-digit fingerprint Alertmanager sends for an alert with these labels."""
    h = _FNV_OFFSET
    for name in sorted(labels):
        for part in (name.encode(), labels[name].encode()):
            for byte in (*part, _SEPARATOR):
                h ^= byte
                h = (h * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


@dataclass(frozen=True)
class Example:
    alertname: str
    summary: str
    labels: dict[str, str]
    # Templates over the labels, like the rule annotations in deploy/prometheus/rules.yml.
    annotations: dict[str, str] = field(default_factory=dict)


_KSM = {"job": "kube-state-metrics", "instance": "10.0.12.4:8080", "service": "kube-state-metrics"}

EXAMPLES: dict[str, Example] = {
    "node-not-ready": Example(
        "KubeNodeNotReady",
        "A GPU node stopped reporting Ready",
        {**_KSM, "severity": "warning", "node": "gpu-node-1", "condition": "Ready", "status": "true"},
        {
            "summary": "Node is not ready.",
            "description": "{node} has been unready for more than 15 minutes.",
            "runbook_url": "https://runbooks.prometheus-operator.dev/runbooks/kubernetes/kubenodenotready",
        },
    ),
    "gpu-xid": Example(
        "FleetmendGPUXidError",
        "DCGM reported Xid 79 (GPU has fallen off the bus)",
        {
            "severity": "critical",
            "job": "dcgm-exporter",
            "instance": "10.0.3.17:9400",
            "Hostname": "gpu-node-1",
            "gpu": "3",
            "UUID": "GPU-5f1c2a3e-8b7d-4c1e-9a0b-2d3e4f5a6b7c",
            "device": "nvidia3",
            "modelName": "NVIDIA H100 80GB HBM3",
            "pci_bus_id": "00000000:4E:00.0",
            "err_code": "79",
            "err_msg": "GPU has fallen off the bus",
        },
        {
            "summary": "GPU {gpu} on {Hostname} reported Xid {err_code}.",
            "description": "Xid {err_code} ({err_msg}) on {UUID}.",
        },
    ),
    "crashloop": Example(
        "KubePodCrashLooping",
        "A serving pod's engine container keeps crashing",
        {
            **_KSM,
            "severity": "warning",
            "namespace": "llm",
            "pod": "llama-70b-0",
            "container": "vllm",
            "reason": "CrashLoopBackOff",
            "uid": "3f0b8c9e-2d41-4a57-9a8e-6c1f0e2b7d45",
        },
        {
            "summary": "Pod is crash looping.",
            "description": 'Pod {namespace}/{pod} ({container}) is in waiting state (reason: "CrashLoopBackOff").',
        },
    ),
    "oomkilled": Example(
        "FleetmendServingPodOOMKilled",
        "An engine container of a serving pod was OOM-killed",
        {**_KSM, "severity": "critical", "namespace": "llm", "pod": "llama-70b-0", "container": "vllm"},
        {
            "summary": "Serving container OOM-killed.",
            "description": "{namespace}/{pod} ({container}) was OOMKilled.",
        },
    ),
    "unroutable": Example(
        "FleetmendServingEndpointUnroutable",
        "A serving pod is running but its endpoint is not ready",
        {**_KSM, "severity": "critical", "namespace": "llm", "pod": "llama-70b-0"},
        {
            "summary": "Serving endpoint unroutable.",
            "description": "{namespace}/{pod} is Running but not Ready: the router cannot send it traffic.",
        },
    ),
    "rank-lost": Example(
        "FleetmendReplicaRankLost",
        "A rank of a multi-node replica group is not ready",
        {**_KSM, "severity": "critical", "namespace": "llm", "pod": "llama-405b-0-1"},
        {
            "summary": "Replica group lost a rank.",
            "description": "{namespace}/{pod} is not ready: its whole replica group cannot serve.",
        },
    ),
    "kv-saturation": Example(
        "FleetmendKVCacheSaturation",
        "A replica's KV cache is near its ceiling",
        {
            "severity": "warning",
            "job": "vllm",
            "namespace": "llm",
            "pod": "llama-70b-1",
            "model_name": "meta-llama/Llama-3.1-70B-Instruct",
        },
        {
            "summary": "KV cache saturating.",
            "description": "{namespace}/{pod} KV cache usage above 95% for 2m.",
        },
    ),
}


def _timestamp(at: datetime) -> str:
    return at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def alert(
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
    *,
    resolved: bool = False,
    starts_at: datetime | None = None,
) -> dict[str, Any]:
    """One alert entry as Alertmanager puts it in ``alerts``."""
    start = starts_at or datetime.now(UTC).replace(microsecond=0)
    return {
        "status": "resolved" if resolved else "firing",
        "labels": labels,
        "annotations": annotations or {},
        "startsAt": _timestamp(start),
        "endsAt": _timestamp(datetime.now(UTC)) if resolved else _GO_ZERO_TIME,
        "generatorURL": f"http://prometheus.monitoring:9090/graph?g0.expr=ALERTS%7Balertname%3D%22{labels.get('alertname', '')}%22%7D",
        "fingerprint": alertmanager_fingerprint(labels),
    }


def notification(alerts: list[dict[str, Any]], *, receiver: str = "fleetmend") -> dict[str, Any]:
    """A webhook notification (payload version 4) for one alert group."""
    label_sets = [a["labels"] for a in alerts]
    common = (
        {k: v for k, v in label_sets[0].items() if all(ls.get(k) == v for ls in label_sets)}
        if label_sets
        else {}
    )
    group_labels = {"alertname": common["alertname"]} if "alertname" in common else {}
    return {
        "receiver": receiver,
        "status": "firing" if any(a["status"] == "firing" for a in alerts) else "resolved",
        "alerts": alerts,
        "groupLabels": group_labels,
        "commonLabels": common,
        "commonAnnotations": {},
        "externalURL": "http://alertmanager.monitoring:9093",
        "version": "4",
        "groupKey": "{}/{}:{" + ", ".join(f'{k}="{v}"' for k, v in sorted(group_labels.items())) + "}",
        "truncatedAlerts": 0,
    }


def example_payload(
    name: str, *, overrides: dict[str, str] | None = None, resolved: bool = False
) -> dict[str, Any]:
    """The notification for example ``name`` (see ``EXAMPLES``), labels overridden as given."""
    if name not in EXAMPLES:
        raise KeyError(f"unknown example {name!r}; choose one of: {', '.join(EXAMPLES)}")
    ex = EXAMPLES[name]
    labels = {"alertname": ex.alertname, **ex.labels, **(overrides or {})}
    annotations = {k: v.format_map(labels) for k, v in ex.annotations.items()}
    return notification([alert(labels, annotations, resolved=resolved)])


def example_alert(name: str, *, overrides: dict[str, str] | None = None) -> dict[str, Any]:
    """One firing alert of example ``name``, with its annotations, labels overridden as given."""
    [one] = example_payload(name, overrides=overrides)["alerts"]
    return one


def noise_alerts(count: int, *, namespace: str = "llm", seed: str = "") -> list[dict[str, Any]]:
    """``count`` alerts of a large Alertmanager group that concern no serving pool.

    The mix an outage of a big cluster sends besides the alerts that matter: node alerts
    for nodes that run no serving pod (or are gone), crash-looping pods that no longer exist,
    node names no Kubernetes object can have, alerts missing the label their rule needs,
    and alerts fleetmend has no rule for. ``seed`` keeps the names of two batches apart.
    """
    out: list[dict[str, Any]] = []
    for i in range(count):
        kind = i % 10
        if kind < 6:
            out.append(example_alert("node-not-ready", overrides={"node": f"cpu-node-{seed}{i}"}))
        elif kind < 8:
            overrides = {"namespace": namespace, "pod": f"batch-job-{seed}{i}", "container": "worker"}
            out.append(example_alert("crashloop", overrides=overrides))
        elif kind == 8:
            out.append(example_alert("node-not-ready", overrides={"node": f"Node_{seed}{i}!"}))
        else:
            labels = {
                "alertname": "NodeFilesystemAlmostOutOfSpace",
                "instance": f"10.1.{i // 250}.{i % 250}:9100",
            }
            out.append(alert({**labels, "severity": "warning", "mountpoint": "/var/lib/kubelet"}))
    return out


def large_group(
    real: list[dict[str, Any]], total: int, *, namespace: str = "llm", seed: str = ""
) -> dict[str, Any]:
    """A ``total``-alert notification with the ``real`` alerts among noise (``noise_alerts``),
    placed in the middle: neither first nor last in the group."""
    noise = noise_alerts(total - len(real), namespace=namespace, seed=seed)
    middle = len(noise) // 2
    return notification(noise[:middle] + real + noise[middle:])
