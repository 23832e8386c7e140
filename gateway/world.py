"""The routing set, as Kubernetes states it: which engines each pool's Envoy cluster may send to.

A pool is a Service. Its hosts are the EndpointSlice endpoints that are ready (and serving, by
default), whose pods carry the router-only label (``fleet.vocabulary.ROUTER_LABEL``): removing
that label is how fleetmend deroutes a pod without orphaning it from its workload.

One exception: an endpoint that is not ready only because its node went silent (Ready=Unknown:
the kubelet stopped posting status, and the node controller marked its pods not ready) stays a
host while it is not terminating. A top-of-rack switch cut silences kubelets whose engines still
serve; Envoy's own active health check (every 0.5 s) decides whether such a host gets requests,
so a dead machine still leaves rotation within a second, while a cut-off one keeps serving (#30).

Read with four cluster-wide watches (Services, EndpointSlices, labelled Pods, Nodes:
``RoutingWatch``), not a request per pool and not a poll.

The routing set is kept per pool and rebuilt on change: a watch event marks only the pools it can
touch (a Service its own pool, an EndpointSlice the pool its ``kubernetes.io/service-name`` label
names, a Pod the pools whose slices point at it), and reading the set recomputes only those. A
quiet fleet costs nothing to read, whatever its number of pods.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Container, Iterable
from typing import Any

from fleet.vocabulary import ROUTER_LABEL, ROUTER_LABEL_VALUE
from gateway.resources import RoutedHost
from kube.client import KubeApis
from kube.informer import Informer, object_key

Obj = dict[str, Any]
PodKey = tuple[str, str]  # (namespace, name)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def is_routed(
    pod: Obj, router_label: str = ROUTER_LABEL, router_label_value: str = ROUTER_LABEL_VALUE
) -> bool:
    """Pure: the pod carries the router label and is not being deleted."""
    meta = pod.get("metadata") or {}
    return (meta.get("labels") or {}).get(router_label) == router_label_value and not meta.get(
        "deletionTimestamp"
    )


def slice_pool(eps: Obj) -> str | None:
    """Pure: the pool ("ns/svc") an EndpointSlice belongs to, or None for a slice of no Service."""
    meta = eps.get("metadata") or {}
    service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
    return f"{meta.get('namespace')}/{service}" if service else None


def slice_pods(eps: Obj) -> set[PodKey]:
    """Pure: the pods an EndpointSlice's endpoints point at (their ``targetRef``)."""
    namespace = (eps.get("metadata") or {}).get("namespace") or ""
    return {
        (namespace, str(ref["name"]))
        for ep in eps.get("endpoints") or []
        if (ref := ep.get("targetRef") or {}).get("name")
    }


def pool_hosts(
    slices: Iterable[Obj],
    routed: Container[PodKey],
    *,
    require_serving: bool = True,
    silent_nodes: Container[str] = frozenset(),
) -> tuple[RoutedHost, ...]:
    """Pure: one pool's routed hosts, from its EndpointSlices and the set of routed pods
    (``silent_nodes``: nodes whose kubelet stopped posting status; module doc)."""
    hosts: dict[str, RoutedHost] = {}
    for eps in slices:
        namespace = eps["metadata"]["namespace"]
        port = next((p.get("port") for p in eps.get("ports") or [] if p.get("port")), None)
        if port is None:
            continue
        for ep in eps.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            cut_off = ep.get("nodeName") in silent_nodes and cond.get("terminating") is not True
            if not cut_off and (
                cond.get("ready") is False or (require_serving and cond.get("serving") is False)
            ):
                continue
            ref = ep.get("targetRef") or {}
            pod = ref.get("name")
            addresses = ep.get("addresses") or []
            if not pod or not addresses or (namespace, pod) not in routed:
                continue
            hosts[pod] = RoutedHost(pod=pod, address=addresses[0], port=int(port), node=ep.get("nodeName"))
    return tuple(sorted(hosts.values(), key=lambda h: h.pod))


