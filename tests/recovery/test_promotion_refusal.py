"""Step 5 refused: the API server refuses (422 from admission, 403 from RBAC) the patch that routes to the warm spare.

Every other refused-patch test is hit at the deroute; here the deroute goes through and only the
promotion's call is refused (the rule matches the spare's pods *and* a body carrying the router
label). What an SRE sees: the recovery stops in ``awaiting-operator`` with the promotion and the
API server's own words in ``fleetmend status``, the status query and the incident channel; nothing
of step 6 on happened; after the fix, ``fleetmend retry`` completes the recovery.
Real Temporal, real Postgres, real Envoy, the simulated fleet.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from temporalio.client import Client

from fleet.recovery import Phase
from fleet.vocabulary import PROCEDURE_OPERATION_PREFIX, FaultKind
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
    refused_promotion,
    run_cli,
    ui_details,
    wait_for_child,
    wait_for_phase,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("422", ("is invalid", "admission policy")),  # a validating admission policy
        ("403", ("forbidden", "cannot patch")),  # RBAC, or a webhook that denies
    ],
)
async def test_a_refused_promotion_stops_and_asks_and_retry_after_the_fix_completes(
    temporal_client: Client, task_queue: str, ledger_url: str, code: str, said: tuple[str, str]
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url) as rig:
        # An admission policy refuses adding the router label to the spare: the promotion, nothing else.
        await rig.refuse(refused_promotion(code))
        await rig.inject(FaultKind.NODE_LOST, "gpu-node-0")
        incident = await rig.report_loss(
            node_report("gpu-node-0", fingerprint="fp-promote"), incident_config()
        )
        child = await wait_for_child(temporal_client, incident)
        waiting = await wait_for_phase(child, Phase.AWAITING_OPERATOR, timeout_s=120)

        # The status query: the promotion, the API server's words, the answers expected.
        refusal = waiting.refusal
        assert refusal is not None, decisions(waiting)
        assert refusal.what.startswith("promote spare") and "llama-spare-" in refusal.what, refusal
        assert said[0] in refusal.error.lower() and said[1] in refusal.error, refusal
        assert waiting.awaiting and "promote spare" in waiting.awaiting and "retry" in waiting.awaiting
        # The Temporal UI's current details say the same (what the UI's own query reads).
        shown = await ui_details(child)
        assert "**Refused:** promote spare" in shown and said[1] in shown and "`retry`" in shown, shown
        # The steps before it ran (the lost replicas are out of routing); nothing after it did.
        assert [p.name for p in waiting.phases][-2:] == [Phase.PROMOTING, Phase.AWAITING_OPERATOR], (
            waiting.phases
        )
        assert not any(pod.startswith("llama-spare-") for pod in await rig.routing_set(POOL))
        acted = await fleetmend_actions(rig)
        assert any(a["verb"] == "PATCH" and "/pods/" in a["path"] and a["status"] < 300 for a in acted), acted
        assert not any("llama-spare" in a["path"] and a["path"].endswith("/scale") for a in acted), acted
        # The incident channel and `fleetmend status` say the same.
        await posted(rig, "promote spare", "waits for an operator")
        env = cli_env(temporal_client, task_queue)
        listed = await run_cli(env, "status", "--json")
        assert listed.exit_code == 0, listed.output
        [row] = [r for r in json.loads(listed.output) if r["workflow_id"] == child.id]
        assert row["phase"] == Phase.AWAITING_OPERATOR.value, row
        assert "promote spare" in row["awaiting"] and said[1] in row["awaiting"], row

        await rig.refuse()  # the admission policy fixed
        retried = await run_cli(env, "retry", child.id, "--operator", "alice", "--reason", "policy fixed")
        assert retried.exit_code == 0 and "retry accepted" in retried.output, retried.output
        status = await finish(child, timeout_s=200)
        assert status.phase == Phase.DONE, decisions(status)
        assert status.verification is not None and status.verification.passed, decisions(status)
        assert status.figures.get("promoted"), status.figures
        # The refused promotion stays recorded; the retry was a new operation that applied.
        states = effect_states(ledger_url, f"{PROCEDURE_OPERATION_PREFIX}{child.id}@%/promote%")
        assert sorted(set(states)) == ["applied", "failed"], states
        for _ in range(50):  # Envoy routes to the promoted spare (the EndpointSlice follows the label)
            if any(pod.startswith("llama-spare-") for pod in await rig.routing_set(POOL)):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"the promoted spare is not routed: {await rig.routing_set(POOL)}")
        report = await reconcile_with_world(rig, ledger_url)
        assert report.duplicates == [] and report.orphans == [], report
