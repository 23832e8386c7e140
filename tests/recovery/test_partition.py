"""A top-of-rack partition: kubelets silent to the API server, engines still serving.

``POST /sim/v1/nodes/N/lose?partition=true``: the node turns Ready=Unknown, the node controller marks
its pods not ready (so its EndpointSlice endpoints turn not-ready), and its engines keep answering.
What an SRE must see: the replicas there keep serving through Envoy (the gateway keeps an endpoint
made not-ready by a silent kubelet; Envoy's health check decides), and the alert about the node
opens an incident whose recovery says "node ... unreachable from the API, still serving" and ends
as not-a-loss: nothing derouted on the node's condition alone. Real Temporal, Postgres and Envoy,
the simulated fleet.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from kubernetes import client as k8s_client
from temporalio.client import Client

from fleet.recovery import Phase
from fleet.vocabulary import ROUTER_LABEL
from tests.support import (
    POOL,
    SHORT_NODE_GRACE_S,
    decisions,
    finish,
    fleetmend_actions,
    gpu_pool,
    incident_config,
    node_report,
    routed,
    wait_for_child,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NODE = "gpu-node-1"


async def test_a_partitioned_node_keeps_serving_and_its_incident_is_not_a_loss(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url, node_grace_s=SHORT_NODE_GRACE_S) as rig:
        pods = await asyncio.to_thread(
            rig.core.list_namespaced_pod, POOL.namespace, field_selector=f"spec.nodeName={NODE}"
        )
        there = {p.metadata.name for p in pods.items}
        routed_there = sorted(there & set(await rig.routing_set(POOL)))
        assert routed_there, "the scenario routes a replica on the node"
        before = len(await rig.routing_set(POOL))

        async with httpx.AsyncClient(base_url=rig.base_url, timeout=10.0) as http:
            (await http.post(f"/sim/v1/nodes/{NODE}/lose", params={"partition": "true"})).raise_for_status()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            slices = await asyncio.to_thread(
                k8s_client.DiscoveryV1Api(rig.core.api_client).list_namespaced_endpoint_slice, POOL.namespace
            )
            not_ready = {
                e.target_ref.name
                for sl in slices.items
                for e in sl.endpoints or []
                if e.target_ref is not None and e.conditions is not None and e.conditions.ready is False
            }
            if set(routed_there) <= not_ready:
                break
            await asyncio.sleep(0.3)
        else:
            raise AssertionError(f"the node controller never marked {routed_there} not ready")

        # Kubernetes calls them not ready; their engines answer; Envoy keeps routing to them.
        for pod in routed_there:
            assert (await rig.engine_get(POOL.namespace, pod, "/health")).status_code == 200
        await routed(
            rig,
            lambda pods: set(routed_there) <= set(pods) and len(pods) == before,
            f"{routed_there} of {before}",
        )

        incident = await rig.report_loss(node_report(NODE, fingerprint="fp-partition"), incident_config())
        child = await wait_for_child(temporal_client, incident)
        status = await finish(child, 120)
        assert status.phase == Phase.NOT_A_LOSS, decisions(status)
        text = decisions(status)
        assert f"node {NODE} unreachable from the API, still serving" in text, text
        patched = [
            a
            for a in await fleetmend_actions(rig)
            if a["verb"] == "PATCH" and any(a["path"].endswith(f"/pods/{pod}") for pod in routed_there)
        ]
        assert patched == [], patched  # no deroute (nor any other change) of a replica that serves
        for pod in routed_there:
            obj = await asyncio.to_thread(rig.core.read_namespaced_pod, pod, POOL.namespace)
            assert (obj.metadata.labels or {}).get(ROUTER_LABEL), obj.metadata.labels
        await routed(rig, lambda pods: set(routed_there) <= set(pods), f"{routed_there} still routed")
