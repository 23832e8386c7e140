"""Recovery work out-ranks scale-down and readiness work on the shared task queue: every fleetmend
client (``worker.temporal_client.connect``: webhook, CLI, worker) sets the priority by workflow type."""

from __future__ import annotations

import uuid

from temporalio.client import Client
from temporalio.common import Priority

from worker.config import load_settings
from worker.priorities import BACKGROUND, FENCE, PLANNED, RECOVERY, fairness_key_for, priority_for
from worker.temporal_client import connect


async def test_starts_through_fleetmend_clients_carry_the_priority_of_their_workflow_type(
    temporal_client: Client,
) -> None:
    client = await connect(
        load_settings(
            temporal_address=temporal_client.service_client.config.target_host,
            temporal_namespace=temporal_client.namespace,
        )
    )
    task_queue = f"prio-{uuid.uuid4().hex[:8]}"  # no worker: the starts only queue up
    keys = {}
    for workflow in ("NodeFence", "FleetIncident", "PlannedScaleDown", "ReadinessKeeper", "SomethingElse"):
        handle = await client.start_workflow(
            workflow, id=f"prio-{uuid.uuid4().hex[:8]}", task_queue=task_queue
        )
        described = await handle.describe()
        keys[workflow] = described.raw_description.workflow_execution_info.priority.priority_key
        await handle.terminate("priority checked")
    assert keys == {
        "NodeFence": FENCE,
        "FleetIncident": RECOVERY,
        "PlannedScaleDown": PLANNED,
        "ReadinessKeeper": BACKGROUND,
        "SomethingElse": 0,
    }
    assert FENCE < RECOVERY < PLANNED < BACKGROUND  # lower keys are dispatched first


def test_a_start_that_names_its_own_priority_keeps_it() -> None:
    assert priority_for("PlannedScaleDown", Priority(priority_key=1)).priority_key == 1
    assert priority_for("PlannedScaleDown", Priority.default).priority_key == PLANNED


def test_each_pools_work_carries_its_pool_as_the_fairness_key() -> None:
    assert fairness_key_for("incident/inference/llama") == "inference/llama"
    assert (
        fairness_key_for("incident/inference/llama/3f2a9c1b/recovery-1/node/gpu-node-0") == "inference/llama"
    )
    assert fairness_key_for("scale-down/batch/mistral") == "batch/mistral"
    assert fairness_key_for("readiness/batch/mistral") == "batch/mistral"
    assert fairness_key_for("fleetmend-smoke-1") is None and fairness_key_for(None) is None
    given = priority_for(
        "ReplicaLossRecovery", Priority.default, "incident/inference/llama/3f2a9c1b/recovery-1"
    )
    assert (given.priority_key, given.fairness_key) == (RECOVERY, "inference/llama")
    named = priority_for("FleetIncident", Priority(fairness_key="mine"), "incident/inference/llama")
    assert named.fairness_key == "mine"  # a start that names its own keeps it


async def test_a_pools_incident_is_started_with_its_fairness_key(temporal_client: Client) -> None:
    client = await connect(
        load_settings(
            temporal_address=temporal_client.service_client.config.target_host,
            temporal_namespace=temporal_client.namespace,
        )
    )
    service = f"llama-{uuid.uuid4().hex[:6]}"
    handle = await client.start_workflow(
        "FleetIncident", id=f"incident/inference/{service}", task_queue=f"prio-{uuid.uuid4().hex[:8]}"
    )
    described = await handle.describe()
    await handle.terminate("fairness key checked")
    priority = described.raw_description.workflow_execution_info.priority
    assert (priority.priority_key, priority.fairness_key) == (RECOVERY, f"inference/{service}")
