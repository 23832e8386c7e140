"""A rack of a 64-node fleet lost at once: every pool it hit gets one incident, and each recovery ends or
waits on an operator saying why.

The world is the shipped ``fleet-512`` at 64 nodes (4 racks of 16, 16 pools of TP=1/2/4/8 Deployments and
a multi-node LeaderWorkerSet, warm spares, 8 nodes free), served by the simulator in a process of its own
behind a real Envoy; fleetmend's worker and its fast path (Envoy's health view, the Kubernetes watches)
run against it. The 16 nodes of the rack holding the most pools' routed replicas die at once. What an
SRE checks afterwards: each pool hit has its incident (one, not two), each incident's recovery completed
or is in ``awaiting-operator`` with the reason, nothing failed, one fleet event names the rack with every
pool hit and posts once to the incident channel (the node-level events of the rack's drivers
stay quiet: the rack holds every loss), and the ledger matches the world's own record of
fleetmend's requests. ``bench/fleet_scale.py`` measures the same loss (and a node, and a burst
of 200 nodes) for time and cost; this test asserts behaviour only.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from fleet.fence import fence_workflow_id
from fleet.fleet_event import fleet_event_workflow_id
from fleet.incident import PoolRef, incident_workflow_id
from fleet.recovery import Phase
from fleet.vocabulary import FaultKind
from sim.scenario import Scenario, scaled_scenario
from tests.support import FAST, FAST_PATH_SETTINGS, decisions, finish, reconcile_with_world, status_of
from worker.devstack.rig import FleetRig, compressed_scenario, fleet_rig
from worker.devstack.sim_process import scenario_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NODES = 64
RACK_LABEL = "topology.kubernetes.io/rack"
RECOVERY = "ReplicaLossRecovery"
# A rack's loss is more than the 8 free nodes can replace: a recovery that cannot place its replacements,
# or whose warm floor is not restored, says so after its timeout, so these are short (no load runs, so the
# ramp-back has nothing to measure and ends at its cap); the rest are the suite's compressed timings.
TIMINGS = FAST.model_copy(update={"replacement_timeout_s": 20, "verify_timeout_s": 15, "ramp_max_s": 8})
SETTINGS: dict[str, Any] = {**FAST_PATH_SETTINGS, "recovery_timings": TIMINGS}
SETTLE_S = 150.0


def rack_world(directory: Path) -> Scenario:
    """``fleet-512`` at 64 nodes, engines starting and warming in seconds, nodes NotReady after 5 s."""
    return compressed_scenario(
        scenario_file(scaled_scenario("fleet-512", NODES), directory),
        startup_s=4.0,
        warm_up_s=8.0,
        node_monitor_grace_s=5.0,
    )


async def routed_by_node(rig: FleetRig) -> dict[str, set[PoolRef]]:
    """Node -> the pools with a replica Envoy routes to on it."""
    pools = [
        PoolRef(namespace=w.namespace or rig.scenario.namespace, service=w.name)
        for w in rig.scenario.workloads
    ]
    routed = {pool: set(await rig.routing_set(pool)) for pool in pools}
    pods: Any = await asyncio.to_thread(rig.core.list_namespaced_pod, rig.scenario.namespace)
    found: dict[str, set[PoolRef]] = {}
    for pod in pods.items:
        for pool, names in routed.items():
            if pod.metadata.name in names and pod.spec.node_name:
                found.setdefault(pod.spec.node_name, set()).add(pool)
    return found


async def racks(rig: FleetRig) -> dict[str, list[str]]:
    nodes: Any = await asyncio.to_thread(rig.core.list_node)
    found: dict[str, list[str]] = {}
    for node in nodes.items:
        found.setdefault(node.metadata.labels[RACK_LABEL], []).append(node.metadata.name)
    return found


async def runs(client: Client, workflow_type: str, since: float) -> list[Any]:
    """This test's runs of ``workflow_type``: those started since ``since`` (unix seconds). Earlier tests on
    the same Temporal server ran incidents under the same well-known ids (``incident/<ns>/<pool>``)."""
    after = datetime.fromtimestamp(since - 1, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    query = f'WorkflowType="{workflow_type}" AND StartTime > "{after}"'
    return [wf async for wf in client.list_workflows(query)]


async def settled(client: Client, pools: set[PoolRef], since: float) -> tuple[bool, str]:
    """Whether every pool hit has its incident, each incident its recovery, and each recovery ended or
    waits on an operator; and what is still pending."""
    incidents = {wf.id: wf for wf in await runs(client, "FleetIncident", since)}
    missing = sorted(p.key for p in pools if incident_workflow_id(p) not in incidents)
    if missing:
        return False, f"no incident yet for {missing}"
    for incident in incidents.values():
        if incident.status == WorkflowExecutionStatus.RUNNING:
            status = await status_of(client.get_workflow_handle(incident.id))
            if not status.children:
                return False, f"{incident.id} has no recovery yet"
    for recovery in await runs(client, RECOVERY, since):
        if recovery.status == WorkflowExecutionStatus.RUNNING:
            status = await status_of(client.get_workflow_handle(recovery.id))
            if status.phase != Phase.AWAITING_OPERATOR:
                return False, f"{recovery.id} is {status.phase.value}"
    return True, ""


async def test_a_lost_rack_opens_one_incident_per_pool_hit_and_each_recovers_or_waits_with_a_reason(
    temporal_client: Client, task_queue: str, ledger_url: str, tmp_path: Path
) -> None:
    async with fleet_rig(
        temporal_client,
        scenario=rack_world(tmp_path),
        database_url=ledger_url,
        task_queue=task_queue,
        **SETTINGS,
    ) as rig:
        await rig.pool_ready(timeout_s=90)
        async with rig.fast_path(identity="fastpath-rack"):
            by_node = await routed_by_node(rig)
            rack, nodes = max(
                (await racks(rig)).items(),
                key=lambda item: (len(set().union(*(by_node.get(n, set()) for n in item[1]))), item[0]),
            )
            hit: set[PoolRef] = set().union(*(by_node.get(n, set()) for n in nodes))
            assert len(nodes) == 16 and len(hit) >= 3, f"{rack} holds {sorted(p.key for p in hit)}"
            replies = await asyncio.gather(*(rig.inject(FaultKind.NODE_LOST, n) for n in nodes))
            assert all(r["accepted"] for r in replies), replies

            deadline = time.monotonic() + SETTLE_S
            done, pending = await settled(temporal_client, hit, rig.started_at)
            while not done:
                assert time.monotonic() < deadline, f"{rack} lost {SETTLE_S:g} s ago: {pending}"
                await asyncio.sleep(1.0)  # histories and queries of every open workflow: not every tick
                done, pending = await settled(temporal_client, hit, rig.started_at)

        incidents = await runs(temporal_client, "FleetIncident", rig.started_at)
        opened = Counter(wf.id for wf in incidents)
        assert {incident_workflow_id(p) for p in hit} <= set(opened), opened
        assert [i for i, n in opened.items() if n > 1] == [], "an incident was opened twice"
        assert not any(wf.status == WorkflowExecutionStatus.FAILED for wf in incidents)

        recoveries = await runs(temporal_client, RECOVERY, rig.started_at)
        assert recoveries, "no recovery started"
        outcomes = []
        for recovery in recoveries:
            assert recovery.status in (WorkflowExecutionStatus.COMPLETED, WorkflowExecutionStatus.RUNNING), (
                f"{recovery.id}: {recovery.status}"
            )
            if recovery.status == WorkflowExecutionStatus.RUNNING:
                status = await status_of(temporal_client.get_workflow_handle(recovery.id))
                reason = status.awaiting or (status.refusal.error if status.refusal else "")
                assert status.phase == Phase.AWAITING_OPERATOR and reason, status
                outcomes.append(f"{recovery.id}: waiting: {reason}")
            else:
                outcomes.append(f"{recovery.id}: completed")
        print(f"{rack} lost ({len(hit)} pools):\n  " + "\n  ".join(sorted(outcomes)))

        # The fence at detection: one NodeFence per lost node, each cordoned it (or found it cordoned).
        fences = await runs(temporal_client, "NodeFence", rig.started_at)
        assert {fence_workflow_id(n) for n in nodes} <= {wf.id for wf in fences}, sorted(
            wf.id for wf in fences
        )
        cordoned_by_fence = 0
        for wf in fences:
            assert wf.status == WorkflowExecutionStatus.COMPLETED, f"{wf.id}: {wf.status}"
            fence = await status_of(temporal_client.get_workflow_handle(wf.id))
            assert fence.phase == Phase.DONE, fence
            cordoned_by_fence += "fenced_after_s" in fence.figures
        assert cordoned_by_fence >= 1, "every lost node was cordoned by its recovery before its fence ran"
        listed: Any = await asyncio.to_thread(rig.core.list_node)
        assert all(n.spec.unschedulable for n in listed.items if n.metadata.name in nodes)

        # One fleet event names the rack as the common cause, with every pool hit, and posts once.
        events = {wf.id: wf for wf in await runs(temporal_client, "FleetEvent", rig.started_at)}
        event_id = fleet_event_workflow_id(RACK_LABEL, rack)
        assert event_id in events, sorted(events)
        assert (
            Counter(wf.id for wf in await runs(temporal_client, "FleetEvent", rig.started_at))[event_id] == 1
        )
        event = await finish(temporal_client.get_workflow_handle(event_id), 30)
        assert event.figures["common_cause"] is True, decisions(event)
        assert sorted(event.figures["nodes"]) == sorted(nodes), event.figures
        assert {p.key for p in hit} <= set(event.figures["pools"]), event.figures
        assert set(event.figures["incidents"]) >= {incident_workflow_id(p) for p in hit}
        posts = [m for m in await rig.notifications() if f"FLEET EVENT {RACK_LABEL}={rack}" in m["text"]]
        assert len(posts) == 1, posts
        assert all(p.key in posts[0]["text"] for p in hit), posts[0]["text"]
        # The rack's nodes also joined their driver's node-level event (a third of the fleet runs the newer
        # one; the instance type every node shares starts none): every loss lies in the rack, so those
        # stay quiet (one cause, one post; fleet.fleet_event).
        node_level = [e for e in events if e.startswith(("fleet-event/nvidia.com/", "fleet-event/node."))]
        assert node_level, sorted(events)
        for event_id in node_level:
            quiet = await finish(temporal_client.get_workflow_handle(event_id), 30)
            assert quiet.figures["common_cause"] is False, decisions(quiet)
            assert f"every loss is in {RACK_LABEL}={rack}" in decisions(quiet), decisions(quiet)
        assert not [m for m in await rig.notifications() if "suspected node-level cause" in m["text"]]

        report = await reconcile_with_world(rig, ledger_url)
        # The fast path's leader election renews its Lease: coordination, not an effect on the fleet.
        orphans = [a for a in report.orphans if "/leases" not in a.path]
        assert report.duplicates == [] and orphans == [] and report.divergent == [], report
        assert report.missing == [] and report.unresolved == [], report
