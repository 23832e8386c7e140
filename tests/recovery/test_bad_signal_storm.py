"""A bad health check on most of the fleet at once: the breaker lets through its cap and nothing more.

A node problem detector flags ``GpuXid`` on 3 of the 4 nodes of the gpu-node-loss world while every GPU,
DCGM series and engine is fine (``false-gpu-condition``: NVSentinel #1663, a check that marked every node of
a type unhealthy). The fast path starts a fence for each flagged node (no replacement belongs on a failing
GPU); each fence probes the node's engines, finds them answering, and asks the removal breaker. The cap at 4
nodes is max(1, 5 % of 4) = 1: one node is cordoned, the breaker trips on the next ask with "suspected bad
signal" and the counts (one post to the incident channel), the rest wait visibly on an operator and
post nothing of their own. The fast path checks each flagged node's engines itself, finds them
answering, and opens no incident: no replica is derouted, the users' goodput holds, and no topology
fleet event names a rack or zone as a common cause. While tripped, a node that really dies is still fenced and its replicas
derouted: dead capacity never waits. Real Temporal, real Postgres, Envoy, the fast path, the simulated
cluster under the worker's RBAC.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from temporalio.client import Client

from fleet.breaker import BreakerStatus, breaker_workflow_id
from fleet.detection import Verdict as DetectionVerdict
from fleet.fence import fence_workflow_id
from fleet.incident import incident_workflow_id
from fleet.recovery import Phase
from fleet.vocabulary import FaultKind
from tests.support import (
    FAST_PATH_SETTINGS,
    POOL,
    decisions,
    gpu_pool,
    load_reaches,
    node_cordoned,
    posted,
    routed,
    status_of,
    wait_for_phase,
    workflow_ids,
)
from worker.devstack.rig import FleetRig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FLAGGED = ("gpu-node-0", "gpu-node-1", "gpu-node-2")


async def test_a_false_gpu_condition_on_most_nodes_cordons_at_most_the_cap_and_derouts_nothing(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url, **FAST_PATH_SETTINGS) as rig:
        async with rig.fast_path() as fast:
            routed_before = sorted(await rig.routing_set(POOL))
            load_start = await rig.sim_now()
            load = await rig.start_load(rate=20, duration_s=120, seed=7)
            await load_reaches(rig)
            mark = await rig.sim_now() - load_start  # the load's own clock: sim seconds since it started
            for node in FLAGGED:
                await rig.inject(FaultKind.FALSE_GPU_CONDITION, node)

            # Every flagged node's fence ends: one cordoned within the cap, the others held.
            breaker = temporal_client.get_workflow_handle(breaker_workflow_id(task_queue))
            fences = {n: temporal_client.get_workflow_handle(fence_workflow_id(n)) for n in FLAGGED}
            deadline = time.monotonic() + 90
            while True:
                states: dict[str, Phase | None] = {}
                for node, handle in fences.items():
                    try:
                        states[node] = (await status_of(handle)).phase
                    except Exception:  # not started yet
                        states[node] = None
                settled = [p for p in states.values() if p in (Phase.DONE, Phase.AWAITING_OPERATOR)]
                if len(settled) == len(FLAGGED):
                    break
                assert time.monotonic() < deadline, f"fences not settled: {states}"
                await asyncio.sleep(0.25)
            cordoned = [n for n in FLAGGED if await node_cordoned(rig, n)]
            held = [n for n, p in states.items() if p == Phase.AWAITING_OPERATOR]
            assert len(cordoned) == 1 and sorted(held) == sorted(set(FLAGGED) - set(cordoned)), (
                states,
                cordoned,
            )
            status = await breaker.query("status", result_type=BreakerStatus)
            assert status.tripped and status.trip is not None, status
            assert "suspected bad signal" in status.trip.reason and "GpuXid" in status.trip.reason, (
                status.trip
            )
            assert "cap 1 of 4 GPU nodes" in status.trip.reason, status.trip
            one_held = await status_of(fences[held[0]])
            assert one_held.awaiting and "still answer" in one_held.awaiting, one_held.awaiting
            # One message for the storm: the breaker's trip post; the held fences post nothing of their own.
            posts = await posted(rig, "REMOVAL BREAKER TRIPPED")
            assert len([t for t in posts if "REMOVAL BREAKER TRIPPED" in t]) == 1, posts
            assert not [t for t in posts if ": held —" in t], posts
            # The granted one says why a serving node was cordoned anyway.
            granted = await status_of(fences[cordoned[0]])
            assert any("granted although" in d.summary for d in granted.decisions), decisions(granted)

            # Every flagged node's engines answered the fast path's own /health: no incident, nothing derouted.
            said = {d.entity: d for d in fast.detections if d.entity.startswith("node:")}
            for node in FLAGGED:
                verdict = said.get(f"node:{node}")
                assert verdict is not None and verdict.verdict is DetectionVerdict.NOT_A_LOSS, fast.detections
                assert "not a lost replica" in verdict.reason, verdict.reason
            assert (
                await workflow_ids(
                    temporal_client, f"WorkflowType = 'FleetIncident' AND TaskQueue = '{task_queue}'"
                )
                == []
            )
            await routed(rig, lambda pods: sorted(pods) == routed_before, f"every one of {routed_before}")
            # No topology fleet event: a signal on Ready nodes is not a rack's or a zone's loss.
            assert (
                await workflow_ids(
                    temporal_client, f"WorkflowType = 'FleetEvent' AND TaskQueue = '{task_queue}'"
                )
                == []
            )
            assert fast.counts["fences_started"] == len(FLAGGED)
            # The users' own record through the storm: every request served, none cut.
            deadline = time.monotonic() + 60
            while (storm := await rig.load_report(load, since_s=mark))["finished"] < 40:  # 2 s of load
                assert time.monotonic() < deadline, storm
                await asyncio.sleep(0.2)
            assert storm["finished"] > 0 and storm["goodput"] >= 0.99 * storm["finished"], storm
            assert storm["truncated_streams"] == 0, storm

            # While tripped, a node that really dies is fenced and its replicas derouted all the same.
            dead = "gpu-node-3"
            on_dead = set(routed_before) & await _pods_on(rig, dead)
            assert on_dead, f"no routed replica on {dead}: {routed_before}"
            lost_at = time.monotonic()
            await rig.inject(FaultKind.NODE_LOST, dead)
            deadline = lost_at + 60
            while still := on_dead & set(await rig.routing_set(POOL)):
                assert time.monotonic() < deadline, f"{still} still routed 60 s after the loss"
                await asyncio.sleep(0.2)
            derouted_s = time.monotonic() - lost_at
            while not await node_cordoned(rig, dead):
                assert time.monotonic() < deadline, (
                    "the dead node was not fenced while the breaker was tripped"
                )
                await asyncio.sleep(0.2)
            status = await breaker.query("status", result_type=BreakerStatus)
            assert status.tripped and dead not in {h.request.node for h in status.held}, status.held
            print(
                f"while tripped: {dead}'s replicas out of Envoy's rotation {derouted_s:.1f} s after the loss"
            )
            # The held fences still wait: nothing held replays on its own.
            assert (await wait_for_phase(fences[held[0]], Phase.AWAITING_OPERATOR, 5)).awaiting


async def _pods_on(rig: FleetRig, node: str) -> set[str]:
    pods = await asyncio.to_thread(
        rig.core.list_namespaced_pod, POOL.namespace, field_selector=f"spec.nodeName={node}"
    )
    return {str(p.metadata.name) for p in pods.items}


async def test_a_real_xid_that_kills_the_engine_is_still_a_node_loss_by_the_fast_path(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    """The counterpart: Xid 79 on a GPU that serves (the GPU fell off the bus, its engine dies). The same
    condition, but the engine there fails its /health twice: the node is lost at once and the pool's
    incident opens on the GPU fault's own words."""
    async with gpu_pool(temporal_client, task_queue, ledger_url, **FAST_PATH_SETTINGS) as rig:
        async with rig.fast_path() as fast:
            node = await _routed_node(rig)
            for gpu in range(8):  # every GPU of the node falls off the bus: its routed replica dies too
                await rig.inject(FaultKind.GPU_XID, node, code=79, gpu=gpu)
            deadline = time.monotonic() + 30
            while not (lost := [d for d in fast.detections if d.entity == f"node:{node}" and d.loss]):
                assert time.monotonic() < deadline, fast.detections
                await asyncio.sleep(0.1)
            assert "GpuXid=True" in lost[0].reason and "failing /health" in lost[0].reason, lost[0].reason
            assert await workflow_ids(
                temporal_client,
                f"WorkflowId = '{incident_workflow_id(POOL)}' AND TaskQueue = '{task_queue}'",
                at_least=1,
                timeout_s=30,
            ), "no incident"


async def _routed_node(rig: FleetRig) -> str:
    """A node a routed replica runs on."""
    routed = set(await rig.routing_set(POOL))
    for node in ("gpu-node-0", "gpu-node-1", "gpu-node-2", "gpu-node-3"):
        if routed & await _pods_on(rig, node):
            return node
    raise AssertionError(f"no routed replica on any node: {routed}")
