"""The routing set, as Kubernetes states it: which engines each pool's Envoy cluster may send to.

A pool is a Service. Its hosts are the EndpointSlice endpoints that are ready (and serving, by
default), whose pods carry the router-only label (``fleet.vocabulary.ROUTER_LABEL``): removing
that label is how fleetmend deroutes a pod without orphaning it from its workload. Read with three
cluster-wide LISTs per refresh (Services, EndpointSlices, labelled Pods), not a request per pool.
"""

from __future__ import annotations

from collections import defaultdict

from activities import kube_reads as kr
from activities.kube import KubeApis
from fleet.vocabulary import ROUTER_LABEL, ROUTER_LABEL_VALUE
from gateway.resources import RoutedHost

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def routed_hosts(
    kube: KubeApis,
    *,
    service_selector: str | None = None,
    router_label: str = ROUTER_LABEL,
    router_label_value: str = ROUTER_LABEL_VALUE,
    require_serving: bool = True,
) -> dict[str, tuple[RoutedHost, ...]]:
    """pool ("ns/svc") -> its routed hosts, for every Service matching ``service_selector``."""
    services = kr._load(
        kube.core.list_service_for_all_namespaces(
            label_selector=service_selector or "", _preload_content=False
        )
    ).get("items", [])
    pools = {f"{s['metadata']['namespace']}/{s['metadata']['name']}" for s in services}
    routed_pods = {
        (p["metadata"]["namespace"], p["metadata"]["name"])
        for p in kr._load(
            kube.core.list_pod_for_all_namespaces(
                label_selector=f"{router_label}={router_label_value}", _preload_content=False
            )
        ).get("items", [])
        if not p["metadata"].get("deletionTimestamp")
    }
    slices = kr._load(kube.discovery.list_endpoint_slice_for_all_namespaces(_preload_content=False)).get(
        "items", []
    )
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
