"""The scale-down pool and its load, for this package's tests (package-local support: see tests/support.py)."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client, WorkflowHandle

from fleet.scale_down import ScaleDownInput
from sim.scenario import SCENARIO_DIR, Scenario, load_scenario
from tests.support import POOL
from worker.devstack.rig import FleetRig

# The scale-down scenario's replicas decode 2400 tokens/s each (its warm rate); the sim runs at speed 1.
GROUP_CAPACITY_TOKENS = 2400.0
# Streaming load: requests of 100-300 tokens at 40 tokens/s per sequence stream for 2.5-7.5 s.
STREAMING = {"tiers": {"standard": 1.0}, "output_tokens": [100, 300]}


def vllm_default_scenario(**model: Any) -> Scenario:
    """The 8-replica scale-down pool with vLLM's default ``--shutdown-timeout=0`` (deleting a pod cuts)."""
    scenario = load_scenario(SCENARIO_DIR / "scale-down.yaml")
    m = scenario.models[0].model_copy(update={"shutdown_timeout_s": 0.0, **model})
    return scenario.model_copy(update={"models": [m]})


def scale_down_input(**overrides: Any) -> ScaleDownInput:
    values: dict[str, Any] = {
        "pool": POOL,
        "target_groups": 6,
        "drain_deadline_s": 60.0,
        "poll_interval_s": 0.3,
        "incident_poll_s": 1.0,
        "group_capacity_tokens_per_s": GROUP_CAPACITY_TOKENS,
    }
    values.update(overrides)
    return ScaleDownInput(**values)


async def start_scale_down(
    client: Client, rig: FleetRig, inp: ScaleDownInput, workflow_id: str
) -> WorkflowHandle[Any, Any]:
    return await client.start_workflow(
        "PlannedScaleDown", inp, id=workflow_id, task_queue=rig.settings.task_queue
    )
