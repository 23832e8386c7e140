"""The second day: a second incident on the same pool, the world refusing an action, a retry budget
spent, an Update in the recovery's first task. Real Temporal, real Postgres, the simulated fleet."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client as kc
from kubernetes import config as kconfig
from sqlalchemy import create_engine, text
from temporalio.client import Client, WorkflowExecutionStatus

from fleet.recovery import IncidentCause, OperatorAction, Phase, ProcedureStatus, RecoveryInput, RetryBudget
from fleet.vocabulary import PROCEDURE_OPERATION_PREFIX, QUARANTINE_LABEL, QUARANTINE_TAINT_KEY, FaultKind
from kube.client import USER_AGENT
from tests.support import (
    FAST,
    POOL,
    cli_env,
    decisions,
    execute_update,
    finish,
    fleetmend_actions,
    gpu_pool,
    incident_config,
    node_report,
    posted,
    reconcile_with_world,
    run_cli,
    wait_for_child,
    wait_for_phase,
)
from worker.devstack.rig import FleetRig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _ledger_rows(url: str, like: str) -> list[tuple[str, str]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT op_id, state FROM ledger_effects WHERE op_id LIKE :like ORDER BY op_id"),
                {"like": like},
            ).all()
        return [(r[0], r[1]) for r in rows]
    finally:
        engine.dispose()


async def _incident_closed(client: Client, workflow_id: str, timeout_s: float = 60) -> None:
    for _ in range(int(timeout_s / 0.3)):
        desc = await client.get_workflow_handle(workflow_id).describe()
        if desc.status != WorkflowExecutionStatus.RUNNING:
            return
        await asyncio.sleep(0.3)
    raise AssertionError(f"{workflow_id} still open after {timeout_s} s")


def _core(rig: FleetRig) -> kc.CoreV1Api:
    cfg = kc.Configuration()
    kconfig.load_kube_config(config_file=str(rig.sim.kubeconfig), client_configuration=cfg)
    return kc.CoreV1Api(kc.ApiClient(cfg))


async def _operator_returns_node(rig: FleetRig, node: str) -> None:
    """The machine was repaired: the node comes back and an operator lifts fleetmend's quarantine."""
    r = await rig.http.post(f"/sim/v1/nodes/{node}/restore")
    r.raise_for_status()
    core = _core(rig)
    obj = await asyncio.to_thread(core.read_node, node)
    taints = [t for t in ((obj.spec and obj.spec.taints) or []) if t.key != QUARANTINE_TAINT_KEY]
    body: dict[str, Any] = {
        "spec": {"unschedulable": False, "taints": [t.to_dict() for t in taints]},
        "metadata": {"labels": {QUARANTINE_LABEL: None}},
    }
    await asyncio.to_thread(core.patch_node, node, body)


async def test_a_second_loss_on_the_same_pool_recovers_with_its_own_operation_ids(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url, routed=0, in_process_sim=True) as rig:
        await rig.pool_ready(POOL)
        await rig.start_load(rate=40, duration_s=240, seed=21)
        outcomes = []
        for day, node in enumerate(("gpu-node-0", "gpu-node-1")):
            await rig.inject(FaultKind.NODE_LOST, node)
            incident = await rig.report_loss(
                node_report(node, fingerprint=f"fp-day-{day}"), incident_config()
            )
            child = await wait_for_child(temporal_client, incident)
            status = await finish(child)
            assert status.phase == Phase.DONE, decisions(status)
            assert status.verification is not None and status.verification.passed, decisions(status)
            assert status.figures.get("effects_deduplicated", 0) == 0, decisions(status)
            assert status.figures.get("effects_failed", 0) == 0, decisions(status)
            outcomes.append(child.id)
            await _incident_closed(temporal_client, incident.id)
            await _operator_returns_node(rig, node)
            await rig.pool_ready(POOL)
        first_id, second_id = outcomes
        assert first_id != second_id
        # Each incident's actions are under its own scope: none of the second's ids is one of the first's.
        ops_first = _ledger_rows(ledger_url, f"{PROCEDURE_OPERATION_PREFIX}{first_id}@%")
        ops_second = _ledger_rows(ledger_url, f"{PROCEDURE_OPERATION_PREFIX}{second_id}@%")
        assert ops_first and ops_second
        assert not {op for op, _ in ops_first} & {op for op, _ in ops_second}
        assert {state for _, state in ops_second} == {"applied"}, ops_second
        # Every action the second incident needed reached the world: the deroute, the retry policy, the scale.
        assert any("/retire-lost-" in op for op, _ in ops_second), ops_second
        assert any("/in-flight-retry-policy/" in op for op, _ in ops_second), ops_second
        scales = [a for a in await fleetmend_actions(rig) if a["path"].endswith("/scale")]
        assert len(scales) >= 4, scales  # two per incident at least: retire, then replace or rebuild
        report = await reconcile_with_world(rig, ledger_url)
        assert report.duplicates == [] and report.orphans == [], report
        # fleetmend read the engines where a cluster has them: at their pod IPs (the load is in-process,
        # so every engine /health and /metrics request came from the worker).
        served = rig.sim.world.serving.engine_servers.served_to
        for path in ("/health", "/metrics"):
            assert sum(n for (p, agent), n in served.items() if p == path and agent.startswith(USER_AGENT)), (
                served
            )


