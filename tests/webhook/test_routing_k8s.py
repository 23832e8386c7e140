"""Routing with the shipped rules: alerts name nodes and pods, incidents are per pool.

The Kubernetes API is the simulated cluster's, spoken to by the official client
through a kubeconfig, exactly as in production. Each scenario runs in a
namespace of its own so incident ids never collide with other tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from kube.client import kube_apis
from sim.runner import RunningSim, start_sim, write_kubeconfig
from sim.scenario import load_scenario
from tests.support import (
    ServedWebhook,
    component_kubeconfig,
    report_loss_signals,
    serve_webhook,
    webhook_settings,
)
from worker.intake.topology import PoolTopology
from worker.processes import free_port
from worker.webhook.app import create_app
from worker.webhook.examples import example_alert, example_payload, large_group

SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "scenarios"


def sim_in_own_namespace(name: str) -> RunningSim:
    scenario = load_scenario(SCENARIOS / f"{name}.yaml")
    namespace = f"{scenario.namespace}-{secrets.token_hex(3)}"
    return start_sim(scenario.model_copy(update={"namespace": namespace}), speed=1, serving=False)


def pods_by_node(sim: RunningSim) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for pod in sim.world.pods(sim.world.scenario.namespace):
        out.setdefault(pod["spec"].get("nodeName", ""), []).append(pod["metadata"]["name"])
    return out


@pytest.fixture(scope="module")
def node_loss_sim() -> Iterator[RunningSim]:
    with sim_in_own_namespace("gpu-node-loss") as sim:
        yield sim


@pytest.fixture(scope="module")
def rank_sim() -> Iterator[RunningSim]:
    with sim_in_own_namespace("rank-lost") as sim:
        yield sim


def served_for(sim: RunningSim, env: WorkflowEnvironment, task_queue: str) -> Iterator[ServedWebhook]:
    token = secrets.token_hex(16)
    settings = webhook_settings(
        env, task_queue, token, kubeconfig=component_kubeconfig(sim.kubeconfig, "webhook"), kube_context=None
    )
    app = create_app(settings)  # the shipped routing rules
    with serve_webhook(app, settings) as base_url:
        yield ServedWebhook(app, base_url, token, settings)


@pytest.fixture
def node_loss_webhook(
    node_loss_sim: RunningSim, temporal_env: WorkflowEnvironment, task_queue: str
) -> Iterator[ServedWebhook]:
    yield from served_for(node_loss_sim, temporal_env, task_queue)


@pytest.fixture
def rank_webhook(
    rank_sim: RunningSim, temporal_env: WorkflowEnvironment, task_queue: str
) -> Iterator[ServedWebhook]:
    yield from served_for(rank_sim, temporal_env, task_queue)


async def post(served: ServedWebhook, payload: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(served.url, content=json.dumps(payload).encode(), headers=served.auth)


async def test_node_not_ready_reports_every_replica_group_on_the_node_to_its_pools_incident(
    node_loss_sim: RunningSim, node_loss_webhook: ServedWebhook, temporal_client: Client
) -> None:
    namespace = node_loss_sim.world.scenario.namespace
    # Every pod on the node is behind the pool's Service (serving replicas and warm spares alike).
    serving_on_node = sorted(pods_by_node(node_loss_sim)["gpu-node-0"])
    assert len(serving_on_node) >= 2  # the scenario packs two TP=4 replicas onto gpu-node-0
    payload = example_payload("node-not-ready", overrides={"node": "gpu-node-0"})
    fingerprint = payload["alerts"][0]["fingerprint"]

    response = await post(node_loss_webhook, payload)

    assert response.status_code == 200, response.text
    body = response.json()
    workflow_id = f"incident/{namespace}/llama"
    assert body["incidents"] == [workflow_id]
    assert sorted(d["replica_group"] for d in body["delivered"]) == serving_on_node
    signals = await report_loss_signals(temporal_client, workflow_id)
    assert sorted(s["replica_group"] for s in signals) == serving_on_node
    assert {s["fingerprint"] for s in signals} == {f"{fingerprint}/{g}" for g in serving_on_node}
    for s in signals:
        assert s["node"] == "gpu-node-0"
        assert s["pod"] == s["replica_group"]  # a Deployment replica is one pod
        assert s["alert_name"] == "KubeNodeNotReady"
        assert s["severity"] == "critical"  # the rule overrides the mixin's "warning"
        assert s["fault_hint"] == "node-lost"


async def test_gpu_xid_names_the_node_by_dcgm_hostname_and_carries_the_xid(
    node_loss_sim: RunningSim, node_loss_webhook: ServedWebhook, temporal_client: Client
) -> None:
    node = next(n for n, pods in sorted(pods_by_node(node_loss_sim).items()) if n and n != "gpu-node-0")
    response = await post(node_loss_webhook, example_payload("gpu-xid", overrides={"Hostname": node}))

    assert response.status_code == 200, response.text
    [workflow_id] = response.json()["incidents"]
    signals = [s for s in await report_loss_signals(temporal_client, workflow_id) if s["node"] == node]
    assert signals and {s["fault_hint"] for s in signals} == {"gpu-xid:79"}


async def test_crash_looping_serving_pod_reports_its_replica_group(
    node_loss_sim: RunningSim, node_loss_webhook: ServedWebhook, temporal_client: Client
) -> None:
    namespace = node_loss_sim.world.scenario.namespace
    pod = sorted(pods_by_node(node_loss_sim)["gpu-node-0"])[0]
    payload = example_payload("crashloop", overrides={"namespace": namespace, "pod": pod})

    response = await post(node_loss_webhook, payload)

    assert response.status_code == 200, response.text
    [delivered] = response.json()["delivered"]
    assert delivered["replica_group"] == pod
    assert delivered["fingerprint"] == payload["alerts"][0]["fingerprint"]
    signals = await report_loss_signals(temporal_client, f"incident/{namespace}/llama")
    assert any(s["pod"] == pod and s["fault_hint"] == "crash-loop:vllm" for s in signals)


async def test_lost_worker_rank_reports_the_whole_leaderworkerset_group(
    rank_sim: RunningSim, rank_webhook: ServedWebhook, temporal_client: Client
) -> None:
    namespace = rank_sim.world.scenario.namespace
    payload = example_payload("rank-lost", overrides={"namespace": namespace, "pod": "llama-405b-0-1"})

    response = await post(rank_webhook, payload)

    assert response.status_code == 200, response.text
    [delivered] = response.json()["delivered"]
    assert delivered["workflow_id"] == f"incident/{namespace}/llama-405b"
    assert (
        delivered["replica_group"] == "llama-405b-0"
    )  # the worker's group, though the Service selects leaders


async def test_alerts_that_concern_no_serving_pool_are_ignored_with_the_reason(
    rank_sim: RunningSim, rank_webhook: ServedWebhook
) -> None:
    namespace = rank_sim.world.scenario.namespace
    empty_node = next(f"gpu-node-{i}" for i in range(6) if f"gpu-node-{i}" not in pods_by_node(rank_sim))
    cases = {
        "not-serving": example_payload("node-not-ready", overrides={"node": empty_node}),
        "not-found": example_payload("crashloop", overrides={"namespace": namespace, "pod": "no-such-pod"}),
        "invalid-entity": example_payload("node-not-ready", overrides={"node": "GPU node 7!"}),
    }
    for reason, payload in cases.items():
        response = await post(rank_webhook, payload)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "ignored"
        assert response.json()["ignored"][0]["reason"] == reason


async def test_unreachable_kubernetes_api_gets_503_so_alertmanager_retries(
    temporal_env: WorkflowEnvironment, task_queue: str, tmp_path: Path
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{free_port()}", "token")
    token = secrets.token_hex(16)
    settings = webhook_settings(temporal_env, task_queue, token, kubeconfig=kubeconfig, kube_context="sim")
    app = create_app(settings)
    with serve_webhook(app, settings) as base_url:
        served = ServedWebhook(app, base_url, token, settings)
        response = await post(served, example_payload("node-not-ready"))

    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert response.json()["error"] == "kubernetes-unavailable"


async def test_a_storm_about_one_node_reaches_one_incident_through_the_kubernetes_api(
    node_loss_sim: RunningSim, node_loss_webhook: ServedWebhook, temporal_client: Client
) -> None:
    """300 concurrent notifications (distinct DCGM series of one node, each sent twice):
    node -> pods -> pool resolution under load, one incident, one signal per distinct alert and group."""
    namespace = node_loss_sim.world.scenario.namespace
    node = "gpu-node-1"
    groups = sorted(pods_by_node(node_loss_sim)[node])
    payloads = [
        example_payload(
            "gpu-xid", overrides={"Hostname": node, "gpu": str(i % 8), "instance": f"10.9.0.{i}:9400"}
        )
        for i in range(150)
    ]
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        bodies = [json.dumps(p).encode() for p in payloads * 2]
        responses = await asyncio.gather(
            *(http.post(node_loss_webhook.url, content=b, headers=node_loss_webhook.auth) for b in bodies)
        )

    assert {r.status_code for r in responses} == {200}
    assert {wf for r in responses for wf in r.json()["incidents"]} == {f"incident/{namespace}/llama"}
    fingerprints = {p["alerts"][0]["fingerprint"] for p in payloads}
    signals = [
        s
        for s in await report_loss_signals(temporal_client, f"incident/{namespace}/llama")
        if s["fingerprint"].split("/")[0] in fingerprints
    ]
    assert len(signals) == len(payloads) * len(groups)
    assert {s["replica_group"] for s in signals} == set(groups)


class CountingCoreApi:
    """The real CoreV1Api, counting which of its calls the webhook makes."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._core, name)
        if not callable(method):
            return method

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name + (" by field" if "field_selector" in kwargs else "")] += 1
            return method(*args, **kwargs)

        return counted


