"""Which serving pools and replica groups an alerted node or pod belongs to.

Alerts name what Prometheus sees (a node, a pod); fleetmend's incidents are
per pool (the pods behind one Service) and act on whole replica groups. This
module asks the Kubernetes API, with the official (synchronous) client run in
a worker thread, and keeps answers for a few seconds: an alert storm about one
node costs the API server one list call, not a thousand.

A notification names its entities up front (``PoolTopology.resolve``). A few of
them are looked up one by one (a field-selected pod list per node, one pod read
per pod); past ``batch_threshold`` distinct entities — an Alertmanager group of
thousands of alerts — the whole payload is answered from one paginated list of
every pod and one of every Service, so its cost no longer grows with its size.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.config import ConfigException

from fleet.incident import PoolRef
from fleet.vocabulary import LWS_GROUP_INDEX_LABEL, LWS_NAME_LABEL, LWS_WORKER_INDEX_LABEL, MODEL_LABEL
from kube.client import KubeApis, kube_apis
from worker.config import Settings

T = TypeVar("T")

# Distinct nodes + pods in one notification above which one cluster-wide list answers them all.
BATCH_THRESHOLD = 8
# Page size of that list (the API server's own default chunk size for kubectl is 500).
LIST_PAGE_SIZE = 500

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

    @classmethod
    def from_json(cls, pod: dict[str, Any]) -> PodFacts:
        """From the API's JSON (a list item): no client model per pod, which for a cluster's
        worth of pods is most of the cost of a list."""
        meta = pod.get("metadata") or {}
        return cls(
            namespace=meta.get("namespace") or "",
            name=meta.get("name") or "",
            labels=dict(meta.get("labels") or {}),
            node=(pod.get("spec") or {}).get("nodeName"),
            phase=(pod.get("status") or {}).get("phase"),
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

    @classmethod
    def from_json(cls, svc: dict[str, Any]) -> ServiceFacts:
        meta, spec = svc.get("metadata") or {}, svc.get("spec") or {}
        return cls(
            namespace=meta.get("namespace") or "",
            name=meta.get("name") or "",
            selector=dict(spec.get("selector") or {}),
            headless=spec.get("clusterIP") == "None",
        )


@dataclass
class TopologyAnswers:
    """What one notification's entities resolve to: groups per node, and per pod (``None``: no such pod)."""

    nodes: dict[str, list[AffectedGroup]] = field(default_factory=dict)
    pods: dict[tuple[str, str], list[AffectedGroup] | None] = field(default_factory=dict)
    batched: bool = False


@dataclass(frozen=True)
class ClusterSnapshot:
    """Every pod and Service at one moment, indexed the ways alerts name them."""

    pods_by_node: dict[str, list[PodFacts]]
    pods_by_name: dict[tuple[str, str], PodFacts]
    services: dict[str, list[ServiceFacts]]

    @classmethod
    def of(cls, pods: Iterable[PodFacts], services: Iterable[ServiceFacts]) -> ClusterSnapshot:
        by_node: dict[str, list[PodFacts]] = {}
        by_name: dict[tuple[str, str], PodFacts] = {}
        for pod in pods:
            by_name[(pod.namespace, pod.name)] = pod
            if pod.node:
                by_node.setdefault(pod.node, []).append(pod)
        by_namespace: dict[str, list[ServiceFacts]] = {}
        for svc in services:
            by_namespace.setdefault(svc.namespace, []).append(svc)
        return cls(by_node, by_name, by_namespace)

    def groups_on_node(self, node: str, router_label: str) -> list[AffectedGroup]:
        return group_pods(self.pods_by_node.get(node, []), self.services, router_label)

    def groups_of_pod(self, namespace: str, name: str, router_label: str) -> list[AffectedGroup] | None:
        pod = self.pods_by_name.get((namespace, name))
        return None if pod is None else group_pods([pod], self.services, router_label)


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


# Lookups in flight at once (threads), each one Kubernetes call or two.
LOOKUP_THREADS = 16


