"""EndpointSlice controller (``discovery.k8s.io/v1``), following ``podToEndpoint``:

    serving     = pod Ready condition is True
    terminating = pod has a deletionTimestamp
    ready       = service.spec.publishNotReadyAddresses or (serving and not terminating)

Terminating pods stay listed; Succeeded/Failed pods and pods without an IP are
left out. All three conditions are always written explicitly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleet.vocabulary import ZONE_LABEL
from sim.k8s import objects as o

if TYPE_CHECKING:
    from sim.k8s.controlplane import ControlPlane

Obj = dict[str, Any]
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "endpointslice-controller.k8s.io"


def slice_name(service: Obj) -> str:
    return f"{o.name_of(service)}-{o.stable_hash(o.uid_of(service), 5)}"


def _ports(service: Obj, pods: list[Obj]) -> list[Obj]:
    result = []
    for port in service["spec"].get("ports") or []:
        target = port.get("targetPort", port.get("port"))
        if isinstance(target, str) and not target.isdigit():
            number = None
            for pod in pods:
                for container in pod["spec"].get("containers") or []:
                    for cport in container.get("ports") or []:
                        if cport.get("name") == target:
                            number = cport.get("containerPort")
            if number is None:
                continue
            target = number
        entry: Obj = {"port": int(target), "protocol": port.get("protocol", "TCP")}
        entry["name"] = port.get("name", "")
        result.append(entry)
    return result


def reconcile_endpointslices(cp: ControlPlane) -> None:
    nodes = {o.name_of(n): n for n in cp.store.list_view("nodes")}
    for service in cp.store.list_view("services"):
        selector = service.get("spec", {}).get("selector")
        if not selector:
            continue
        namespace = o.namespace_of(service)
        publish_not_ready = bool(service["spec"].get("publishNotReadyAddresses"))
        pods = [
            p
            for p in cp.store.select("pods", namespace, selector)
            if all(o.labels(p).get(k) == v for k, v in selector.items())
            and not o.is_pod_terminal(p)
            and p.get("status", {}).get("podIP")
        ]
        pods.sort(key=o.name_of)
        endpoints = []
        for pod in pods:
            serving = o.is_pod_ready(pod)
            terminating = o.is_terminating(pod)
            endpoint: Obj = {
                "addresses": [pod["status"]["podIP"]],
                "conditions": {
                    "ready": publish_not_ready or (serving and not terminating),
                    "serving": serving,
                    "terminating": terminating,
                },
                "targetRef": {
                    "kind": "Pod",
                    "name": o.name_of(pod),
                    "namespace": namespace,
                    "uid": o.uid_of(pod),
                },
            }
            node_name = pod["spec"].get("nodeName")
            if node_name:
                endpoint["nodeName"] = node_name
                zone = o.labels(nodes.get(node_name, {"metadata": {}})).get(ZONE_LABEL)
                if zone:
                    endpoint["zone"] = zone
            if pod["spec"].get("hostname") and pod["spec"].get("subdomain") == o.name_of(service):
                endpoint["hostname"] = pod["spec"]["hostname"]
            endpoints.append(endpoint)
        desired: Obj = {
            "metadata": {
                "name": slice_name(service),
                "namespace": namespace,
                "labels": {SERVICE_NAME_LABEL: o.name_of(service), MANAGED_BY_LABEL: MANAGED_BY},
                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": cp.clock.timestamp()},
                "ownerReferences": [o.owner_reference(service)],
                "generateName": f"{o.name_of(service)}-",
            },
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": _ports(service, pods),
        }
        existing = cp.store.find("endpointslices", namespace, slice_name(service))
        if existing is None:
            cp.store.create("endpointslices", desired)
            continue
        if existing.get("endpoints") == endpoints and existing.get("ports") == desired["ports"]:
            continue

        def change(obj: Obj, desired: Obj = desired) -> None:
            obj["endpoints"] = desired["endpoints"]
            obj["ports"] = desired["ports"]
            obj["metadata"]["annotations"] = desired["metadata"]["annotations"]

        cp.store.mutate("endpointslices", namespace, slice_name(service), change)
