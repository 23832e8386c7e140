"""Recovery work out-ranks scale-down and readiness work on the shared task queue: every fleetmend
client (``worker.temporal_client.connect``: webhook, CLI, worker) sets the priority by workflow type."""

from __future__ import annotations

import uuid

from temporalio.client import Client
from temporalio.common import Priority

from worker.config import load_settings
from worker.priorities import BACKGROUND, PLANNED, RECOVERY, priority_for
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
    for workflow in ("FleetIncident", "PlannedScaleDown", "ReadinessKeeper", "SomethingElse"):
        handle = await client.start_workflow(
            workflow, id=f"prio-{uuid.uuid4().hex[:8]}", task_queue=task_queue
        )
        described = await handle.describe()
        keys[workflow] = described.raw_description.workflow_execution_info.priority.priority_key
        await handle.terminate("priority checked")
    assert keys == {
        "FleetIncident": RECOVERY,
        "PlannedScaleDown": PLANNED,
        "ReadinessKeeper": BACKGROUND,
        "SomethingElse": 0,
    }
    assert RECOVERY < PLANNED < BACKGROUND  # lower keys are dispatched first


def test_a_start_that_names_its_own_priority_keeps_it() -> None:
    assert priority_for("PlannedScaleDown", Priority(priority_key=1)).priority_key == 1
    assert priority_for("PlannedScaleDown", Priority.default).priority_key == PLANNED