def counting_webhook(
    sim: RunningSim, env: WorkflowEnvironment, task_queue: str
) -> tuple[Callable[[], Iterator[ServedWebhook]], CountingCoreApi]:
    token = secrets.token_hex(16)
    settings = webhook_settings(
        env, task_queue, token, kubeconfig=component_kubeconfig(sim.kubeconfig, "webhook"), kube_context=None
    )
    real = kube_apis(settings)
    core = CountingCoreApi(real.core)
    counted = dataclasses.replace(real, core=core)  # type: ignore[arg-type]
    topology = PoolTopology(lambda: counted, router_label=settings.router_label)

    def serve() -> Iterator[ServedWebhook]:
        app = create_app(settings, topology=topology)  # the shipped routing rules, default body limit
        with serve_webhook(app, settings) as base_url:
            yield ServedWebhook(app, base_url, token, settings)

    return serve, core


async def test_a_10000_alert_group_with_one_node_loss_opens_that_incident_with_two_list_calls(
    temporal_env: WorkflowEnvironment, task_queue: str, temporal_client: Client
) -> None:
    """An Alertmanager group of 10,000 alerts (6.7 MB: under the default body limit) whose only
    actionable alert is one node loss: that loss reaches the pool's incident exactly as it does
    alone, the 9,999 others are ignored with their reasons, and the whole payload costs the
    Kubernetes API one pod list and one Service list instead of a lookup per alert."""
    with sim_in_own_namespace("gpu-node-loss") as sim:  # no other test's incident for this pool
        namespace = sim.world.scenario.namespace
        serving_on_node = sorted(pods_by_node(sim)["gpu-node-0"])
        real = example_alert("node-not-ready", overrides={"node": "gpu-node-0"})
        payload = large_group([real], 10_000, namespace=namespace)
        serve, core = counting_webhook(sim, temporal_env, task_queue)
        for served in serve():
            response = await post(served, payload)

    assert response.status_code == 200, response.text[:500]
    body = response.json()
    workflow_id = f"incident/{namespace}/llama"
    assert body["incidents"] == [workflow_id]
    assert sorted(d["replica_group"] for d in body["delivered"]) == serving_on_node
    assert {d["fingerprint"].split("/")[0] for d in body["delivered"]} == {real["fingerprint"]}
    assert body["alerts"] == 10_000 and body["ignored_count"] == 9_999
    assert body["ignored_by_reason"] == {
        "not-serving": 6_000,  # nodes with no serving pod
        "not-found": 2_000,  # pods that do not exist
        "invalid-entity": 1_000,  # "Node_17!" is no Kubernetes name
        "no-rule": 999,
    }
    assert len(body["ignored"]) == 100  # the reply lists a sample, the counts cover all
    assert served.metric("fleetmend_alerts_ignored_total", reason="not-serving") == 6_000
    signals = await report_loss_signals(temporal_client, workflow_id)
    assert sorted(s["replica_group"] for s in signals) == serving_on_node
    assert await workflow_ids_on(temporal_client, task_queue) == [workflow_id]
    pod_lists = core.calls["list_pod_for_all_namespaces"]
    assert 1 <= pod_lists <= 2  # pages of 500 pods: the sim has a handful
    assert core.calls["list_service_for_all_namespaces"] == 1
    assert sum(core.calls.values()) == pod_lists + 1, core.calls  # no per-alert read or list


