"""The fast path's pod index (one update per pod event, O(1) questions) and its reading of Envoy's admin JSON."""

from __future__ import annotations

from typing import Any

from fleet.vocabulary import LWS_GROUP_KEY_LABEL, LWS_WORKER_INDEX_LABEL, ROUTER_LABEL, ROUTER_LABEL_VALUE
from worker.fastpath.envoy import FIGURES, cluster_figures, host_health
from worker.fastpath.index import PodIndex

NS = "inference"


def _pod(
    name: str, node: str, ip: str | None, *, routed: bool = True, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    labels = dict(labels or {})
    if routed:
        labels[ROUTER_LABEL] = ROUTER_LABEL_VALUE
    return {
        "metadata": {"namespace": NS, "name": name, "labels": labels},
        "spec": {"nodeName": node},
        "status": {"podIP": ip} if ip else {},
    }


def _index() -> PodIndex:
    return PodIndex(lambda p: (p["metadata"]["labels"] or {}).get(ROUTER_LABEL) == ROUTER_LABEL_VALUE)


def test_the_index_follows_each_pod_event_routed_by_node_by_ip_and_deletions() -> None:
    index = _index()
    index.update("ADDED", _pod("a", "node-0", None))  # scheduled, no IP yet
    index.update("ADDED", _pod("spare", "node-1", "10.0.1.9", routed=False))
    assert index.serves_on("node-0") and not index.serves_on("node-1")  # a spare serves nothing
    assert index.by_ip("10.0.0.5") is None and index.by_ip("10.0.1.9") == f"{NS}/spare"
    index.update("MODIFIED", _pod("a", "node-0", "10.0.0.5"))
    assert index.by_ip("10.0.0.5") == f"{NS}/a" and index.routed(f"{NS}/a")
    index.update("MODIFIED", _pod("a", "node-0", "10.0.0.5", routed=False))  # derouted
    assert not index.routed(f"{NS}/a") and not index.serves_on("node-0")
    index.update("DELETED", _pod("a", "node-0", "10.0.0.5", routed=False))
    assert index.pod(f"{NS}/a") is None and index.by_ip("10.0.0.5") is None and len(index) == 1
    # An IP handed to a new pod is the new pod's, whichever event comes first.
    index.update("ADDED", _pod("b", "node-2", "10.0.1.9"))
    index.update("DELETED", _pod("spare", "node-1", "10.0.1.9", routed=False))
    assert index.by_ip("10.0.1.9") == f"{NS}/b" and index.serves_on("node-2")


def test_the_index_names_each_leaderworkerset_groups_leader() -> None:
    index = _index()
    group = {LWS_GROUP_KEY_LABEL: "g1"}
    index.update(
        "ADDED",
        _pod("big-0-1", "node-1", "10.0.1.2", routed=False, labels={**group, LWS_WORKER_INDEX_LABEL: "1"}),
    )
    assert index.leader(NS, "g1") is None
    index.update("ADDED", _pod("big-0", "node-0", "10.0.0.2", labels={**group, LWS_WORKER_INDEX_LABEL: "0"}))
    leader = index.leader(NS, "g1")
    assert leader is not None and leader["metadata"]["name"] == "big-0"
    assert index.leader("other", "g1") is None
    index.update(
        "DELETED", _pod("big-0", "node-0", "10.0.0.2", labels={**group, LWS_WORKER_INDEX_LABEL: "0"})
    )
    assert index.leader(NS, "g1") is None


def test_envoy_figures_are_read_per_cluster_whatever_the_cluster_name_holds() -> None:
    stats = {
        "stats": [
            {"name": f"cluster.inference/llama.{figure}", "value": n} for n, figure in enumerate(FIGURES, 1)
        ]
        + [{"name": "cluster.a.b.c.membership_healthy", "value": 7}, {"name": "server.uptime", "value": 3}]
    }
    figures = cluster_figures(stats)
    assert figures["inference/llama"] == tuple(range(1, len(FIGURES) + 1))
    assert figures["a.b.c"][FIGURES.index("membership_healthy")] == 7 and set(figures) == {
        "inference/llama",
        "a.b.c",
    }


def test_envoy_host_health_fails_on_its_checks_and_ejections_and_waits_on_pending_flags() -> None:
    def host(**status: Any) -> dict[str, Any]:
        return {
            "address": {"socket_address": {"address": "127.0.0.7", "port_value": 8000}},
            "hostname": "llama-0",
            "health_status": {"eds_health_status": "HEALTHY", **status},
        }

    healthy = host_health("http://envoy:9901", "inference/llama", host())
    assert healthy is not None and healthy.healthy and (healthy.address, healthy.port) == ("127.0.0.7", 8000)
    failed = host_health("http://envoy:9901", "inference/llama", host(failed_active_health_check=True))
    assert failed is not None and failed.failed == ("failed_active_health_check",) and not failed.healthy
    assert "failed_active_health_check" in failed.describe() and "127.0.0.7:8000" in failed.describe()
    ejected = host_health("e", "c", host(failed_outlier_check=True, eds_health_status="UNHEALTHY"))
    assert ejected is not None and ejected.failed == ("failed_outlier_check", "eds_health_status=UNHEALTHY")
    pending = host_health("e", "c", host(pending_active_hc=True))
    assert pending is not None and not pending.healthy and not pending.failed
    assert host_health("e", "c", {"address": {"pipe": {"path": "/x"}}}) is None
