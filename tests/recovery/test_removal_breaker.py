"""The removal breaker on the fence at detection: serving capacity is capped, dead capacity never waits,
and a reset re-evaluates what was held instead of replaying it.

A 4-node world (the cap is max(1 node, 5 % of 4) = 1 serving node per 10 minutes). Two nodes are cut
off from the API server by a partition (their kubelets fall silent, their engines keep serving): the
first fence cordons its node (within the cap), the second is held in ``awaiting-operator`` with "suspected
bad signal" and the counts. A third node then really dies: its fence cordons it at once, breaker
tripped or not. The held node's partition heals; an operator's reset without a reason is refused;
the reset with one releases the held fence, which reads the node again, finds it Ready and leaves it
alone. The trip and the reset are each posted once to the incident channel through the ledger. Real
Temporal, real Postgres, the simulated cluster under the worker's RBAC.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from temporalio.client import Client

from fleet.breaker import BreakerStatus, breaker_workflow_id
from fleet.fence import fence_workflow_id
from fleet.recovery import Phase
from fleet.vocabulary import PROCEDURE_OPERATION_PREFIX
from tests.support import (
    POOL,
    SHORT_NODE_GRACE_S,
    cli_env,
    decisions,
    effect_states,
    finish,
    gpu_pool,
    node_cordoned,
    run_cli,
    until_node_ready,
    wait_for_phase,
)
from worker.devstack.rig import FleetRig
from worker.fastpath.service import fence_starter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def test_serving_capacity_is_capped_dead_capacity_is_not_and_a_reset_re_evaluates(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url, node_grace_s=SHORT_NODE_GRACE_S) as rig:

        async def same_client() -> Client:
            return temporal_client

        fence = fence_starter(rig.settings, same_client)
        http = httpx.AsyncClient(base_url=rig.base_url, timeout=10.0)

        async def lose(node: str, **params: Any) -> None:
            (await http.post(f"/sim/v1/nodes/{node}/lose", params=params)).raise_for_status()

        try:
            # A partition: two kubelets fall silent, their engines keep serving.
            for node in ("gpu-node-1", "gpu-node-2"):
                await lose(node, partition="true")
            for node in ("gpu-node-1", "gpu-node-2"):
                await until_node_ready(rig, node, ready=False)
                assert (
                    await rig.engine_get(POOL.namespace, await _pod_on(rig, node), "/health")
                ).status_code == 200

            await fence("gpu-node-1", [POOL], "Ready=Unknown: NodeStatusUnknown", time.time(), {}, {})
            first = await finish(temporal_client.get_workflow_handle(fence_workflow_id("gpu-node-1")), 60)
            assert first.phase == Phase.DONE and await node_cordoned(rig, "gpu-node-1"), decisions(first)
            assert any("granted although" in d.summary for d in first.decisions), decisions(first)

            await fence("gpu-node-2", [POOL], "Ready=Unknown: NodeStatusUnknown", time.time(), {}, {})
            held_handle = temporal_client.get_workflow_handle(fence_workflow_id("gpu-node-2"))
            held = await wait_for_phase(held_handle, Phase.AWAITING_OPERATOR, 60)
            assert held.awaiting and "suspected bad signal" in held.awaiting, held.awaiting
            assert "cap 1 of 4 GPU nodes" in held.awaiting and "still answer" in held.awaiting, held.awaiting
            assert not await node_cordoned(rig, "gpu-node-2")
            breaker = temporal_client.get_workflow_handle(breaker_workflow_id(task_queue))
            status = await breaker.query("status", result_type=BreakerStatus)
            assert status.tripped and [h.request.node for h in status.held] == ["gpu-node-2"]

            # While tripped, a node that really dies is fenced at once: dead capacity never waits.
            await lose("gpu-node-3")
            await until_node_ready(rig, "gpu-node-3", ready=False)
            await fence("gpu-node-3", [POOL], "Ready=Unknown: NodeStatusUnknown", time.time(), {}, {})
            dead = await finish(temporal_client.get_workflow_handle(fence_workflow_id("gpu-node-3")), 60)
            assert dead.phase == Phase.DONE and await node_cordoned(rig, "gpu-node-3"), decisions(dead)
            assert dead.figures["engines"]["answering"] == 0, dead.figures

            # The partition heals before anyone resets the breaker.
            (await http.post("/sim/v1/nodes/gpu-node-2/restore")).raise_for_status()
            await until_node_ready(rig, "gpu-node-2", ready=True)

            env = cli_env(temporal_client, task_queue)
            shown = await run_cli(env, "breaker", "status")
            assert shown.exit_code == 0 and "TRIPPED" in shown.output and "gpu-node-2" in shown.output, (
                shown.output
            )
            refused = await run_cli(env, "breaker", "reset", "--operator", "sre", "--reason", " ")
            assert refused.exit_code == 2 and "needs a reason" in refused.output, refused.output
            assert (await breaker.query("status", result_type=BreakerStatus)).tripped  # nothing changed

            done = await run_cli(
                env, "breaker", "reset", "--operator", "sre", "--reason", "the top-of-rack switch, repaired"
            )
            assert done.exit_code == 0 and "fence/gpu-node-2" in done.output, done.output
            after = await breaker.query("status", result_type=BreakerStatus)
            assert not after.tripped and after.held == [] and after.resets[-1].operator == "sre"
            released = await finish(held_handle, 60)
            assert released.phase == Phase.DONE, decisions(released)
            assert any("Ready again: not cordoned" in d.summary for d in released.decisions), decisions(
                released
            )
            assert not await node_cordoned(rig, "gpu-node-2")  # re-evaluated against the world, not replayed

            # The trip and the reset were each said once in the incident channel, through the ledger.
            posts = [m["text"] for m in await rig.notifications() if "removal breaker" in m["text"].lower()]
            assert len([t for t in posts if "REMOVAL BREAKER TRIPPED" in t]) == 1, posts
            assert any("cordon gpu-node-2" in t and "suspected bad signal" in t for t in posts), posts
            assert len([t for t in posts if "removal breaker reset by sre" in t]) == 1, posts
            ops = f"{PROCEDURE_OPERATION_PREFIX}{breaker_workflow_id(task_queue)}@%/breaker/%"
            assert effect_states(ledger_url, ops) == ["applied", "applied"]
        finally:
            await http.aclose()


async def _pod_on(rig: FleetRig, node: str) -> str:
    pods = await asyncio.to_thread(
        rig.core.list_namespaced_pod, POOL.namespace, field_selector=f"spec.nodeName={node}"
    )
    return str(pods.items[0].metadata.name)
