"""PlannedScaleDown's deroute refused (403: RBAC lost pods/patch for the router label's removal).

The victim is claimed and its readiness gate is set; then removing its router-only label is
Forbidden (the rule matches that patch's body only - the label key, quoted, not the readiness gate's
``fleetmend.io/serving-ready`` - so the claim and the gate before it go through). What an
SRE sees: the scale-down stops in ``awaiting-operator`` (status query, ``fleetmend status``, the
incident channel) with the API server's words; nothing is drained or removed; after the fix,
``fleetmend retry`` completes the scale-down. Real Temporal, Postgres and Envoy, the simulated fleet.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from temporalio.client import Client

from fleet.recovery import Phase
from fleet.vocabulary import PROCEDURE_OPERATION_PREFIX, ROUTER_LABEL
from tests.scale_down.support import scale_down_input, start_scale_down, vllm_default_scenario
from tests.support import (
    POOL,
    cli_env,
    decisions,
    effect_states,
    finish,
    posted,
    reconcile_with_world,
    routed,
    run_cli,
    ui_details,
    wait_for_phase,
)
from worker.devstack.rig import fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def test_a_refused_deroute_stops_the_scale_down_and_retry_after_the_fix_completes(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with fleet_rig(
        temporal_client, scenario=vllm_default_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        await rig.refuse(
            {
                "verbs": ["PATCH"],
                "path_contains": "/pods/",
                "body_contains": f'"{ROUTER_LABEL}"',
                "error": "403",
            }
        )
        handle = await start_scale_down(
            temporal_client, rig, scale_down_input(target_groups=7), f"sd-{uuid.uuid4().hex[:8]}"
        )
        waiting = await wait_for_phase(handle, Phase.AWAITING_OPERATOR, 60)

        [victim] = waiting.figures["victims"]
        refusal = waiting.refusal
        assert refusal is not None, decisions(waiting)
        assert (
            "stop new requests" in refusal.what and f"remove router-only label {ROUTER_LABEL}" in refusal.what
        )
        assert victim in refusal.what, refusal
        assert "forbidden" in refusal.error.lower() and "cannot patch" in refusal.error, refusal
        assert waiting.awaiting and "retry" in waiting.awaiting and "cannot patch" in waiting.awaiting
        # The Temporal UI's current details say the same (what the UI's own query reads).
        shown = await ui_details(handle)
        assert "**Refused:** stop new requests" in shown and "cannot patch" in shown and "`retry`" in shown, (
            shown
        )
        assert [p.name for p in waiting.phases][-2:] == [Phase.MARKING_NOT_READY, Phase.AWAITING_OPERATOR]
        # The steps before it ran (the claim), none after it did: the victim still has its label, no drain
        # began, nothing was scaled or deleted.
        pod = await asyncio.to_thread(rig.core.read_namespaced_pod, victim, POOL.namespace)
        assert (pod.metadata.labels or {}).get(ROUTER_LABEL), pod.metadata.labels
        assert Phase.DRAINING not in [p.name for p in waiting.phases]
        removed = [
            a
            for a in await rig.actions()
            if "fleetmend-worker" in a["client"] and (a["path"].endswith("/scale") or a["verb"] == "DELETE")
        ]
        assert removed == [], removed
        await posted(rig, "cannot patch", "waits for an operator")
        env = cli_env(temporal_client, task_queue)
        listed = await run_cli(env, "status", "--json")
        assert listed.exit_code == 0, listed.output
        [row] = [r for r in json.loads(listed.output) if r["workflow_id"] == handle.id]
        assert row["phase"] == Phase.AWAITING_OPERATOR.value and "cannot patch" in row["awaiting"], row

        await rig.refuse()  # RBAC restored
        retried = await run_cli(env, "retry", handle.id, "--operator", "sre", "--reason", "RBAC restored")
        assert retried.exit_code == 0 and "retry accepted" in retried.output, retried.output
        status = await finish(handle)
        assert status.phase == Phase.DONE, decisions(status)
        assert status.verification is not None and status.verification.passed, decisions(status)
        await routed(rig, lambda pods: len(pods) == 7 and victim not in pods, f"7 replicas, not {victim}")
        states = effect_states(ledger_url, f"{PROCEDURE_OPERATION_PREFIX}{handle.id}@%/stop-routing%")
        assert sorted(set(states)) == ["applied", "failed"], states  # the refusal, then the retry
        report = await reconcile_with_world(rig, ledger_url)
        assert report.duplicates == [] and report.orphans == [], report
