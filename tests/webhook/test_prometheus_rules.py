"""The shipped Prometheus rules fire on the failures they are for, and not on healthy churn.

Run with Prometheus's own rule unit-test engine (``promtool test rules``, Debian
package ``prometheus``) against synthetic kube-state-metrics / DCGM / vLLM series.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules.yml"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
KSM = 'job="kube-state-metrics"'

pytestmark = pytest.mark.skipif(
    not Path(PROMTOOL).exists(),
    reason="SKIPPED LOUDLY: promtool not found — install the Debian package `prometheus` (make system-deps)",
)


def ready(pod: str, values: str, uid: str = "u1") -> dict[str, str]:
    return {
        "series": f'kube_pod_status_ready{{{KSM},namespace="llm",pod="{pod}",uid="{uid}",condition="true"}}',
        "values": values,
    }


def pod_info(pod: str, kind: str, owner: str) -> dict[str, str]:
    return {
        "series": f'kube_pod_info{{{KSM},namespace="llm",pod="{pod}",uid="u1",created_by_kind="{kind}",created_by_name="{owner}"}}',
        "values": "1x40",
    }


TESTS: list[dict[str, Any]] = [
    {  # a node goes NotReady: fires after 15m; a cordoned NotReady node never fires
        "interval": "1m",
        "input_series": [
            {
                "series": f'kube_node_status_condition{{{KSM},node="gpu-node-0",condition="Ready",status="true"}}',
                "values": "1 1 0x30",
            },
            {"series": f'kube_node_spec_unschedulable{{{KSM},node="gpu-node-0"}}', "values": "0x32"},
            {
                "series": f'kube_node_status_condition{{{KSM},node="gpu-node-1",condition="Ready",status="true"}}',
                "values": "1 1 0x30",
            },
            {"series": f'kube_node_spec_unschedulable{{{KSM},node="gpu-node-1"}}', "values": "0 0 1x30"},
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "KubeNodeNotReady", "exp_alerts": []},
            {
                "eval_time": "20m",
                "alertname": "KubeNodeNotReady",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "warning",
                            "job": "kube-state-metrics",
                            "node": "gpu-node-0",
                            "condition": "Ready",
                            "status": "true",
                        },
                        "exp_annotations": {
                            "summary": "Node is not ready.",
                            "description": "gpu-node-0 has been unready for more than 15 minutes.",
                            "runbook_url": "https://runbooks.prometheus-operator.dev/runbooks/kubernetes/kubenodenotready",
                        },
                    }
                ],
            },
        ],
    },
    {  # an Xid appears as a new err_code series: fires at once, resolves 15m later
        "interval": "1m",
        "input_series": [
            {
                "series": 'DCGM_FI_DEV_XID_ERRORS{job="dcgm-exporter",Hostname="gpu-node-2",gpu="3",UUID="GPU-1",modelName="H100"}',
                "values": "0x5 _x30",
            },
            {
                "series": 'DCGM_FI_DEV_XID_ERRORS{job="dcgm-exporter",Hostname="gpu-node-2",gpu="3",UUID="GPU-1",modelName="H100",err_code="79",err_msg="GPU has fallen off the bus"}',
                "values": "_x5 79x30",
            },
        ],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "FleetmendGPUXidError", "exp_alerts": []},
            {
                "eval_time": "7m",
                "alertname": "FleetmendGPUXidError",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "critical",
                            "job": "dcgm-exporter",
                            "Hostname": "gpu-node-2",
                            "gpu": "3",
                            "UUID": "GPU-1",
                            "modelName": "H100",
                            "err_code": "79",
                            "err_msg": "GPU has fallen off the bus",
                        },
                        "exp_annotations": {
                            "summary": "GPU 3 on gpu-node-2 reported Xid 79.",
                            "description": "Xid 79 (GPU has fallen off the bus) on GPU-1 (H100). The replica groups on gpu-node-2 are lost or about to be.",
                        },
                    }
                ],
            },
            {"eval_time": "25m", "alertname": "FleetmendGPUXidError", "exp_alerts": []},
        ],
    },
    {  # a serving pod loses readiness (fires); a new replica warming up and a worker rank do not
        "interval": "1m",
        "input_series": [
            ready("llama-a", "1x5 0x20"),
            pod_info("llama-a", "ReplicaSet", "llama-7f9c"),
            ready("llama-new", "0x25"),
            pod_info("llama-new", "ReplicaSet", "llama-7f9c"),
            ready("llama-405b-0-1", "1x5 0x20"),
            pod_info("llama-405b-0-1", "StatefulSet", "llama-405b-0"),
            ready("llama-405b-1", "1x5 0x20"),
            pod_info("llama-405b-1", "StatefulSet", "llama-405b"),
        ],
        "alert_rule_test": [
            {
                "eval_time": "10m",
                "alertname": "FleetmendServingEndpointUnroutable",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "critical", "namespace": "llm", "pod": pod},
                        "exp_annotations": {
                            "summary": "Serving endpoint unroutable.",
                            "description": f"llm/{pod} was Ready and is not: the router cannot send it traffic.",
                        },
                    }
                    for pod in ("llama-405b-1", "llama-a")  # an LWS leader is an endpoint too
                ],
            },
            {
                "eval_time": "10m",
                "alertname": "FleetmendReplicaRankLost",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "critical", "namespace": "llm", "pod": "llama-405b-0-1"},
                        "exp_annotations": {
                            "summary": "Replica group lost a rank.",
                            "description": "llm/llama-405b-0-1 is not ready: its whole replica group cannot serve.",
                        },
                    }
                ],
            },
        ],
    },
    {  # OOMKilled with a restart, and KV saturation held for 2 minutes
        "interval": "1m",
        "input_series": [
            {
                "series": f'kube_pod_container_status_last_terminated_reason{{{KSM},namespace="llm",pod="p",uid="u",container="vllm",reason="OOMKilled"}}',
                "values": "_x3 1x10",
            },
            {
                "series": f'kube_pod_container_status_restarts_total{{{KSM},namespace="llm",pod="p",uid="u",container="vllm"}}',
                "values": "0x3 1x10",
            },
            {
                "series": 'vllm:kv_cache_usage_perc{job="vllm",namespace="llm",pod="q",model_name="m",engine="0"}',
                "values": "0.5x3 0.97x10",
            },
        ],
        "alert_rule_test": [
            {
                "eval_time": "5m",
                "alertname": "FleetmendServingPodOOMKilled",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "critical",
                            "job": "kube-state-metrics",
                            "namespace": "llm",
                            "pod": "p",
                            "uid": "u",
                            "container": "vllm",
                            "reason": "OOMKilled",
                        },
                        "exp_annotations": {
                            "summary": "Serving container OOM-killed.",
                            "description": "llm/p (vllm) was OOMKilled and restarted.",
                        },
                    }
                ],
            },
            {"eval_time": "4m", "alertname": "FleetmendKVCacheSaturation", "exp_alerts": []},
            {
                "eval_time": "7m",
                "alertname": "FleetmendKVCacheSaturation",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "warning",
                            "namespace": "llm",
                            "pod": "q",
                            "model_name": "m",
                        },
                        "exp_annotations": {
                            "summary": "KV cache saturating.",
                            "description": "llm/q KV cache usage is 97%.",
                        },
                    }
                ],
            },
        ],
    },
]


def test_shipped_rules_fire_on_the_failures_they_are_for(tmp_path: Path) -> None:
    spec = tmp_path / "rules_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": TESTS}))
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_shipped_rules_and_config_pass_promtool_check() -> None:
    config = RULES.with_name("prometheus.yml")
    result = subprocess.run(
        [PROMTOOL, "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
