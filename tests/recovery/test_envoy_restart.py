"""Envoy dies in the middle of a recovery (SIGKILL, as a crashed pod would) and comes back with
nothing but its bootstrap: the control plane gives it the current routing set, weights and
admission, the recovery completes, and the ledger reconciles with the world."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import Client

from fleet.recovery import Phase
from fleet.vocabulary import FaultKind
from tests.support import (
    POOL,
    decisions,
    finish,
    gpu_pool,
    incident_config,
    load_reaches,
    node_report,
    reconcile_with_world,
    routed,
    wait_for_child,
    wait_for_phase,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


async def test_envoy_killed_mid_recovery_comes_back_with_the_current_state_and_the_recovery_completes(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url) as rig:
        # Light load: what is under test is Envoy's state, not capacity (a loaded fleet whose every
        # request crosses Envoy starves a 2-core machine: README, "The gateway").
        load = await rig.start_load(rate=8, duration_s=120, seed=5)
        await load_reaches(rig)
        assert (await rig.inject(FaultKind.NODE_LOST, "gpu-node-0"))["accepted"]
        incident = await rig.report_loss(node_report("gpu-node-0"), incident_config())
        child = await wait_for_child(temporal_client, incident)
        # Derouted and rebuilding or ramping, the weights still to be set: the moment Envoy's state
        # matters (the rebuild can take under a second: the ramp's steps follow it).
        await wait_for_phase(
            child, (Phase.REBUILDING, Phase.PLACING, Phase.TRIAGING, Phase.RAMPING), timeout_s=120
        )
        routed_before = set(await rig.routing_set(POOL))
        await asyncio.to_thread(rig.gateway.restart_envoy, crash=True)
        # Back from its bootstrap alone: the routing set and the policy fleetmend had set.
        for _ in range(100):
            if set(await rig.routing_set(POOL)) >= routed_before:
                break
            await asyncio.sleep(0.1)
        await routed(rig, lambda pods: set(pods) >= routed_before, f"every one of {sorted(routed_before)}")
        stored = await asyncio.to_thread(rig.gateway_adapter.policy, POOL)
        assert (
            await asyncio.to_thread(rig.gateway_adapter.applied, POOL, stored) is not None
        )  # the new Envoy ACKed it

        status = await finish(child)
        text_ = decisions(status)
        assert status.phase == Phase.DONE, text_
        assert status.verification is not None and status.verification.passed, text_
        assert status.figures.get("ramp_weights"), text_  # weights were set after the restart
        final = await asyncio.to_thread(rig.gateway_adapter.policy, POOL)
        assert (
            await asyncio.to_thread(rig.gateway_adapter.applied, POOL, final) is not None
        )  # and Envoy runs them
        report = await reconcile_with_world(rig, ledger_url)
        assert report.duplicates == [] and report.orphans == [], report
        served = await rig.load_report(load)
        assert served["goodput"] > 0, served
