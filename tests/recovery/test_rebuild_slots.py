"""Bounded remediation for recoveries: beyond the fleet-wide cap a recovery rebuilds only when a slot frees.

The gpu-node-loss world with ``recovery_concurrency`` = 1 while another recovery of this deployment
is ramping (a ``ReplicaLossRecovery`` on the same task queue, in phase ``ramping``, started with a
delay so it never runs: it holds the one slot as far as Temporal's visibility shows). The node dies:
the recovery deroutes, sheds and promotes the warm spare at once (none of them wait for a slot),
then queues before step 6, visibly (phase ``queued-for-rebuild``, the record naming the recovery
that holds the slot, ``fleetmend status``). When that recovery ends, the queued one rebuilds and
completes. Real Temporal, real Postgres, real Envoy, the simulated fleet.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from fleet import search_attributes as sa
from fleet.recovery import IncidentCause, Phase, RecoveryInput
from fleet.vocabulary import FaultKind
from tests.support import (
    POOL,
    cli_env,
    decisions,
    finish,
    gpu_pool,
    incident_config,
    node_report,
    run_cli,
    wait_for_child,
    wait_for_phase,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_a_recovery_beyond_the_fleet_wide_cap_derouted_and_promoted_at_once_then_queues_to_rebuild(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url, recovery_concurrency=1) as rig:
        holder = await temporal_client.start_workflow(
            "ReplicaLossRecovery",
            RecoveryInput(
                pool=POOL.model_copy(update={"service": "other-model"}),
                incident_id="incident-holding-the-slot",
                cause=IncidentCause.SINGLE_LOSS,
                reports=[],
            ),
            id=f"recovery-holding-the-slot-{task_queue}",
            task_queue=task_queue,
            start_delay=timedelta(hours=1),
            # Only the phase: without a FleetmendKind `fleetmend status` does not list (and query) it.
            search_attributes=TypedSearchAttributes(
                [SearchAttributePair(sa.FLEETMEND_PHASE, Phase.RAMPING.value)]
            ),
        )
        await rig.inject(FaultKind.NODE_LOST, "gpu-node-0")
        incident = await rig.report_loss(node_report("gpu-node-0", fingerprint="fp-slots"), incident_config())
        recovery = await wait_for_child(temporal_client, incident)
        queued = await wait_for_phase(recovery, Phase.QUEUED_FOR_REBUILD, timeout_s=120)

        # Everything before step 6 ran: the lost replicas left routing, the spare serves.
        entered = [p.name for p in queued.phases]
        for step in (Phase.DEROUTING, Phase.PROTECTING, Phase.PROMOTING, Phase.REBUILDING):
            assert step in entered, entered
        routed = await rig.routing_set(POOL)
        assert any(pod.startswith("llama-spare-") for pod in routed), routed
        said = decisions(queued)
        assert (
            f"{POOL.key} queued for rebuilding: 1 of 1 recoveries already rebuild capacity fleet-wide ({holder.id})"
            in said
        ), said
        env = cli_env(temporal_client, task_queue)
        listed = await run_cli(env, "status", "--json")
        assert listed.exit_code == 0, listed.output
        [row] = [r for r in json.loads(listed.output) if r["workflow_id"] == recovery.id]
        assert row["phase"] == Phase.QUEUED_FOR_REBUILD.value, row

        await holder.terminate("the other recovery ended")
        done = await finish(recovery, timeout_s=200)
        assert done.phase == Phase.DONE, decisions(done)
        assert done.verification is not None and done.verification.passed, decisions(done)
        # It took the freed slot (not the give-up after its wait): the record says so, then it rebuilt.
        assert f"0 of 1 recoveries rebuilding capacity fleet-wide: {POOL.key} rebuilds now" in decisions(done)
        assert "rebuilds now anyway" not in decisions(done)
        assert done.figures.get("promoted"), done.figures
