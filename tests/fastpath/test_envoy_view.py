"""The fast path takes engine health from Envoy's own view, not from polling every engine.

A real Envoy configured by fleetmend's control plane health-checks every engine; the fast path
reads its admin API (a few figures per cluster each interval, the hosts only when they moved).
While every engine answers, the fast path sends no engine a single ``/health`` request (the
engines' own request accounting says so) and reads a host list no more often than Envoy itself
recorded a failed check (its own counters: on a loaded machine a check can time out once without
failing the host, and that reading moves). When a GPU node dies, its
engines stop answering while Kubernetes still calls their pods Ready (the node-monitor grace has
not passed): Envoy fails them, the fast path takes them as suspects, confirms each with its own
``/health`` check and reports the loss.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from temporalio.client import Client

from fleet.detection import EvidenceKind
from fleet.vocabulary import FaultKind
from gateway.store import envoy_admin_urls
from tests.support import POOL, gpu_pool
from worker.devstack.rig import FleetRig
from worker.fastpath.envoy import FIGURES, STATS_FILTER, cluster_figures
from worker.fastpath.service import FASTPATH_USER_AGENT, FastPath
from worker.intake.intake import Delivery
from worker.intake.routing import RoutedReport
from worker.intake.topology import PoolTopology

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SETTINGS: dict[str, Any] = {"fastpath_lease_namespace": "fleetmend"}  # where the shipped Role grants it
QUIET_READINGS = 10  # readings of Envoy's view over which a healthy fleet costs no engine a request


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.05)


async def _envoy_failed_checks(rig: FleetRig) -> int:
    """Failed active health checks every connected Envoy counted, over all clusters (its own /stats)."""
    failed = [FIGURES.index("health_check.failure"), FIGURES.index("health_check.network_failure")]
    admins = await asyncio.to_thread(envoy_admin_urls, (), rig.gateway_adapter.store)
    assert admins, "no Envoy is connected to the control plane"
    total = 0
    for admin in admins:
        r = await rig.http.get(f"{admin}/stats", params={"format": "json", "filter": STATS_FILTER})
        r.raise_for_status()
        total += sum(f[i] for f in cluster_figures(r.json()).values() for i in failed)
    return total


def _fastpath_health_requests(rig: FleetRig) -> int:
    """``GET /health`` requests the engines served to the fast path (by its user agent)."""
    served = rig.sim.world.serving.engine_servers.served_to
    return sum(n for (path, agent), n in served.items() if path == "/health" and agent == FASTPATH_USER_AGENT)


async def test_a_healthy_fleet_costs_no_engine_a_request_and_a_dead_node_is_found_through_envoy(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(
        temporal_client, task_queue, ledger_url, run_worker=False, in_process_sim=True, **SETTINGS
    ) as rig:
        delivered: list[RoutedReport] = []

        async def deliver(reports: list[RoutedReport]) -> list[Delivery | None]:
            delivered.extend(reports)
            return [None] * len(reports)

        fast = FastPath(
            rig.settings, deliver, PoolTopology.from_settings(rig.settings), identity="fastpath-envoy"
        )
        routed = await rig.routing_set(POOL)
        stop = asyncio.Event()
        running = asyncio.create_task(fast.run(stop))
        try:
            # Every routed engine is known as answering from Envoy's health check alone.
            await _until(
                lambda: all(
                    (s := fast.state(f"pod:{POOL.namespace}/{pod}")) is not None and s.answered
                    for pod in routed
                ),
                f"the fast path learns from Envoy that {routed} answer",
            )
            view = fast.gateway
            assert view is not None
            failed_before = await _envoy_failed_checks(rig)
            # A reading begun after that count: a check that failed before it is read by now.
            after = fast.counts["gateway_readings"] + 2
            await _until(lambda: fast.counts["gateway_readings"] >= after, "two more readings")
            readings, host_reads = fast.counts["gateway_readings"], view.clusters_reads
            stats_reads = view.stats_reads
            await _until(
                lambda: fast.counts["gateway_readings"] >= readings + QUIET_READINGS,
                f"{QUIET_READINGS} more readings of Envoy's view",
            )
            failed_in_window = await _envoy_failed_checks(rig) - failed_before
            # Quiet: figures read every interval; the host list only where Envoy recorded a failed
            # check (none on an idle machine); no engine asked anything.
            assert view.stats_reads - stats_reads >= QUIET_READINGS
            assert view.clusters_reads - host_reads <= failed_in_window, (
                f"{view.clusters_reads - host_reads} host-list reads over {QUIET_READINGS} readings, "
                f"Envoy recorded {failed_in_window} failed checks"
            )
            assert _fastpath_health_requests(rig) == 0

            pods = {
                p.metadata.name: p.spec.node_name
                for p in (await asyncio.to_thread(rig.core.list_namespaced_pod, POOL.namespace)).items
                if p.metadata.name in routed
            }
            node = pods[routed[0]]
            on_node = {f"pod:{POOL.namespace}/{p}" for p, n in pods.items() if n == node}
            assert (await rig.inject(FaultKind.NODE_LOST, node))["accepted"]
            lost_at = time.monotonic()
            await _until(
                lambda: on_node <= {f"pod:{r.report.pool.namespace}/{r.report.pod}" for r in delivered},
                f"the fast path reports {sorted(on_node)}",
            )
            print(f"node lost -> every engine on it reported: {time.monotonic() - lost_at:.2f} s")
            node_now = await asyncio.to_thread(rig.core.read_node, node)
        finally:
            stop.set()
            await asyncio.wait_for(running, timeout=20)

    # Kubernetes still called the node Ready: Envoy's view found its engines.
    ready = next(c for c in node_now.status.conditions if c.type == "Ready")
    assert ready.status == "True", ready
    losses = [d for d in fast.detections if d.loss]
    assert {d.entity for d in losses} == on_node, losses
    for loss in losses:
        kinds = [e.kind for e in loss.evidence]
        assert EvidenceKind.GATEWAY_UNHEALTHY in kinds, loss
        assert kinds.count(EvidenceKind.HEALTH_FAILED) == fast.policy.failures_to_confirm, loss
        assert "consecutive failed checks" in loss.reason and "failed_active_health_check" in str(
            loss.evidence
        )
    assert {r.report.pod for r in delivered} == {e.partition("/")[2] for e in on_node}, delivered
    # The confirmations went only to the dead engines (which refused them): no engine that answers was asked.
    assert _fastpath_health_requests(rig) == 0
    assert fast.counts["health_checks"] == len(on_node) * fast.policy.failures_to_confirm, fast.counts