def hosts_from(
    services: Iterable[Obj],
    slices: Iterable[Obj],
    pods: Iterable[Obj],
    *,
    router_label: str = ROUTER_LABEL,
    router_label_value: str = ROUTER_LABEL_VALUE,
    require_serving: bool = True,
) -> dict[str, tuple[RoutedHost, ...]]:
    """Pure: pool ("ns/svc") -> its routed hosts, from Services, EndpointSlices and Pods as listed."""
    pools = {f"{s['metadata']['namespace']}/{s['metadata']['name']}" for s in services}
    routed = {
        (p["metadata"]["namespace"], p["metadata"]["name"])
        for p in pods
        if is_routed(p, router_label, router_label_value)
    }
    by_pool: dict[str, list[Obj]] = defaultdict(list)
    for eps in slices:
        pool = slice_pool(eps)
        if pool in pools:
            by_pool[pool].append(eps)
    return {
        pool: pool_hosts(by_pool.get(pool, ()), routed, require_serving=require_serving)
        for pool in sorted(pools)
    }


class RoutingIndex:
    """The routing set kept per pool from watch events, recomputed only where an event landed.

    ``generation`` moves on every event; ``version`` only when a pool's routed hosts may have changed
    (that pool is then marked dirty). Calling the index recomputes the dirty pools alone and returns
    the whole routing set: the same dict object as long as nothing changed (treat it as read-only),
    and in a new dict every unchanged pool keeps the very tuple it had. ``subscribe`` registers a
    callback run (on the thread that delivered the event) when a pool becomes dirty."""

    def __init__(
        self,
        *,
        router_label: str = ROUTER_LABEL,
        router_label_value: str = ROUTER_LABEL_VALUE,
        require_serving: bool = True,
    ) -> None:
        self.router_label, self.router_label_value = router_label, router_label_value
        self.require_serving = require_serving
        self.generation = 0
        self.version = 0
        self.recomputed_pools = 0  # pools whose hosts were recomputed since start
        self._lock = threading.Lock()
        self._pools: set[str] = set()  # pools that exist: a Service of that name
        self._slices: dict[str, Obj] = {}  # slice key -> slice
        self._slice_pool: dict[str, str] = {}  # slice key -> its pool
        self._pool_slices: dict[str, dict[str, Obj]] = defaultdict(dict)
        self._pod_slices: dict[PodKey, set[str]] = defaultdict(set)  # pod -> keys of slices pointing at it
        self._routed: set[PodKey] = set()
        self._silent: set[str] = set()  # nodes whose Ready is Unknown (kubelet silent)
        self._hosts: dict[str, tuple[RoutedHost, ...]] = {}
        self._view: dict[str, tuple[RoutedHost, ...]] = {}
        self._dirty: set[str] = set()
        self._listeners: list[Callable[[], None]] = []

    # ----------------------------------------------------------- watch events (informer threads)
    def on_event(self, resource: str, kind: str, obj: Obj) -> None:
        """Apply one watch event (``resource``: services, endpointslices, pods or nodes)."""
        {
            "services": self._on_service,
            "endpointslices": self._on_slice,
            "pods": self._on_pod,
            "nodes": self._on_node,
        }[resource](kind, obj)

    def _on_node(self, kind: str, obj: Obj) -> None:
        name = str((obj.get("metadata") or {}).get("name") or "")
        ready = next(
            (
                c.get("status")
                for c in (obj.get("status") or {}).get("conditions") or []
                if c.get("type") == "Ready"
            ),
            None,
        )
        with self._lock:
            self.generation += 1
            silent = kind != "DELETED" and ready == "Unknown"
            if silent == (name in self._silent):
                return  # only whether the kubelet went silent matters here
            if silent:
                self._silent.add(name)
            else:
                self._silent.discard(name)
            # The pools with an endpoint on that node (a node's change is rare: a scan of the slices).
            touched = {
                pool
                for key, eps in self._slices.items()
                if any(ep.get("nodeName") == name for ep in eps.get("endpoints") or [])
                and (pool := self._slice_pool.get(key)) is not None
            }
            woke = self._mark(touched)
        self._notify(woke)

    def _on_service(self, kind: str, obj: Obj) -> None:
        meta = obj.get("metadata") or {}
        pool = f"{meta.get('namespace')}/{meta.get('name')}"
        with self._lock:
            self.generation += 1
            exists = kind != "DELETED"
            if exists == (pool in self._pools):
                return  # only a Service's existence shapes the routing set
            if exists:
                self._pools.add(pool)
            else:
                self._pools.discard(pool)
            woke = self._mark({pool})
        self._notify(woke)

    def _on_slice(self, kind: str, obj: Obj) -> None:
        key = object_key(obj)
        with self._lock:
            self.generation += 1
            touched: set[str] = set()
            old = self._slices.pop(key, None)
            if old is not None:
                old_pool = self._slice_pool.pop(key)
                self._pool_slices[old_pool].pop(key, None)
                if not self._pool_slices[old_pool]:
                    del self._pool_slices[old_pool]
                for pod in slice_pods(old):
                    refs = self._pod_slices.get(pod)
                    if refs is not None:
                        refs.discard(key)
                        if not refs:
                            del self._pod_slices[pod]
                touched.add(old_pool)
            pool = slice_pool(obj)
            if kind != "DELETED" and pool is not None:
                self._slices[key] = obj
                self._slice_pool[key] = pool
                self._pool_slices[pool][key] = obj
                for pod in slice_pods(obj):
                    self._pod_slices[pod].add(key)
                touched.add(pool)
            woke = self._mark(touched)
        self._notify(woke)

    def _on_pod(self, kind: str, obj: Obj) -> None:
        meta = obj.get("metadata") or {}
        pod: PodKey = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        with self._lock:
            self.generation += 1
            routed = kind != "DELETED" and is_routed(obj, self.router_label, self.router_label_value)
            if routed == (pod in self._routed):
                return  # only whether a pod is routed matters; its address comes from its slice
            if routed:
                self._routed.add(pod)
            else:
                self._routed.discard(pod)
            woke = self._mark({self._slice_pool[k] for k in self._pod_slices.get(pod, ())})
        self._notify(woke)

    def _mark(self, pools: set[str]) -> bool:
        """Mark ``pools`` dirty (under the lock); True when the set went from clean to dirty."""
        if not pools:
            return False
        was_clean = not self._dirty
        self._dirty |= pools
        self.version += 1
        return was_clean

    def _notify(self, woke: bool) -> None:
        if woke:
            for listener in list(self._listeners):
                listener()

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` (from a watch thread; keep it short) whenever a pool becomes dirty;
        returns the function that unsubscribes it."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    # ------------------------------------------------------------------------------------- read
    @property
    def dirty(self) -> frozenset[str]:
        """The pools a watch event touched since the last read."""
        with self._lock:
            return frozenset(self._dirty)

    def __call__(self) -> dict[str, tuple[RoutedHost, ...]]:
        with self._lock:
            if not self._dirty:
                return self._view
            for pool in self._dirty:
                if pool in self._pools:
                    self._hosts[pool] = pool_hosts(
                        self._pool_slices.get(pool, {}).values(),
                        self._routed,
                        require_serving=self.require_serving,
                        silent_nodes=self._silent,
                    )
                else:
                    self._hosts.pop(pool, None)
            self.recomputed_pools += len(self._dirty)
            self._dirty.clear()
            self._view = dict(sorted(self._hosts.items()))
            return self._view


class RoutingWatch(RoutingIndex):
    """The routing index fed by four informers (list + watch: Services, EndpointSlices,
    router-labelled Pods and Nodes), one watch per resource type whatever the number of pools;
    reading it costs the API server nothing."""

    def __init__(
        self,
        kube: KubeApis,
        *,
        service_selector: str | None = None,
        router_label: str = ROUTER_LABEL,
        router_label_value: str = ROUTER_LABEL_VALUE,
        require_serving: bool = True,
    ) -> None:
        super().__init__(
            router_label=router_label, router_label_value=router_label_value, require_serving=require_serving
        )
        self._stop = threading.Event()
        self.informers = [
            Informer(
                "services",
                kube.core.list_service_for_all_namespaces,
                self._on_service,
                label_selector=service_selector,
            ),
            Informer("endpointslices", kube.discovery.list_endpoint_slice_for_all_namespaces, self._on_slice),
            Informer(
                "pods",
                kube.core.list_pod_for_all_namespaces,
                self._on_pod,
                label_selector=f"{router_label}={router_label_value}",
            ),
            Informer("nodes", kube.core.list_node, self._on_node),
        ]
        self._threads: list[threading.Thread] = []

    # --------------------------------------------------------------------------------- lifecycle
    def start(self) -> RoutingWatch:
        for informer in self.informers:
            informer.sync()  # the first snapshot is complete before anyone reads it
        for informer in self.informers:
            thread = threading.Thread(
                target=informer.run, args=(self._stop,), name=f"gateway-watch-{informer.name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for informer in self.informers:
            informer.stop()
        # A watch ends at its next event or when the API server closes it; the threads are daemons
        # and leave on their own once stopped, so nobody waits for a quiet watch here.
        for thread in self._threads:
            thread.join(0.1)