async def test_a_refused_deroute_stops_and_asks_and_retry_after_the_fix_completes(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url, routed=0) as rig:
        await rig.pool_ready(POOL)
        # RBAC lost the pods/patch permission: every pod patch is Forbidden.
        await rig.refuse({"verbs": ["PATCH"], "path_contains": "/pods/", "error": "403"})
        await rig.inject(FaultKind.NODE_LOST, "gpu-node-0")
        incident = await rig.report_loss(node_report("gpu-node-0"), incident_config())
        child = await wait_for_child(temporal_client, incident)
        waiting = await wait_for_phase(child, Phase.AWAITING_OPERATOR)
        assert waiting.refusal is not None, decisions(waiting)
        assert "forbidden" in waiting.refusal.error.lower() and "cannot patch" in waiting.refusal.error
        assert "deroute" in waiting.refusal.what
        assert waiting.awaiting and "retry" in waiting.awaiting
        # Nothing after the refused step ran: no admission change, no scale, no promotion.
        acted = [
            a for a in await fleetmend_actions(rig) if a["verb"] != "PATCH" and "/notify" not in a["path"]
        ]
        assert acted == [], acted
        await posted(rig, "cannot patch", "waits for an operator")
        # approve is not the answer to a refusal: the validator says so and nothing changes.
        env = cli_env(temporal_client, task_queue)
        rejected = await run_cli(env, "approve", child.id, "--operator", "alice")
        assert rejected.exit_code == 2 and "retry, skip" in rejected.output, rejected.output
        listed = await run_cli(env, "status", "--json")
        assert "cannot patch" in listed.output, listed.output  # `fleetmend status` shows the refusal
        await rig.refuse()  # RBAC fixed
        retried = await run_cli(env, "retry", child.id, "--operator", "alice", "--reason", "RBAC restored")
        assert retried.exit_code == 0 and "retry accepted" in retried.output, retried.output
        status = await finish(child)
        assert status.phase == Phase.DONE, decisions(status)
        assert status.verification is not None and status.verification.passed, decisions(status)
        rows = _ledger_rows(ledger_url, f"{PROCEDURE_OPERATION_PREFIX}{child.id}@%/deroute%")
        assert {state for _, state in rows} == {"failed", "applied"}, rows  # the refusal, then the retry
        report = await reconcile_with_world(rig, ledger_url)
        assert report.duplicates == [] and report.orphans == [], report


async def test_a_persistent_429_ends_in_an_operator_escalation_within_the_budget(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    budget = RetryBudget(attempts=3, budget_s=10, initial_interval_s=0.2, max_interval_s=1)
    timings = FAST.model_copy(update={"retry": budget})
    async with gpu_pool(temporal_client, task_queue, ledger_url, routed=0) as rig:
        await rig.pool_ready(POOL)
        await rig.refuse({"verbs": ["PATCH"], "path_contains": "/scale", "error": "429"})
        await rig.inject(FaultKind.NODE_LOST, "gpu-node-0")
        incident = await rig.report_loss(node_report("gpu-node-0"), incident_config(timings=timings))
        child = await wait_for_child(temporal_client, incident)
        waiting = await wait_for_phase(child, Phase.AWAITING_OPERATOR, timeout_s=90)
        assert waiting.refusal is not None, decisions(waiting)
        assert "retry budget spent" in waiting.refusal.error, waiting.refusal
        assert "429" in waiting.refusal.error or "too many requests" in waiting.refusal.error.lower()
        scaled = [a for a in await rig.actions() if a["path"].endswith("/scale") and a["status"] < 300]
        assert scaled == []  # refused by the API: nothing was scaled
        await rig.refuse()
        await execute_update(child, "retry", OperatorAction(operator="bob", reason="API server recovered"))
        status = await finish(child)
        assert status.phase == Phase.DONE, decisions(status)
        report = await reconcile_with_world(rig, ledger_url)
        assert report.duplicates == [] and report.orphans == [], report


async def test_an_update_in_the_recoverys_first_task_is_accepted(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url, routed=0) as rig:
        inp = RecoveryInput(
            pool=POOL,
            incident_id="test",
            cause=IncidentCause.SINGLE_LOSS,
            reports=[node_report("gpu-node-0")],
            timings=FAST,
        )
        handle = await temporal_client.start_workflow(
            "ReplicaLossRecovery", inp, id=f"first-task-{task_queue}", task_queue=rig.settings.task_queue
        )
        paused = await execute_update(
            handle, "pause", OperatorAction(operator="carol", reason="hold on"), result_type=ProcedureStatus
        )
        assert paused.paused
        assert "paused by carol: hold on" in decisions(paused)
        resumed = await execute_update(
            handle, "resume", OperatorAction(operator="carol", reason="go on"), result_type=ProcedureStatus
        )
        assert not resumed.paused
        status = await finish(handle)
        # Nothing was lost (no fault injected): the recovery says so and touches nothing.
        assert status.phase == Phase.NOT_A_LOSS, decisions(status)
        assert await fleetmend_actions(rig) == []
