"""Helpers for the serving-layer tests: a small scenario and a simulator served on a free port.

The simulator runs in the test session's event loop (uvicorn on 127.0.0.1:0), so a test can
reach into the world in-process and over real HTTP at the same time. A test whose requests need
routing gets a real Envoy in front of the engines (``gateway_db``: a migrated ledger database),
configured by fleetmend's control plane from the simulator's Kubernetes API, as the dev stack
runs it; the simulator has no gateway of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from activities.envoy_gateway import EnvoyGateway
from fleet.gateway import GatewayPolicy
from fleet.incident import PoolRef
from gateway.resources import UPSTREAM_HEADER, DataPlaneSettings
from gateway.store import GatewayStore
from ledger.store import make_engine
from sim.app import BoundPorts, serve
from sim.k8s.tls import generate_serving_certs
from sim.runner import write_kubeconfig
from sim.scenario import Scenario, parse_scenario
from sim.serving.kubeview import routed_pods
from sim.serving.layer import ServingLayer
from sim.serving.telemetry import gpu_assignment
from sim.world import SimWorld
from worker.devstack.gateway import LocalGateway, gateway_in_front

NAMESPACE = "inference"
POOL = f"{NAMESPACE}/llama"
WAIT_FLOOR_S = 10.0  # the least wall clock a wait_for lasts, whatever its sim seconds
POOL_REF = PoolRef(namespace=NAMESPACE, service="llama")
POOL_HOST = "llama.inference"  # the Host users send: Envoy's virtual host for the pool

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
    gateway: LocalGateway | None = None  # Envoy in front of the engines, when the test asked for one
    adapter: EnvoyGateway | None = None  # fleetmend's gateway adapter on that Envoy

    async def sim_sleep(self, sim_seconds: float) -> None:
        await self.world.clock.sleep(sim_seconds)

    async def wait_for(
        self,
        check: Callable[[], object],
        timeout_sim_s: float,
        what: str,
        poll_sim_s: float = 0.25,
        seen: Callable[[], str] | None = None,
    ) -> None:
        """Poll ``check`` (a plain or async callable) until it returns something truthy; on a time-out
        the error says what ``seen`` last saw. The wait lasts ``timeout_sim_s`` of the world's time and
        at least ``WAIT_FLOOR_S`` of wall clock: at speed 20, 10 sim seconds are half a second, less
        than a loaded machine may leave this world without running it."""
        deadline = self.world.clock.now() + timeout_sim_s
        floor = time.monotonic() + WAIT_FLOOR_S
        while True:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            if self.world.clock.now() > deadline and time.monotonic() > floor:
                last = f": {seen()}" if seen is not None else ""
                raise AssertionError(
                    f"timed out after {timeout_sim_s:g} sim seconds waiting for {what}{last}"
                )
            await asyncio.sleep(max(0.005, self.world.clock.real_seconds(poll_sim_s)))

    def serving_pods(self) -> list[str]:
        return sorted(k.split("/", 1)[1] for k, e in self.layer.supervisor.engines().items() if e.alive)

    def routed(self) -> list[str]:
        """The pool's ready, router-labelled endpoints (what a gateway routes to), from the cluster."""
        return [pod for pod, _ in routed_pods(self.layer.kube, POOL)]

    async def wait_serving(self, count: int, timeout_sim_s: float = 600.0) -> list[str]:
        """Wait until ``count`` replicas are routed (and, with a gateway, in Envoy's routing set).

        600 sim seconds: at speed 10 a minute of wall clock, which a clean-clone run under full load
        needed (120 sim seconds, 12 s of wall clock, ran out once while Envoy came up)."""

        def routed() -> bool:
            if len(self.routed()) < count:
                return False
            if self.adapter is None:
                return True
            try:
                return len(self.adapter.routing_set(POOL_REF).endpoints) >= count
            except httpx.ConnectError:  # Envoy's admin is not listening yet: not routed yet
                return False

        def seen() -> str:
            envoy: object = None
            if self.gateway is not None:  # every host of the pool's cluster with its health flags
                try:
                    clusters = httpx.get(
                        f"{self.gateway.admin_url}/clusters", params={"format": "json"}
                    ).json()
                    envoy = [
                        (h.get("address"), h.get("health_status"))
                        for c in clusters.get("cluster_statuses", [])
                        if c.get("name") == POOL_REF.key
                        for h in c.get("host_statuses", [])
                    ]
                except httpx.HTTPError as err:
                    envoy = f"admin unreachable ({err})"
            return f"routed in the cluster {self.routed()}, in Envoy {envoy}, engines {self.serving_pods()}"

        await self.wait_for(routed, timeout_sim_s, f"{count} routed replicas", seen=seen)
        return self.serving_pods()

    async def set_policy(self, policy: GatewayPolicy) -> None:
        """Apply ``policy`` to the pool in Envoy (returns once Envoy took it)."""
        assert self.adapter is not None, "this test runs without a gateway: pass gateway_db"
        await asyncio.to_thread(self.adapter.apply, POOL_REF, policy)

    def gateway_client(self) -> httpx.AsyncClient:
        """A user's client of the pool, through Envoy."""
        assert self.gateway is not None, "this test runs without a gateway: pass gateway_db"
        return httpx.AsyncClient(base_url=self.gateway.url, headers={"host": POOL_HOST}, timeout=60.0)

    def replica_of(self, response: httpx.Response) -> str | None:
        """The pod that served a response through Envoy (its upstream header names ip:port)."""
        upstream = response.headers.get(UPSTREAM_HEADER)
        return self.layer.pod_at(upstream) if upstream else None

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
async def running_serving(
    scn: Scenario,
    speed: float = 20.0,
    gateway_db: str | None = None,
    data_plane: DataPlaneSettings | None = None,
) -> AsyncIterator[RunningServing]:
    """Serve ``scn`` at ``speed`` on a free loopback port, in this event loop; with ``gateway_db``
    (a migrated ledger database) a real Envoy and fleetmend's control plane in front of it."""
    world = SimWorld(scn, speed=speed)
    stop = asyncio.Event()
    bound: asyncio.Future[BoundPorts] = asyncio.get_running_loop().create_future()
    pki = tempfile.TemporaryDirectory(prefix="fleetmend-serving-pki-")
    certs = generate_serving_certs(Path(pki.name))
    task = asyncio.create_task(serve(world, "127.0.0.1", 0, certs=certs, ready=bound.set_result, stop=stop))
    ports = await asyncio.wait_for(bound, timeout=30)
    base_url = f"http://127.0.0.1:{ports.port}"
    kube_url = f"https://127.0.0.1:{ports.kube_port}"
    trust = ssl.create_default_context(cafile=str(certs.ca_cert))
    stack = contextlib.AsyncExitStack()
    try:
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=base_url, timeout=30.0))
        kube = await stack.enter_async_context(
            httpx.AsyncClient(
                base_url=kube_url,
                verify=trust,
                headers={"Authorization": f"Bearer {world.token}"},
                timeout=30.0,
            )
        )
        running = RunningServing(world, world.serving, base_url, http, kube)  # type: ignore[attr-defined]
        if gateway_db is not None:
            kubeconfig = write_kubeconfig(
                Path(pki.name) / "kubeconfig", kube_url, world.token, scn.namespace, certs.ca_pem()
            )
            running.gateway = await stack.enter_async_context(
                gateway_in_front(base_url, kubeconfig, gateway_db, Path(pki.name) / "gateway", data_plane)
            )
            engine = make_engine(gateway_db, pool_size=2)
            stack.callback(engine.dispose)
            running.adapter = EnvoyGateway(GatewayStore(engine))
        yield running
    finally:
        await stack.aclose()
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, timeout=15)
        pki.cleanup()