async def test_a_large_group_resolves_exactly_as_its_alerts_do_one_by_one(
    node_loss_sim: RunningSim, temporal_env: WorkflowEnvironment, task_queue: str
) -> None:
    """Batched and per-entity lookups agree: every real node and serving pod of the cluster,
    alone and inside a 2,000-alert group."""
    namespace = node_loss_sim.world.scenario.namespace
    by_node = pods_by_node(node_loss_sim)
    real = [example_alert("node-not-ready", overrides={"node": n}) for n in sorted(by_node) if n]
    real += [
        example_alert("crashloop", overrides={"namespace": namespace, "pod": p})
        for pods in by_node.values()
        for p in sorted(pods)
    ]
    serve, core = counting_webhook(node_loss_sim, temporal_env, task_queue)

    def delivered(body: dict[str, Any]) -> list[tuple[str, str, str]]:
        return sorted((d["workflow_id"], d["fingerprint"], d["replica_group"]) for d in body["delivered"])

    for served in serve():
        alone = []
        for a in real:
            answer = await post(served, {**example_payload("node-not-ready"), "alerts": [a]})
            assert answer.status_code == 200, answer.text
            alone += delivered(answer.json())
        assert "list_pod_for_all_namespaces" not in core.calls  # one at a time: no cluster-wide list
        assert core.calls["list_pod_for_all_namespaces by field"] == len(by_node) - ("" in by_node)
        grouped = await post(served, large_group(real, 2_000, namespace=namespace, seed="g"))
    assert grouped.status_code == 200, grouped.text[:500]
    assert core.calls["list_service_for_all_namespaces"] == 1
    assert delivered(grouped.json()) == sorted(alone) and alone


async def workflow_ids_on(client: Client, task_queue: str) -> list[str]:
    await asyncio.sleep(0.3)  # visibility trails the start by a moment
    return sorted([wf.id async for wf in client.list_workflows(f'TaskQueue = "{task_queue}"')])
