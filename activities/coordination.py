"""Procedures must not fight: is a replica-loss incident open on a pool? May this node's serving
capacity be removed (the fleet's removal breaker)?

A planned scale-down yields while the pool's ``FleetIncident`` runs: the
incident may be promoting spares, scaling up or cordoning nodes, and taking
replicas away underneath it would turn a recovery into an outage. The answer
comes from Temporal itself (describe the incident's well-known workflow id),
never from a copy of that state.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel
from temporalio import activity
from temporalio.client import WithStartWorkflowOperation, WorkflowExecutionStatus
from temporalio.common import SearchAttributeKey, WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from fleet.breaker import BreakerDecision, BreakerInput, RemovalRequest, breaker_workflow_id
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


# Temporal admits at most 10 Updates in flight per workflow (the server's history.maxInFlightUpdates);
# beyond that it answers ResourceExhausted. A storm sends hundreds of asks at once, so each worker
# process keeps at most this many in flight and queues the rest (two workers: 8 < 10).
BREAKER_ASKS_IN_FLIGHT = 4
_asks: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}


@activity.defn(name="ask_breaker")
async def ask_breaker(req: RemovalRequest) -> BreakerDecision:
    """Ask the fleet's removal breaker (``fleet.breaker``) before removing capacity that still serves.

    The breaker is one long-lived workflow per deployment (``breaker/removals/<task queue>``); this is
    an Update-With-Start, so the first ask in a fleet starts it and every later one joins it. Its
    answer is decided inside the workflow, one Update at a time, so two procedures asking at once are
    counted one after the other.
    """
    start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
        "RemovalBreaker",
        BreakerInput(),
        id=breaker_workflow_id(activity.info().task_queue),
        task_queue=activity.info().task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )
    loop = asyncio.get_running_loop()
    asks = _asks.setdefault(loop, asyncio.Semaphore(BREAKER_ASKS_IN_FLIGHT))
    async with asks:
        return await activity.client().execute_update_with_start_workflow(
            "ask", req, start_workflow_operation=start, result_type=BreakerDecision
        )
