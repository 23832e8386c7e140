"""Reading Kubernetes objects as plain JSON dicts.

We ask the official client for the raw response (``_preload_content=False``)
and parse it ourselves: observation code then reads exactly the fields the API
returned (``conditions``, ``deletionTimestamp``...) under their wire names, the
same names the Kubernetes docs and fleet-protocols.md use.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from kube.client import LWS_GROUP, LWS_PLURAL, LWS_VERSION, KubeApis

Obj = dict[str, Any]


def _load(resp: Any) -> Obj:
    return json.loads(resp.data)


def get_service(k: KubeApis, ns: str, name: str) -> Obj:
    return _load(k.core.read_namespaced_service(name, ns, _preload_content=False))


def get_pod(k: KubeApis, ns: str, name: str) -> Obj | None:
    try:
        return _load(k.core.read_namespaced_pod(name, ns, _preload_content=False))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def list_pods(k: KubeApis, ns: str, selector: str | None = None) -> list[Obj]:
    kwargs: dict[str, Any] = {"_preload_content": False}
    if selector:
        kwargs["label_selector"] = selector
    return list(_load(k.core.list_namespaced_pod(ns, **kwargs)).get("items", []))


def list_all_pods(k: KubeApis, node: str | None = None) -> list[Obj]:
    """Every pod in the cluster, or only those bound to ``node`` (a field selector the API server serves)."""
    kwargs: dict[str, Any] = {"_preload_content": False}
    if node:
        kwargs["field_selector"] = f"spec.nodeName={node}"
    return list(_load(k.core.list_pod_for_all_namespaces(**kwargs)).get("items", []))


def list_nodes(k: KubeApis) -> list[Obj]:
    return list(_load(k.core.list_node(_preload_content=False)).get("items", []))


def get_node(k: KubeApis, name: str) -> Obj:
    return _load(k.core.read_node(name, _preload_content=False))


def list_endpoint_slices(k: KubeApis, ns: str, service: str) -> list[Obj]:
    resp = k.discovery.list_namespaced_endpoint_slice(
        ns, label_selector=f"kubernetes.io/service-name={service}", _preload_content=False
    )
    return list(_load(resp).get("items", []))


def list_deployments(k: KubeApis, ns: str) -> list[Obj]:
    return list(_load(k.apps.list_namespaced_deployment(ns, _preload_content=False)).get("items", []))


def list_replica_sets(k: KubeApis, ns: str) -> list[Obj]:
    return list(_load(k.apps.list_namespaced_replica_set(ns, _preload_content=False)).get("items", []))


def list_stateful_sets(k: KubeApis, ns: str) -> list[Obj]:
    try:
        return list(_load(k.apps.list_namespaced_stateful_set(ns, _preload_content=False)).get("items", []))
    except ApiException as exc:
        if exc.status == 404:  # a cluster (or the simulator) that serves no StatefulSets
            return []
        raise


def list_leader_worker_sets(k: KubeApis, ns: str) -> list[Obj]:
    try:
        data: Any = k.custom.list_namespaced_custom_object(LWS_GROUP, LWS_VERSION, ns, LWS_PLURAL)
    except ApiException as exc:
        if exc.status == 404:  # LWS CRD not installed
            return []
        raise
    return list(data.get("items", []))


def list_events(k: KubeApis, ns: str) -> list[Obj]:
    return list(_load(k.core.list_namespaced_event(ns, _preload_content=False)).get("items", []))


def condition(obj: Obj, ctype: str) -> str | None:
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") == ctype:
            return str(c.get("status"))
    return None


def labels(obj: Obj) -> dict[str, str]:
    return dict(obj.get("metadata", {}).get("labels") or {})


def name(obj: Obj) -> str:
    return str(obj["metadata"]["name"])


def node_devices(k: KubeApis, node: str, driver: str) -> list[Obj]:
    """The devices ``driver`` publishes for ``node`` in its ResourceSlices (``resource.k8s.io/v1``), each
    with its slice's ``driver`` and ``pool`` added; [] on a cluster that serves no DRA (device plugin)."""
    try:
        resp = k.resource.list_resource_slice(field_selector=f"spec.nodeName={node}", _preload_content=False)
    except ApiException as exc:
        if exc.status == 404:  # no resource.k8s.io/v1 here: the device-plugin path
            return []
        raise
    out: list[Obj] = []
    for rs in _load(resp).get("items", []):
        spec = rs.get("spec") or {}
        if spec.get("nodeName") != node or spec.get("driver") != driver:
            continue
        pool = (spec.get("pool") or {}).get("name", node)
        out.extend({**d, "driver": driver, "pool": pool} for d in spec.get("devices") or [])
    return out
