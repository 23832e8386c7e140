"""Which serving pools and replica groups an alerted node or pod belongs to.

Alerts name what Prometheus sees (a node, a pod); fleetmend's incidents are
per pool (the pods behind one Service) and act on whole replica groups. This
module asks the Kubernetes API, with the official (synchronous) client run in
a worker thread, and keeps answers for a few seconds: an alert storm about one
node costs the API server one list call, not a thousand.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.config import ConfigException

from activities.kube import KubeApis, kube_apis
from fleet.incident import PoolRef
from fleet.vocabulary import LWS_GROUP_INDEX_LABEL, LWS_NAME_LABEL, LWS_WORKER_INDEX_LABEL
from worker.config import Settings

T = TypeVar("T")

# DNS-1123 names; anything else in an alert label is not a Kubernetes object name
# (and must never reach a field selector).
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def is_object_name(value: str) -> bool:
    return bool(_DNS_SUBDOMAIN.match(value))


def is_namespace_name(value: str) -> bool:
    return bool(_DNS_LABEL.match(value))


class KubernetesUnavailable(Exception):
    """The Kubernetes API could not answer; the alert should be retried later."""


class PodNotFound(Exception):
    """The alerted pod does not exist (any more)."""


@dataclass(frozen=True)
class AffectedGroup:
    """One replica group of one pool with pods on the alerted node (or the alerted pod)."""

    pool: PoolRef
    replica_group: str
    pods: tuple[str, ...]
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class PodFacts:
    """The few fields of a Pod that decide its pool and replica group."""

    namespace: str
    name: str
    labels: dict[str, str]
    node: str | None
    phase: str | None

    @classmethod
    def of(cls, pod: k8s.V1Pod) -> PodFacts:
        meta = pod.metadata or k8s.V1ObjectMeta()
        return cls(
            namespace=meta.namespace or "",
            name=meta.name or "",
            labels=dict(meta.labels or {}),
            node=pod.spec.node_name if pod.spec else None,
            phase=pod.status.phase if pod.status else None,
        )


@dataclass(frozen=True)
class ServiceFacts:
    namespace: str
    name: str
    selector: dict[str, str]
    headless: bool

    @classmethod
    def of(cls, svc: k8s.V1Service) -> ServiceFacts:
        meta = svc.metadata or k8s.V1ObjectMeta()
        spec = svc.spec or k8s.V1ServiceSpec()
        return cls(
            namespace=meta.namespace or "",
            name=meta.name or "",
            selector=dict(spec.selector or {}),
            headless=spec.cluster_ip == "None",
        )


def replica_group_of(pod: PodFacts) -> str:
    """A LeaderWorkerSet group is ``<lws>-<group index>`` (its leader's name); any other pod is its own group."""
    lws, index = pod.labels.get(LWS_NAME_LABEL), pod.labels.get(LWS_GROUP_INDEX_LABEL)
    if lws and index is not None:
        return f"{lws}-{index}"
    return pod.name


def pools_of(pod: PodFacts, services: Iterable[ServiceFacts], router_label: str) -> list[PoolRef]:
    """Pools whose Service selects the pod.

    The router-only label is left out of the comparison: a pod fleetmend (or an
    operator) already derouted still belongs to its pool. So is a LeaderWorkerSet's
    worker index: the Service selects the leaders, and a worker rank belongs to its
    leader's replica group. Headless Services (rank discovery) are not serving pools.
    """
    ignored = {router_label, LWS_WORKER_INDEX_LABEL} if LWS_NAME_LABEL in pod.labels else {router_label}
    pools: list[PoolRef] = []
    for svc in services:
        if svc.headless:
            continue
        selector = {k: v for k, v in svc.selector.items() if k not in ignored}
        if selector and all(pod.labels.get(k) == v for k, v in selector.items()):
            pools.append(PoolRef(namespace=svc.namespace, service=svc.name))
    return pools


def group_pods(
    pods: Iterable[PodFacts], services_by_namespace: dict[str, list[ServiceFacts]], router_label: str
) -> list[AffectedGroup]:
    """Fold pods into (pool, replica group) entries, in a stable order."""
    found: dict[tuple[PoolRef, str], tuple[list[str], set[str]]] = {}
    for pod in pods:
        if pod.phase == "Succeeded":
            continue
        for pool in pools_of(pod, services_by_namespace.get(pod.namespace, []), router_label):
            names, nodes = found.setdefault((pool, replica_group_of(pod)), ([], set()))
            names.append(pod.name)
            if pod.node:
                nodes.add(pod.node)
    return [
        AffectedGroup(pool=pool, replica_group=group, pods=tuple(sorted(names)), nodes=tuple(sorted(nodes)))
        for (pool, group), (names, nodes) in sorted(found.items(), key=lambda kv: (kv[0][0].key, kv[0][1]))
    ]


class PoolTopology:
    """Resolve nodes and pods to affected pools/replica groups through the Kubernetes API."""

    def __init__(
        self,
        apis: Callable[[], KubeApis],
        *,
        router_label: str,
        cache_ttl_s: float = 5.0,
        request_timeout_s: float = 5.0,
    ) -> None:
        self._apis = apis
        self._router_label = router_label
        self._ttl = cache_ttl_s
        self._timeout = request_timeout_s
        self._cache: dict[tuple[str, ...], tuple[float, asyncio.Future[Any]]] = {}

    @classmethod
    def from_settings(cls, settings: Settings, **kwargs: Any) -> PoolTopology:
        return cls(lambda: kube_apis(settings), router_label=settings.router_label, **kwargs)

    async def groups_on_node(self, node: str) -> list[AffectedGroup]:
        """Every (pool, replica group) with a pod scheduled on ``node``."""
        return await self._cached(("node", node), lambda: self._groups_on_node(node))

    async def groups_of_pod(self, namespace: str, pod: str) -> list[AffectedGroup]:
        """The pod's (pool, replica group) entries, with every pod of that group. Raises ``PodNotFound``."""
        return await self._cached(("pod", namespace, pod), lambda: self._groups_of_pod(namespace, pod))

    async def check(self) -> None:
        """Raise ``KubernetesUnavailable`` unless the API server answers."""
        await self._call(lambda: self._core().get_api_resources(_request_timeout=self._timeout))

    # -- cache: one in-flight lookup per key, shared by every concurrent caller --------------

    async def _cached(self, key: tuple[str, ...], fetch: Callable[[], T]) -> T:
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and (not hit[1].done() or hit[0] > now):
            return await asyncio.shield(hit[1])
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._cache[key] = (now + self._ttl, future)
        try:
            result = await self._call(fetch)
        except asyncio.CancelledError:
            self._cache.pop(key, None)
            future.cancel()
            raise
        except Exception as err:
            self._cache.pop(key, None)  # failures are never cached
            future.set_exception(err)
            future.exception()  # mark retrieved: concurrent waiters may be none
            raise
        future.set_result(result)
        self._cache[key] = (time.monotonic() + self._ttl, future)
        if len(self._cache) > 4096:
            self._cache = {k: v for k, v in self._cache.items() if not v[1].done() or v[0] > time.monotonic()}
        return result

    async def _call(self, fetch: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(fetch)
        except (PodNotFound, KubernetesUnavailable):
            raise
        except ApiException as err:
            raise KubernetesUnavailable(f"Kubernetes API answered {err.status} {err.reason}") from err
        except ConfigException as err:
            raise KubernetesUnavailable(
                f"no Kubernetes configuration ({err}); set FLEETMEND_KUBECONFIG or run in-cluster"
            ) from err
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise KubernetesUnavailable(f"Kubernetes API unreachable: {err}") from err

    # -- synchronous calls, run in a thread ------------------------------------------------

    def _core(self) -> k8s.CoreV1Api:
        return self._apis().core

    def _services(self, namespaces: Iterable[str]) -> dict[str, list[ServiceFacts]]:
        return {
            ns: [
                ServiceFacts.of(s)
                for s in self._core().list_namespaced_service(ns, _request_timeout=self._timeout).items
            ]
            for ns in sorted(set(namespaces))
        }

    def _groups_on_node(self, node: str) -> list[AffectedGroup]:
        listed = self._core().list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", _request_timeout=self._timeout
        )
        pods = [PodFacts.of(p) for p in listed.items]
        services = self._services(p.namespace for p in pods)
        # The pods named are those on this node; the procedure takes the whole replica group.
        return group_pods(pods, services, self._router_label)

    def _groups_of_pod(self, namespace: str, name: str) -> list[AffectedGroup]:
        core = self._core()
        try:
            pod = core.read_namespaced_pod(name, namespace, _request_timeout=self._timeout)
        except ApiException as err:
            if err.status == 404:
                raise PodNotFound(f"pod {namespace}/{name} not found") from err
            raise
        services = self._services([namespace])
        return group_pods([PodFacts.of(pod)], services, self._router_label)