class PoolTopology:
    """Resolve nodes and pods to affected pools/replica groups through the Kubernetes API."""

    def __init__(
        self,
        apis: Callable[[], KubeApis],
        *,
        router_label: str,
        cache_ttl_s: float = 5.0,
        request_timeout_s: float = 5.0,
        batch_threshold: int = BATCH_THRESHOLD,
        lookup_threads: int = LOOKUP_THREADS,
    ) -> None:
        self._apis = apis
        # Its own threads: the event loop's default executor has cpu + 4 (6 on 2 cores), and a burst's
        # lookups queued there behind one another and behind everything else the process hands it.
        self._lookups = ThreadPoolExecutor(
            max_workers=lookup_threads, thread_name_prefix="fleetmend-topology"
        )
        weakref.finalize(self, self._lookups.shutdown, wait=False)
        self._router_label = router_label
        self._ttl = cache_ttl_s
        self._timeout = request_timeout_s
        self._batch_threshold = batch_threshold
        self._cache: dict[tuple[str, ...], tuple[float, asyncio.Future[Any]]] = {}
        # A namespace's Services, for as long as an answer is cached: a burst of lost pods in one
        # namespace asks for them once per TTL, not once per pod (threads: the lookups run in them).
        self._service_lists: dict[str, tuple[float, list[ServiceFacts]]] = {}
        self._service_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, **kwargs: Any) -> PoolTopology:
        return cls(
            lambda: kube_apis(settings, settings.kube_connections),
            router_label=settings.router_label,
            **kwargs,
        )

    async def groups_on_node(self, node: str) -> list[AffectedGroup]:
        """Every (pool, replica group) with a pod scheduled on ``node``."""
        return await self._cached(("node", node), lambda: self._groups_on_node(node))

    async def groups_of_pod(self, namespace: str, pod: str) -> list[AffectedGroup]:
        """The pod's (pool, replica group) entries, with every pod of that group. Raises ``PodNotFound``."""
        return await self._cached(("pod", namespace, pod), lambda: self._groups_of_pod(namespace, pod))

    async def resolve(self, nodes: Iterable[str], pods: Iterable[tuple[str, str]]) -> TopologyAnswers:
        """The groups of every named node and pod, with as few API calls as the count allows.

        Raises ``KubernetesUnavailable`` when the API cannot answer (the notification is retried)."""
        node_names, pod_names = sorted(set(nodes)), sorted(set(pods))
        if len(node_names) + len(pod_names) <= self._batch_threshold:
            return await self._resolve_each(node_names, pod_names)
        snapshot: ClusterSnapshot = await self._cached(("cluster",), self._cluster_snapshot)
        label = self._router_label
        return TopologyAnswers(
            nodes={n: snapshot.groups_on_node(n, label) for n in node_names},
            pods={p: snapshot.groups_of_pod(p[0], p[1], label) for p in pod_names},
            batched=True,
        )

    async def _resolve_each(self, nodes: list[str], pods: list[tuple[str, str]]) -> TopologyAnswers:
        async def pod_groups(namespace: str, name: str) -> list[AffectedGroup] | None:
            try:
                return await self.groups_of_pod(namespace, name)
            except PodNotFound:
                return None

        node_groups, pod_answers = await asyncio.gather(
            asyncio.gather(*(self.groups_on_node(n) for n in nodes)),
            asyncio.gather(*(pod_groups(ns, name) for ns, name in pods)),
        )
        return TopologyAnswers(
            nodes=dict(zip(nodes, node_groups, strict=True)), pods=dict(zip(pods, pod_answers, strict=True))
        )

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
            return await asyncio.get_running_loop().run_in_executor(self._lookups, fetch)
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
        return {ns: self._services_of(ns) for ns in sorted(set(namespaces))}

    def _services_of(self, namespace: str) -> list[ServiceFacts]:
        now = time.monotonic()
        with self._service_lock:
            hit = self._service_lists.get(namespace)
        if hit is not None and hit[0] > now:
            return hit[1]
        listed = self._core().list_namespaced_service(namespace, _request_timeout=self._timeout).items
        facts = [ServiceFacts.of(s) for s in listed]
        with self._service_lock:
            self._service_lists[namespace] = (time.monotonic() + self._ttl, facts)
        return facts

    def _list_all(self, list_call: Callable[..., Any], what: str, **selectors: str) -> list[dict[str, Any]]:
        """Every item of a cluster-wide list, page by page, as the API's JSON."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"limit": LIST_PAGE_SIZE, "_request_timeout": self._timeout, **selectors}
            if token:
                kwargs["_continue"] = token
            response = list_call(_preload_content=False, **kwargs)
            try:
                page = json.loads(response.data)
            except ValueError as err:
                raise KubernetesUnavailable(
                    f"Kubernetes API answered a {what} list that is not JSON"
                ) from err
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue") or None
            if not token:
                return items

    def _cluster_snapshot(self) -> ClusterSnapshot:
        core = self._core()
        pods = [
            PodFacts.from_json(p)
            for p in self._list_all(core.list_pod_for_all_namespaces, "pod", label_selector=MODEL_LABEL)
        ]
        services = [
            ServiceFacts.from_json(s) for s in self._list_all(core.list_service_for_all_namespaces, "service")
        ]
        return ClusterSnapshot.of(pods, services)

    def _groups_on_node(self, node: str) -> list[AffectedGroup]:
        # Only the pods that serve a model (the fast path watches the same set): a node also runs
        # agents (DaemonSets: dcgm-exporter, the device plugin, node-problem-detector) in namespaces
        # fleetmend has no Role in and no pool to recover.
        listed = self._core().list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", label_selector=MODEL_LABEL, _request_timeout=self._timeout
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
            if err.status == 403:
                # The shipped RBAC grants fleetmend the namespaces of the pools it serves: a pod it may
                # not read (a node agent in kube-system, say) belongs to no pool it recovers.
                return []
            raise
        facts = PodFacts.of(pod)
        if MODEL_LABEL not in facts.labels:
            return []  # serves no model: no pool of fleetmend's selects it
        return group_pods([facts], self._services([namespace]), self._router_label)
