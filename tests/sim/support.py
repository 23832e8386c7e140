"""What the simulated Kubernetes tests share: the API clients, object validation, a wall-clock condition wait (package-local support: see tests/support.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import kubernetes_validate
from kubernetes import client

from sim.runner import RunningSim

TEST_SPEED = 100.0  # a 300 s toleration passes in 3 s


T = TypeVar("T")
K8S_VERSION = "1.33.0"  # the version the sim reports at /version


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
