"""``FleetmendSmoke``: the smallest real workflow, used to prove a deployment works.

It upserts a fleetmend search attribute (so an unregistered attribute shows up
as a stuck run right here, not in the middle of an incident) and calls one
activity through the worker's thread pool.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel
from temporalio import workflow

from fleet.search_attributes import FLEETMEND_KIND, FLEETMEND_PHASE

with workflow.unsafe.imports_passed_through():
    from activities.smoke import SmokeReply, SmokeRequest, smoke_probe


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
        reply = await workflow.execute_activity(
            smoke_probe,
            SmokeRequest(message=message),
            start_to_close_timeout=timedelta(seconds=30),
            summary=f"probe the worker with {message!r}"[:200],
        )
        workflow.upsert_search_attributes([FLEETMEND_PHASE.value_set("done")])
        return SmokeResult(workflow_id=workflow.info().workflow_id, reply=reply)
