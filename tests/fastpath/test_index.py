"""The fast path's pod index (one update per pod event, O(1) questions), its reading of Envoy's admin
JSON, and the evidence it takes from what moved in Envoy's view."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fleet.detection import EvidenceKind
from fleet.vocabulary import LWS_GROUP_KEY_LABEL, LWS_WORKER_INDEX_LABEL, ROUTER_LABEL, ROUTER_LABEL_VALUE
from worker.config import load_settings
from worker.fastpath.envoy import FIGURES, GatewayChanges, HostHealth, cluster_figures, host_health
from worker.fastpath.index import PodIndex
from worker.fastpath.service import FastPath

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


def test_envoys_changes_become_evidence_about_routed_pods_once_per_spell() -> None:
    """A host turning healthy says its pod answered; a host Envoy newly fails is a suspect, and one
    it keeps failing is a suspect again only after ``fastpath_reconfirm_s`` with no check running; an
    address no pod has yet is looked up again at the next reading; a spare (not routed) is nobody's
    concern."""
    fast = FastPath(load_settings(fastpath_reconfirm_s=5.0), _no_delivery, topology=None)  # type: ignore[arg-type]
    fast._queue = asyncio.Queue()
    fast.index.update("ADDED", _pod("a", "node-0", "10.0.0.1"))
    fast.index.update("ADDED", _pod("spare", "node-0", "10.0.0.2", routed=False))

    def host(ip: str, *failed: str) -> HostHealth:
        return HostHealth(
            admin="http://envoy:9901",
            cluster=f"{NS}/llama",
            address=ip,
            port=8000,
            hostname="",
            failed=failed,
        )

    def evidence() -> list[tuple[str, EvidenceKind]]:
        assert fast._queue is not None
        return [(e.entity, e.kind) for e in (fast._queue.get_nowait() for _ in range(fast._queue.qsize()))]

    fast._on_gateway(GatewayChanges(healthy=[host("10.0.0.1"), host("10.0.0.2"), host("10.0.0.3")]))
    assert evidence() == [(f"pod:{NS}/a", EvidenceKind.GATEWAY_HEALTHY)]
    fast.index.update("ADDED", _pod("c", "node-1", "10.0.0.3"))  # its IP arrives after Envoy added it
    fast._on_gateway(GatewayChanges())
    assert evidence() == [(f"pod:{NS}/c", EvidenceKind.GATEWAY_HEALTHY)]

    failing = host("10.0.0.1", "failed_active_health_check")
    fast._on_gateway(
        GatewayChanges(failing=[(failing, True), (host("10.0.0.2", "failed_outlier_check"), True)])
    )
    assert evidence() == [(f"pod:{NS}/a", EvidenceKind.GATEWAY_UNHEALTHY)]
    fast._checked_at[f"pod:{NS}/a"] = time.monotonic()  # its check round just ended: the engine answered
    fast._on_gateway(GatewayChanges(failing=[(failing, False)]))
    assert evidence() == []
    fast._checked_at[f"pod:{NS}/a"] = time.monotonic() - 6.0
    fast._on_gateway(GatewayChanges(failing=[(failing, False)]))
    assert evidence() == [(f"pod:{NS}/a", EvidenceKind.GATEWAY_UNHEALTHY)]


async def _no_delivery(reports: list[Any]) -> list[Any]:
    raise AssertionError(f"nothing is delivered in this test: {reports}")
