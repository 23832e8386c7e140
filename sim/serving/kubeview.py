"""The serving layer's read-only view of the simulated cluster.

Kept current from the object store's watch events (no deep-copying list per
tick): what a gateway would route to is derived from EndpointSlices and pod labels
here (``routed_pods``), and the engine supervisor derives which engines exist from pods.
Watch callbacks may arrive on any thread; they only replace dict entries and
bump a generation counter, which the serving tick loop reads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from fleet.vocabulary import MODEL_LABEL, ROUTER_LABEL, ROUTER_LABEL_VALUE
from sim.k8s.devices import GpuLedger
from sim.k8s.store import ObjectStore, WatchEvent

Obj = dict[str, Any]
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_KINDS = ("pods", "nodes", "services", "endpointslices", "deployments", "leaderworkersets")


def _key(obj: Obj) -> tuple[str, str]:
    meta = obj.get("metadata", {})
    return meta.get("namespace", "") or "", meta["name"]


class KubeView:
    """Current pods, nodes, Services and EndpointSlices by (namespace, name)."""

    def __init__(self, store: ObjectStore, devices: GpuLedger | None = None) -> None:
        self._store = store
        # Which pod holds which GPU: the control plane's ledger (a view of its own when there is none).
        self.devices = devices if devices is not None else GpuLedger(store)
        self._lock = threading.Lock()
        self.objects: dict[str, dict[tuple[str, str], Obj]] = {kind: {} for kind in _KINDS}
        self.generation = 0
        self.on_change: Callable[[], None] = lambda: None  # called after every change it sees
        self._unsubscribe = store.watch(self._on_event)
        for kind in _KINDS:
            for obj in store.list(kind):
                self.objects[kind][_key(obj)] = obj

    def close(self) -> None:
        self._unsubscribe()

    def _on_event(self, event: WatchEvent) -> None:
        if event.resource not in self.objects:
            return
        with self._lock:
            table = self.objects[event.resource]
            if event.type == "DELETED":
                table.pop(_key(event.object), None)
            else:
                table[_key(event.object)] = event.object
            self.generation += 1
        self.on_change()

    # ---- lookups (return the cached dicts; callers must not mutate them) ----------
    def pods(self) -> list[Obj]:
        with self._lock:
            return list(self.objects["pods"].values())

    def pod(self, namespace: str, name: str) -> Obj | None:
        return self.objects["pods"].get((namespace, name))

    def node(self, name: str) -> Obj | None:
        return self.objects["nodes"].get(("", name))

    def nodes(self) -> list[Obj]:
        with self._lock:
            return list(self.objects["nodes"].values())

    def service(self, namespace: str, name: str) -> Obj | None:
        return self.objects["services"].get((namespace, name))

    def services(self) -> list[Obj]:
        with self._lock:
            return list(self.objects["services"].values())

    def endpoint_slices(self, namespace: str, service: str) -> list[Obj]:
        with self._lock:
            return [
                s
                for (ns, _), s in self.objects["endpointslices"].items()
                if ns == namespace and (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL) == service
            ]


def pod_labels(pod: Obj) -> dict[str, str]:
    return pod.get("metadata", {}).get("labels") or {}


def pod_is_terminating(pod: Obj) -> bool:
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def pod_condition(pod: Obj, kind: str) -> str | None:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond.get("status")
    return None


def node_ready(node: Obj) -> str | None:
    for cond in node.get("status", {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status")
    return None


def routed_pods(kube: KubeView, pool: str) -> list[tuple[str, str | None]]:
    """``(pod, node)`` of every endpoint a gateway routes pool ``namespace/service`` to: the ready
    endpoints of the Service's EndpointSlices whose pods carry the router-only label.

    The same rule fleetmend's gateway control plane reads from the Kubernetes API
    (``gateway.world``); the simulator uses it to time a deroute without a gateway of its own.
    """
    namespace, _, service = pool.partition("/")
    out: list[tuple[str, str | None]] = []
    for eps in kube.endpoint_slices(namespace, service):
        for ep in eps.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            name = (ep.get("targetRef") or {}).get("name")
            pod = kube.pod(namespace, name) if name else None
            if pod is None or pod_labels(pod).get(ROUTER_LABEL) != ROUTER_LABEL_VALUE:
                continue
            if all(name != seen for seen, _ in out):
                out.append((str(name), (pod.get("spec") or {}).get("nodeName")))
    return out


def served_models(kube: KubeView, engine_names: Callable[[str], list[str]]) -> dict[str, str]:
    """Model names (the pods' model label and the names their engines serve) -> pool ``ns/service``,
    from the pods behind each Service: the Service a user names (as ``Host``) for a model."""
    out: dict[str, str] = {}
    for svc in kube.services():
        selector = (svc.get("spec") or {}).get("selector") or {}
        if not selector:
            continue
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        for pod in kube.pods():
            labels = pod_labels(pod)
            if pod["metadata"]["namespace"] != ns or any(labels.get(k) != v for k, v in selector.items()):
                continue
            model = labels.get(MODEL_LABEL)
            if model:
                out.setdefault(model, f"{ns}/{name}")
                for served in engine_names(f"{ns}/{pod['metadata']['name']}"):
                    out.setdefault(served, f"{ns}/{name}")
    return out
