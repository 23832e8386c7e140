"""What the fast path needs to know about the managed pools' pods, kept up to date one pod event at a time.

The pods informer hands every change of a pod to ``PodIndex.update``; the other handlers ask
the index instead of scanning every pod: is a routed (or any managed) pod on this node (a node event), is
this EndpointSlice endpoint's pod routed (a slice event), which pod leads this LeaderWorkerSet
group (a rank's restart), which pod has this IP (an address Envoy reports failing). Each
question and each update costs O(1) (a node's set of routed pods aside), whatever the fleet's size.

The informers run on their own threads; one lock guards the index.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from fleet.vocabulary import LWS_GROUP_KEY_LABEL, LWS_WORKER_INDEX_LABEL

Pod = dict[str, Any]


def pod_key(pod: Pod) -> str:
    """``namespace/name``: the informer cache's key and the fast path's name for a pod."""
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


def _labels(pod: Pod) -> dict[str, str]:
    return dict((pod.get("metadata") or {}).get("labels") or {})


def _leader_of(pod: Pod) -> tuple[str, str] | None:
    """(namespace, group) when ``pod`` is the leader (worker index 0) of a LeaderWorkerSet group."""
    labels = _labels(pod)
    group = labels.get(LWS_GROUP_KEY_LABEL)
    if group is None or labels.get(LWS_WORKER_INDEX_LABEL) != "0":
        return None
    return str((pod.get("metadata") or {}).get("namespace") or ""), group


class PodIndex:
    """The managed pods by key, by node (routed ones), by pod IP, and each group's leader."""

    def __init__(self, routed: Callable[[Pod], bool]) -> None:
        self._is_routed = routed
        self._lock = threading.Lock()
        self._pods: dict[str, Pod] = {}
        self._routed: set[str] = set()
        self._routed_by_node: dict[str, set[str]] = {}
        self._by_node: dict[str, set[str]] = {}  # every managed pod (routed, spare, derouted) by node
        self._by_ip: dict[str, str] = {}
        self._leaders: dict[tuple[str, str], str] = {}

    def __len__(self) -> int:
        return len(self._pods)

    def update(self, kind: str, pod: Pod) -> Pod | None:
        """Fold one informer event (ADDED / MODIFIED / DELETED) in; returns the pod's previous state."""
        key = pod_key(pod)
        with self._lock:
            before = self._pods.pop(key, None)
            if before is not None:
                self._forget(key, before)
            if kind != "DELETED":
                self._pods[key] = pod
                self._remember(key, pod)
        return before

    def _remember(self, key: str, pod: Pod) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            self._by_node.setdefault(node, set()).add(key)
        if self._is_routed(pod):
            self._routed.add(key)
            if node:
                self._routed_by_node.setdefault(node, set()).add(key)
        ip = (pod.get("status") or {}).get("podIP")
        if ip:
            self._by_ip[ip] = key
        leader = _leader_of(pod)
        if leader is not None:
            self._leaders[leader] = key

    def _forget(self, key: str, pod: Pod) -> None:
        self._routed.discard(key)
        node = (pod.get("spec") or {}).get("nodeName")
        for by_node in (self._routed_by_node, self._by_node):
            if node and node in by_node:
                by_node[node].discard(key)
                if not by_node[node]:
                    del by_node[node]
        ip = (pod.get("status") or {}).get("podIP")
        if ip and self._by_ip.get(ip) == key:
            del self._by_ip[ip]
        leader = _leader_of(pod)
        if leader is not None and self._leaders.get(leader) == key:
            del self._leaders[leader]

    def pod(self, key: str) -> Pod | None:
        with self._lock:
            return self._pods.get(key)

    def routed(self, key: str) -> bool:
        """The pod ``namespace/name`` carries the router-only label (Envoy may send it requests)."""
        with self._lock:
            return key in self._routed

    def serves_on(self, node: str) -> bool:
        """A routed pod of a managed pool runs on ``node``."""
        with self._lock:
            return bool(self._routed_by_node.get(node))

    def routed_on(self, node: str) -> list[Pod]:
        """The routed pods of managed pools on ``node``."""
        with self._lock:
            return [self._pods[k] for k in sorted(self._routed_by_node.get(node, ())) if k in self._pods]

    def hosts(self, node: str) -> bool:
        """A pod of a managed pool (routed or not: a spare, a replica already derouted) is on ``node``."""
        with self._lock:
            return bool(self._by_node.get(node))

    def by_ip(self, ip: str) -> str | None:
        """The pod (``namespace/name``) whose ``status.podIP`` is ``ip``."""
        with self._lock:
            return self._by_ip.get(ip)

    def leader(self, namespace: str, group: str) -> Pod | None:
        """The leader (worker index 0) of LeaderWorkerSet group ``group`` in ``namespace``."""
        with self._lock:
            key = self._leaders.get((namespace, group))
            return self._pods.get(key) if key is not None else None
