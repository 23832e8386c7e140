"""``FleetmendSmoke``: the smallest real workflow, used to prove a deployment works.

It upserts a fleetmend search attribute (so an unregistered attribute shows up
as a stuck run right here, not in the middle of an incident) and calls one
activity through the worker's thread pool.
"""

from __future__ import annotations

from pydantic import BaseModel
from temporalio import workflow

from fleet.search_attributes import FLEETMEND_KIND, FLEETMEND_PHASE

with workflow.unsafe.imports_passed_through():
    from activities.smoke import SmokeReply, SmokeRequest, smoke_probe
    from fleet.recovery import RetryBudget
    from workflows.procedure import run_bounded


class SmokeResult(BaseModel):
    workflow_id: str
    reply: SmokeReply


@workflow.defn(name="FleetmendSmoke")
class FleetmendSmoke:
    @workflow.run
    async def run(self, message: str) -> SmokeResult:
        workflow.upsert_search_attributes(
            [FLEETMEND_KIND.value_set("smoke"), FLEETMEND_PHASE.value_set("probing")]
        )
        # Bounded like every activity: a worker that cannot answer fails the smoke run, visibly.
        reply: SmokeReply = await run_bounded(
            smoke_probe,
            SmokeRequest(message=message),
            budget=RetryBudget(attempts=3, budget_s=60.0, call_timeout_s=30.0),
            summary=f"probe the worker with {message!r}",
        )
        workflow.upsert_search_attributes([FLEETMEND_PHASE.value_set("done")])
        return SmokeResult(workflow_id=workflow.info().workflow_id, reply=reply)
