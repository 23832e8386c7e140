"""Every page the simulator serves for Prometheus parses with prometheus_client, in vLLM's exact shapes."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from fleet.engine_metrics import KvMetricEra, parse_engine_metrics
from sim.serving.engine import Engine, EngineSpec
from sim.serving.vllm_metrics import ITL_BUCKETS, TTFT_BUCKETS, MetricsEra, family_names
from tests.sim.serving_fixtures import NAMESPACE, running_serving, scenario

KV_ERA = {
    MetricsEra.LEGACY: KvMetricEra.OLD,
    MetricsEra.BOTH: KvMetricEra.BOTH,
    MetricsEra.CURRENT: KvMetricEra.NEW,
}
ERA_VERSIONS = {MetricsEra.LEGACY: "0.9.1", MetricsEra.BOTH: "0.10.2", MetricsEra.CURRENT: "0.12.0"}
ALL_ERA_NAMES = (
    family_names(MetricsEra.BOTH) | family_names(MetricsEra.CURRENT) | family_names(MetricsEra.LEGACY)
)


def three_era_scenario():  # one pool per vLLM release era
    base = scenario()
    model = base.models[0]
    models, workloads = [], []
    for era, version in ERA_VERSIONS.items():
        m = model.model_copy(deep=True)
        m.name = f"model-{era.value}"
        m.served_name = f"org/model-{era.value}"
        m.revisions[0].engine_version = version
        models.append(m)
        w = base.workloads[0].model_copy(deep=True)
        w.name, w.model, w.replicas = f"pool-{era.value}", m.name, 1
        workloads.append(w)
    nodes = base.nodes[0].model_copy(update={"count": 2})
    return base.model_copy(update={"models": models, "workloads": workloads, "nodes": [nodes]})


async def test_each_engine_era_exposes_exactly_its_names_and_every_page_parses() -> None:
    async with running_serving(three_era_scenario(), speed=20) as sim:
        await sim.wait_for(lambda: len(sim.serving_pods()) == 3, 60, "three engines")
        # Traffic so histograms and counters have samples (to each engine at its pod IP).
        for key, engine in sim.layer.supervisor.engines().items():
            body = {"model": engine.metrics_model_name, "max_tokens": 8, "stream": False}
            r = await sim.http.post(sim.pod_url(key.split("/", 1)[1]) + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
        for key, engine in sim.layer.supervisor.engines().items():
            era = engine.spec.era()
            families = await sim.metrics(key.split("/", 1)[1])
            names = set(families)
            assert family_names(era) <= names, f"{era}: missing {family_names(era) - names}"
            assert not (ALL_ERA_NAMES - family_names(era)) & names, f"{era} exposes another era's names"
            for family in families.values():
                if family.name.startswith("vllm:"):
                    for sample in family.samples:
                        assert sample.labels["model_name"] == engine.metrics_model_name
                        assert sample.labels["engine"] == "0"
            ttft = families["vllm:time_to_first_token_seconds"]
            edges = [float(s.labels["le"]) for s in ttft.samples if s.name.endswith("_bucket")]
            assert edges == [*TTFT_BUCKETS, float("inf")]
            count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
            assert count == 1
            itl_name = (
                "vllm:inter_token_latency_seconds"
                if era is MetricsEra.CURRENT
                else "vllm:time_per_output_token_seconds"
            )
            itl_edges = [
                float(s.labels["le"]) for s in families[itl_name].samples if s.name.endswith("_bucket")
            ]
            assert itl_edges == [*ITL_BUCKETS, float("inf")]
            success = families["vllm:request_success"]
            assert {s.labels["finished_reason"] for s in success.samples if s.name.endswith("_total")} == {
                "stop",
                "length",
                "abort",
            }
            assert families["vllm:generation_tokens"].type == "counter"
            # fleetmend's own reader recognises the era from the names alone.
            text = (await sim.engine_get(key.split("/", 1)[1], "/metrics")).text
            snapshot = parse_engine_metrics(text)
            assert snapshot.kv_era == KV_ERA[era] and snapshot.kv_usage is not None
            assert snapshot.request_success_total == 1
            assert families["vllm:num_requests_running"].type == "gauge"

        node = await sim.http.get("/nodes/gpu-node-0/metrics")
        dcgm = {f.name: f for f in text_string_to_metric_families(node.text)}
        xid = dcgm["DCGM_FI_DEV_XID_ERRORS"]
        assert xid.type == "gauge" and len(xid.samples) == 8
        assert {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"} <= set(xid.samples[0].labels)
        assert dcgm["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"].type == "counter"

        ksm = await sim.http.get("/metrics")
        kube = {f.name: f for f in text_string_to_metric_families(ksm.text)}
        for name in (
            "kube_node_status_condition",
            "kube_pod_status_ready",
            "kube_pod_info",
            "kube_pod_container_status_waiting_reason",
            "kube_pod_container_status_last_terminated_reason",
        ):
            assert name in kube, name
        ready = [
            s
            for s in kube["kube_pod_status_ready"].samples
            if s.labels["condition"] == "true" and s.value == 1
        ]
        # The pool's 3 pods, and each GPU node's 3 node agents (DaemonSet pods) in their namespaces.
        assert len([s for s in ready if s.labels["namespace"] == NAMESPACE]) == 3
        agents = {s.labels["namespace"] for s in ready if s.labels["namespace"] != NAMESPACE}
        assert agents == {"gpu-operator", "kube-system"}


def test_a_dead_engine_answers_health_as_its_release_did() -> None:
    answers = {}
    for version in ("0.10.2", "0.11.0", "0.12.0"):
        engine = Engine("ns/p", EngineSpec(version=version), "m", started_at=0.0)
        engine.wedged = True
        assert engine.health_status() == 200  # wedged, still "healthy"
        engine.kill("Xid 79", 1.0)
        answers[version] = engine.health_status()
    assert answers == {"0.10.2": 500, "0.11.0": 503, "0.12.0": 503}
    with pytest.raises(ValidationError, match=r"MAJOR\.MINOR"):
        EngineSpec(version="latest")
