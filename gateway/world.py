"""The routing set, as Kubernetes states it: which engines each pool's Envoy cluster may send to.

A pool is a Service. Its hosts are the EndpointSlice endpoints that are ready (and serving, by
default), whose pods carry the router-only label (``fleet.vocabulary.ROUTER_LABEL``): removing
that label is how fleetmend deroutes a pod without orphaning it from its workload. Read with three
cluster-wide watches (Services, EndpointSlices, labelled Pods: ``RoutingWatch``), not a request per
pool and not a poll.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from fleet.vocabulary import ROUTER_LABEL, ROUTER_LABEL_VALUE
from gateway.resources import RoutedHost
from kube.client import KubeApis
from kube.informer import Informer

Obj = dict[str, Any]

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


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
    routed_pods = {
        (p["metadata"]["namespace"], p["metadata"]["name"])
        for p in pods
        if (p["metadata"].get("labels") or {}).get(router_label) == router_label_value
        and not p["metadata"].get("deletionTimestamp")
    }
    hosts: dict[str, dict[str, RoutedHost]] = defaultdict(dict)
    for eps in slices:
        namespace = eps["metadata"]["namespace"]
        pool = f"{namespace}/{(eps['metadata'].get('labels') or {}).get(SERVICE_NAME_LABEL, '')}"
        if pool not in pools:
            continue
        port = next((p.get("port") for p in eps.get("ports") or [] if p.get("port")), None)
        if port is None:
            continue
        for ep in eps.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or (require_serving and cond.get("serving") is False):
                continue
            ref = ep.get("targetRef") or {}
            pod = ref.get("name")
            addresses = ep.get("addresses") or []
            if not pod or not addresses or (namespace, pod) not in routed_pods:
                continue
            hosts[pool][pod] = RoutedHost(
                pod=pod, address=addresses[0], port=int(port), node=ep.get("nodeName")
            )
    return {pool: tuple(sorted(hosts[pool].values(), key=lambda h: h.pod)) for pool in sorted(pools)}


class RoutingWatch:
    """The routing set kept current by three informers (list + watch: Services, EndpointSlices and
    router-labelled Pods), one watch per resource type whatever the number of pools; reading it
    costs the API server nothing. ``generation`` moves on every change."""

    def __init__(
        self,
        kube: KubeApis,
        *,
        service_selector: str | None = None,
        router_label: str = ROUTER_LABEL,
        router_label_value: str = ROUTER_LABEL_VALUE,
    ) -> None:
        self.router_label, self.router_label_value = router_label, router_label_value
        self.generation = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.informers = [
            Informer(
                "services",
                kube.core.list_service_for_all_namespaces,
                self._changed,
                label_selector=service_selector,
            ),
            Informer("endpointslices", kube.discovery.list_endpoint_slice_for_all_namespaces, self._changed),
            Informer(
                "pods",
                kube.core.list_pod_for_all_namespaces,
                self._changed,
                label_selector=f"{router_label}={router_label_value}",
            ),
        ]
        self._threads: list[threading.Thread] = []

    def _changed(self, kind: str, obj: Obj) -> None:
        with self._lock:
            self.generation += 1

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

    def __call__(self) -> dict[str, tuple[RoutedHost, ...]]:
        services, slices, pods = (list(i.cache.values()) for i in self.informers)
        return hosts_from(
            services, slices, pods, router_label=self.router_label, router_label_value=self.router_label_value
        )
