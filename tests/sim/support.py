"""What the simulator's tests share (package-local support: see tests/support.py): the API clients, object
validation, a wall-clock condition wait; the streaming tests' model, slow-engine settings and SSE reader;
the qualification Job helpers (a Job through the sim's Kubernetes API, its pod, its verdict, its report)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import kubernetes_validate
from kubernetes import client

from fleet.qualification import QualificationSpec, job_manifest
from sim.runner import RunningSim
from tests.sim.serving_fixtures import RunningServing

TEST_SPEED = 100.0  # a 300 s toleration passes in 3 s


T = TypeVar("T")
K8S_VERSION = "1.37.0"  # the version the sim reports at /version


@dataclass
class Kube:
    """The official client's API groups, configured from the sim's kubeconfig."""

    api_client: client.ApiClient
    core: client.CoreV1Api
    apps: client.AppsV1Api
    discovery: client.DiscoveryV1Api
    policy: client.PolicyV1Api
    custom: client.CustomObjectsApi
    sim: RunningSim


def assert_valid_objects(kube: Kube, namespace: str = "inference") -> int:
    """Validate every built-in object the sim lists against the Kubernetes OpenAPI schemas (strict).

    Raw JSON (``_preload_content=False``), as the server sent it; returns how many objects were checked.
    """
    listings = [
        (kube.core.list_namespaced_pod(namespace, _preload_content=False), "Pod", "v1"),
        (kube.core.list_node(_preload_content=False), "Node", "v1"),
        (kube.core.list_namespaced_service(namespace, _preload_content=False), "Service", "v1"),
        (kube.core.list_namespaced_event(namespace, _preload_content=False), "Event", "v1"),
        (kube.core.list_namespace(_preload_content=False), "Namespace", "v1"),
        (
            kube.discovery.list_namespaced_endpoint_slice(namespace, _preload_content=False),
            "EndpointSlice",
            "discovery.k8s.io/v1",
        ),
        (kube.apps.list_namespaced_deployment(namespace, _preload_content=False), "Deployment", "apps/v1"),
        (kube.apps.list_namespaced_replica_set(namespace, _preload_content=False), "ReplicaSet", "apps/v1"),
        (kube.apps.list_namespaced_stateful_set(namespace, _preload_content=False), "StatefulSet", "apps/v1"),
        (
            kube.policy.list_namespaced_pod_disruption_budget(namespace, _preload_content=False),
            "PodDisruptionBudget",
            "policy/v1",
        ),
    ]
    checked = 0
    for response, kind, api_version in listings:
        body = json.loads(response.data)
        assert body["kind"] == f"{kind}List" and body["metadata"]["resourceVersion"]
        for item in body["items"]:
            kubernetes_validate.validate(
                dict(item, kind=kind, apiVersion=api_version), K8S_VERSION, strict=True
            )
            checked += 1
    return checked


def wait_for(check: Callable[[], T | None], timeout: float = 10.0, what: str = "condition") -> T:
    """Poll ``check`` until it returns something truthy (wall-clock ``timeout``)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Slow sequences (2 tokens/s) so a test can act while a stream is open.
SLOW = {"engine": {"max_tokens_per_seq_s": 2.0}}


async def read_sse(lines: Any) -> tuple[int, list[dict[str, Any]], bool]:
    """(tokens, error events, saw [DONE]) of the rest of a streamed completion; a stream whose
    connection was cut ends there, without [DONE]."""
    tokens, errors, done = 0, [], False
    try:
        async for line in lines:
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            else:
                tokens += event["choices"][0]["text"].count(" tok")
    except httpx.HTTPError:
        done = False  # cut mid-body: the engine's process died and Envoy reset the stream
    return tokens, errors, done


NS = "fleetmend"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"


async def start_job(
    sim: RunningServing, name: str, node: str, gpus: int, level: int = 2, deadline_s: int = 600
) -> None:
    spec = QualificationSpec(level=level, deadline_s=deadline_s)
    body = job_manifest(spec, node=node, machine="m", gpus=gpus, name=name, op_id=f"op-{name}")
    r = await sim.kube.post(JOBS, json=body)
    assert r.status_code == 201, r.text


async def job_pod(sim: RunningServing, name: str) -> dict[str, Any] | None:
    r = await sim.kube.get(
        f"/api/v1/namespaces/{NS}/pods", params={"labelSelector": f"batch.kubernetes.io/job-name={name}"}
    )
    r.raise_for_status()
    items = r.json()["items"]
    return items[0] if items else None


async def finished_job(sim: RunningServing, name: str, timeout_sim_s: float = 300) -> dict[str, Any]:
    out: dict[str, Any] = {}

    async def done() -> bool:
        job = (await sim.kube.get(f"{JOBS}/{name}")).json()
        conds = {c["type"]: c for c in job.get("status", {}).get("conditions") or []}
        if "Complete" in conds or "Failed" in conds:
            out.update(job)
            return True
        return False

    await sim.wait_for(done, timeout_sim_s, f"Job {name} to finish")
    return out


def condition(job: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in job["status"].get("conditions") or [] if c["type"] == ctype), None)


async def pod_log(sim: RunningServing, pod: str) -> str:
    r = await sim.kube.get(f"/api/v1/namespaces/{NS}/pods/{pod}/log", params={"container": "dcgm-diag"})
    assert r.status_code == 200, r.text
    return r.text
