"""Helpers for the serving-layer tests: a small scenario and a simulator served on a free port.

The simulator runs in the test session's event loop (uvicorn on 127.0.0.1:0), so a
test can drive the router in-process and over real HTTP at the same time.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sim.app import BoundPorts, serve
from sim.k8s.tls import generate_serving_certs
from sim.scenario import Scenario, parse_scenario
from sim.serving.layer import ServingLayer
from sim.serving.telemetry import gpu_assignment
from sim.world import SimWorld

NAMESPACE = "inference"
POOL = f"{NAMESPACE}/llama"

BASE_SCENARIO: dict[str, Any] = {
    "name": "serving-test",
    "namespace": NAMESPACE,
    "seed": 3,
    "timings": {"crash_loop_backoff_s": 2.0},
    "nodes": [
        {"prefix": "gpu-node", "count": 2, "gpus": 8, "labels": {"topology.kubernetes.io/zone": "zone-a"}}
    ],
    "models": [
        {
            "name": "llama-8b",
            "served_name": "meta-llama/Llama-3.1-8B-Instruct",
            "gpus_per_pod": 4,
            "image_pull_s": 1,
            "weight_load_s": 2,
            "warm_up_s": 0,
            "warm_rate_tokens_per_s": 200,
            "cold_rate_fraction": 0.25,
            "kv_capacity_tokens": 200000,
            "max_num_seqs": 64,
            "termination_grace_s": 30,
            "revisions": [{"name": "r1", "image": "vllm/vllm-openai:v0.12.0", "engine_version": "0.12.0"}],
        }
    ],
    "workloads": [
        {"name": "llama", "model": "llama-8b", "kind": "Deployment", "replicas": 2, "service": {"port": 80}}
    ],
    "load": {"probe_period_s": 2.0, "probe_failure_threshold": 3, "qualification_s": 20.0},
}


def scenario(**changes: Any) -> Scenario:
    """The base scenario with top-level keys replaced and ``model``/``load`` keys merged."""
    data = copy.deepcopy(BASE_SCENARIO)
    for key, value in changes.items():
        if key == "model":
            data["models"][0].update(value)
        elif key == "load":
            data["load"].update(value)
        else:
            data[key] = value
    return parse_scenario(data)


@dataclass
class RunningServing:
    world: SimWorld
    layer: ServingLayer
    base_url: str
    http: httpx.AsyncClient
    kube: httpx.AsyncClient  # the Kubernetes API (HTTPS, the sim's CA, the kubeconfig's token)

    async def sim_sleep(self, sim_seconds: float) -> None:
        await self.world.clock.sleep(sim_seconds)

    async def wait_for(
        self, check: Callable[[], object], timeout_sim_s: float, what: str, poll_sim_s: float = 0.25
    ) -> None:
        """Poll ``check`` (a plain or async callable) until it returns something truthy."""
        deadline = self.world.clock.now() + timeout_sim_s
        while True:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            if self.world.clock.now() > deadline:
                raise AssertionError(f"timed out after {timeout_sim_s:g} sim seconds waiting for {what}")
            await asyncio.sleep(max(0.005, self.world.clock.real_seconds(poll_sim_s)))

    def serving_pods(self) -> list[str]:
        return sorted(k.split("/", 1)[1] for k, e in self.layer.supervisor.engines().items() if e.alive)

    async def wait_serving(self, count: int, timeout_sim_s: float = 120.0) -> list[str]:
        async def routed() -> bool:
            r = await self.http.get(f"/router/v1/pools/{POOL}/routing-set")
            return r.status_code == 200 and len(r.json()["endpoints"]) >= count

        await self.wait_for(routed, timeout_sim_s, f"{count} routed replicas")
        return self.serving_pods()

    def pod_url(self, pod: str, namespace: str = NAMESPACE) -> str:
        """``http://{podIP}:{engine_port}``: where the pod's engine listens (as in a cluster)."""
        obj = self.world.pod(namespace, pod)
        ip = (obj or {}).get("status", {}).get("podIP")
        if not ip:
            raise AssertionError(f"pod {namespace}/{pod} has no IP")
        return f"http://{ip}:{self.layer.settings.engine_port}"

    async def engine_get(self, pod: str, path: str, namespace: str = NAMESPACE) -> httpx.Response:
        """GET ``path`` from the pod's own engine server, at its pod IP."""
        return await self.http.get(self.pod_url(pod, namespace) + path)

    async def metrics(self, pod: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        r = await self.engine_get(pod, "/metrics", namespace)
        r.raise_for_status()
        return {f.name: f for f in text_string_to_metric_families(r.text)}

    async def set_state(self, what: str, payload_key: str, value: Any, pool: str = POOL) -> dict[str, Any]:
        state = (await self.http.get(f"/router/v1/pools/{pool}/state")).json()
        r = await self.http.put(
            f"/router/v1/pools/{pool}/{what}", json={"replaces_version": state["version"], payload_key: value}
        )
        r.raise_for_status()
        return dict(r.json())

    async def fault(self, kind: str, target: str, **params: Any) -> httpx.Response:
        return await self.http.post("/sim/v1/faults", json={"kind": kind, "target": target, "params": params})


def pod_node_and_gpu(sim: RunningServing, pod: str) -> tuple[str, int]:
    """The node a serving pod runs on and the (first) GPU it holds there."""
    obj = sim.layer.kube.pod(NAMESPACE, pod)
    assert obj is not None
    node = obj["spec"]["nodeName"]
    gpu = next(i for i, p in gpu_assignment(sim.layer.kube, node).items() if p["metadata"]["name"] == pod)
    return node, gpu


@contextlib.asynccontextmanager
async def running_serving(scn: Scenario, speed: float = 20.0) -> AsyncIterator[RunningServing]:
    """Serve ``scn`` at ``speed`` on a free loopback port, in this event loop."""
    world = SimWorld(scn, speed=speed)
    stop = asyncio.Event()
    bound: asyncio.Future[BoundPorts] = asyncio.get_running_loop().create_future()
    pki = tempfile.TemporaryDirectory(prefix="fleetmend-serving-pki-")
    certs = generate_serving_certs(Path(pki.name))
    task = asyncio.create_task(serve(world, "127.0.0.1", 0, certs=certs, ready=bound.set_result, stop=stop))
    ports = await asyncio.wait_for(bound, timeout=30)
    base_url = f"http://127.0.0.1:{ports.port}"
    trust = ssl.create_default_context(cafile=str(certs.ca_cert))
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=30.0) as http,
        httpx.AsyncClient(
            base_url=f"https://127.0.0.1:{ports.kube_port}",
            verify=trust,
            headers={"Authorization": f"Bearer {world.token}"},
            timeout=30.0,
        ) as kube,
    ):
        try:
            yield RunningServing(world, world.serving, base_url, http, kube)  # type: ignore[attr-defined]
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=15)
            pki.cleanup()
