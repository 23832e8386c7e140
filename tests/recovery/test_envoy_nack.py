"""Envoy NACKs a recovery step's gateway change: the step stops and asks an operator.

fleetmend's control plane is restarted with data-plane settings Envoy's own validation refuses (a
0 s health-check interval, forced past fleetmend's checks): from then on Envoy NACKs every cluster
it is sent and keeps running its last good config. A node is lost; the recovery deroutes, then its
first gateway change (the survivors' admission or the in-flight retry policy) is NACKed. What an
SRE sees: ``awaiting-operator`` with Envoy's own words in the status query, ``fleetmend status``
and the incident channel; the policy put back to what Envoy runs; nothing of the later steps done.
After the control plane is fixed, ``fleetmend retry`` completes the recovery.
Real Temporal, Postgres and Envoy, the simulated fleet.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import pytest
from temporalio.client import Client

from fleet.recovery import Phase
from fleet.vocabulary import PROCEDURE_OPERATION_PREFIX, FaultKind
from gateway.resources import DataPlaneSettings
from gateway.store import revision_of
from tests.support import (
    POOL,
    cli_env,
    decisions,
    effect_states,
    finish,
    fleetmend_actions,
    gpu_pool,
    incident_config,
    node_report,
    posted,
    reconcile_with_world,
    restart_control_plane,
    run_cli,
    ui_details,
    wait_for_child,
    wait_for_phase,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GATEWAY_STEPS = (Phase.PROTECTING, Phase.IN_FLIGHT)


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.1)


async def test_an_envoy_nack_of_a_steps_change_stops_and_asks_and_retry_after_the_fix_completes(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url) as rig:
        store = rig.gateway_adapter.store
        broken = DataPlaneSettings.model_construct(
            **{**DataPlaneSettings().model_dump(), "health_check_interval_s": 0.0}
        )
        await restart_control_plane(rig, broken)
        await _until(
            lambda: any(a.nacked_version and a.connected for a in store.answers()),
            "Envoy NACKs the broken control plane's clusters",
        )
        before = await rig.gateway_policy(POOL)

        await rig.inject(FaultKind.NODE_LOST, "gpu-node-0")
        incident = await rig.report_loss(node_report("gpu-node-0", fingerprint="fp-nack"), incident_config())
        child = await wait_for_child(temporal_client, incident)
        waiting = await wait_for_phase(child, Phase.AWAITING_OPERATOR, timeout_s=120)

        refusal = waiting.refusal
        assert refusal is not None, decisions(waiting)
        # Envoy's own words, and that fleetmend put the previous policy back.
        assert "Envoy refused the config" in refusal.error and "Cluster" in refusal.error, refusal
        assert "put the previous policy back" in refusal.error, refusal
        assert waiting.awaiting and "Envoy refused" in waiting.awaiting and "retry" in waiting.awaiting
        # The Temporal UI's current details say the same (what the UI's own query reads).
        shown = await ui_details(child)
        assert "**Refused:**" in shown and "Envoy refused the config" in shown and "`retry`" in shown, shown
        phases = [p.name for p in waiting.phases]
        assert phases[-1] == Phase.AWAITING_OPERATOR and phases[-2] in GATEWAY_STEPS, phases
        # The deroute before it went through; the refused change is not left stored; nothing after it ran.
        assert Phase.DEROUTING in phases
        assert any(a["verb"] == "PATCH" and "/pods/" in a["path"] for a in await fleetmend_actions(rig))
        assert await rig.gateway_policy(POOL) == before
        assert Phase.PROMOTING not in phases
        assert not any(a["path"].endswith("/scale") for a in await fleetmend_actions(rig))
        await posted(rig, "Envoy refused", "waits for an operator")
        env = cli_env(temporal_client, task_queue)
        listed = await run_cli(env, "status", "--json")
        assert listed.exit_code == 0, listed.output
        [row] = [r for r in json.loads(listed.output) if r["workflow_id"] == child.id]
        assert row["phase"] == Phase.AWAITING_OPERATOR.value and "Envoy refused" in row["awaiting"], row

        # The control plane fixed: Envoy ACKs the current policy again, then the operator retries.
        await restart_control_plane(rig, DataPlaneSettings())
        current = store.get(POOL.key)
        revision = current.revision if current is not None else 0
        await _until(
            lambda: (
                any(a.connected and revision_of(a.acked_version) >= revision for a in store.answers())
                and not any(a.connected and a.nacked_version for a in store.answers())
            ),
            "Envoy ACKs the fixed control plane",
        )
        retried = await run_cli(env, "retry", child.id, "--operator", "alice", "--reason", "plane fixed")
        assert retried.exit_code == 0 and "retry accepted" in retried.output, retried.output
        status = await finish(child, timeout_s=200)
        assert status.phase == Phase.DONE, decisions(status)
        assert status.verification is not None and status.verification.passed, decisions(status)
        # The NACKed change stays recorded as refused; the retry was a new operation Envoy ACKed.
        states = effect_states(ledger_url, f"{PROCEDURE_OPERATION_PREFIX}{child.id}@%/{refusal.step}%")
        assert "applied" in states and set(states) - {"applied"} <= {"failed", "needs_operator"}, states
        assert len(set(states)) == 2, states
        report = await reconcile_with_world(rig, ledger_url)
        assert report.duplicates == [] and report.orphans == [], report
