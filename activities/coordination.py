"""Procedures on the same pool must not fight: is a replica-loss incident open on it?

A planned scale-down yields while the pool's ``FleetIncident`` runs: the
incident may be promoting spares, scaling up or cordoning nodes, and taking
replicas away underneath it would turn a recovery into an outage. The answer
comes from Temporal itself (describe the incident's well-known workflow id),
never from a copy of that state.
"""

from __future__ import annotations

from pydantic import BaseModel
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.common import SearchAttributeKey
from temporalio.service import RPCError, RPCStatusCode

from fleet.incident import PoolRef, incident_workflow_id

# The incident's phase as it upserts it (fleet.search_attributes; activities do not import workflows).
_PHASE = SearchAttributeKey.for_keyword("FleetmendPhase")


class IncidentState(BaseModel):
    open: bool
    workflow_id: str
    phase: str | None = None
    reason: str


@activity.defn(name="incident_on_pool")
async def incident_on_pool(pool: PoolRef) -> IncidentState:
    """Whether the pool's FleetIncident workflow is running now, and in which phase."""
    wid = incident_workflow_id(pool)
    try:
        desc = await activity.client().get_workflow_handle(wid).describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return IncidentState(open=False, workflow_id=wid, reason=f"no incident on {pool.key}")
        raise
    if desc.status != WorkflowExecutionStatus.RUNNING:
        state = desc.status.name.lower() if desc.status else "unknown"
        return IncidentState(open=False, workflow_id=wid, reason=f"incident {wid} is {state}")
    phase_text = desc.typed_search_attributes.get(_PHASE)
    return IncidentState(
        open=True,
        workflow_id=wid,
        phase=phase_text,
        reason=f"replica-loss incident {wid} is open on {pool.key}"
        + (f" (phase {phase_text})" if phase_text else ""),
    )
