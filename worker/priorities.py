"""Task priorities: a lost node's fence, then recovery work, out-rank scale-down and readiness work.

All of fleetmend's workflows share one task queue (one worker fleet, one set of
slots). When the queue backs up — an alert storm, a worker roll, the fleet
catching up after an outage — Temporal dispatches lower priority keys first
(1 highest … 5 lowest, 3 when unset), so the replica-loss incident and its
recovery are never stuck behind a nightly scale-down or readiness sampling, and a lost node's
fence (two short activities) is never stuck behind a burst's hundred recoveries.

Priorities are set in one place, by workflow type, instead of at every call
site: a client interceptor for the starts (webhook, CLI, Schedules) and a
worker interceptor for child workflows. Activities inherit their workflow's
priority. A start that names a priority itself keeps it.

**Fairness between pools.** Within one priority, every pool's work carries its pool as
Temporal's fairness key (``<namespace>/<service>``, from the workflow id every fleetmend
workflow is named by): on a server with task-queue fairness, a burst of one pool's
recovery activities is dispatched in turn with another pool's, never all ahead of it.
A server without fairness ignores the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from temporalio import client as temporal_client
from temporalio import worker as temporal_worker
from temporalio.common import Priority

from fleet.incident import FLEET_INCIDENT_WORKFLOW

FENCE = 1  # a node is lost: one cordon keeps the scheduler off it, ahead of every recovery's looks
RECOVERY = 2  # a replica is lost: capacity and live streams are at stake now
PLANNED = 4  # a scale-down can wait a few seconds
BACKGROUND = 5  # readiness sampling runs continuously; a late sample is harmless

PRIORITY_BY_WORKFLOW: dict[str, int] = {
    "NodeFence": FENCE,
    "RemovalBreaker": FENCE,  # a fence waits on its answer
    FLEET_INCIDENT_WORKFLOW: RECOVERY,
    "FleetEvent": RECOVERY,
    "ReplicaLossRecovery": RECOVERY,
    "PlannedScaleDown": PLANNED,
    "ReadinessKeeper": BACKGROUND,
}


# Workflow ids that name a pool: ``<kind>/<namespace>/<service>[/...]`` (fleet.incident, the keeper).
POOL_WORKFLOW_KINDS = frozenset({"incident", "scale-down", "readiness"})


def fairness_key_for(workflow_id: str | None) -> str | None:
    """The pool a workflow works on, as a fairness key (``<namespace>/<service>``), or None."""
    parts = (workflow_id or "").split("/")
    if len(parts) >= 3 and parts[0] in POOL_WORKFLOW_KINDS and parts[1] and parts[2]:
        return f"{parts[1]}/{parts[2]}"
    return None


def priority_for(workflow_type: str, given: Priority, workflow_id: str | None = None) -> Priority:
    """``given`` with the type's priority key unless it names one (unknown types: none), and the pool's
    fairness key (from ``workflow_id``) unless it names one."""
    key = PRIORITY_BY_WORKFLOW.get(workflow_type)
    if key is not None and given.priority_key is None:
        given = dataclasses.replace(given, priority_key=key)
    fairness = fairness_key_for(workflow_id)
    if fairness is not None and given.fairness_key is None:
        given = dataclasses.replace(given, fairness_key=fairness)
    return given


class _ClientOutbound(temporal_client.OutboundInterceptor):
    async def start_workflow(self, input: temporal_client.StartWorkflowInput) -> Any:
        input.priority = priority_for(input.workflow, input.priority, input.id)
        return await super().start_workflow(input)

    async def start_update_with_start_workflow(
        self, input: temporal_client.StartWorkflowUpdateWithStartInput
    ) -> Any:
        start = input.start_workflow_input
        start.priority = priority_for(start.workflow, start.priority, start.id)
        return await super().start_update_with_start_workflow(input)

    async def create_schedule(self, input: temporal_client.CreateScheduleInput) -> Any:
        action = input.schedule.action
        if isinstance(action, temporal_client.ScheduleActionStartWorkflow):
            action.priority = priority_for(action.workflow, action.priority, action.id)
        return await super().create_schedule(input)


class ClientPriorities(temporal_client.Interceptor):
    """Sets the priority of every workflow a fleetmend client starts (or schedules)."""

    def intercept_client(
        self, next: temporal_client.OutboundInterceptor
    ) -> temporal_client.OutboundInterceptor:
        return _ClientOutbound(next)


class _WorkflowOutbound(temporal_worker.WorkflowOutboundInterceptor):
    async def start_child_workflow(self, input: temporal_worker.StartChildWorkflowInput) -> Any:
        input.priority = priority_for(input.workflow, input.priority, input.id)
        return await super().start_child_workflow(input)


class _WorkflowInbound(temporal_worker.WorkflowInboundInterceptor):
    def init(self, outbound: temporal_worker.WorkflowOutboundInterceptor) -> None:
        super().init(_WorkflowOutbound(outbound))


class WorkerPriorities(temporal_worker.Interceptor):
    """Sets the priority of every child workflow fleetmend's workflows start."""

    def workflow_interceptor_class(
        self, input: temporal_worker.WorkflowInterceptorClassInput
    ) -> type[temporal_worker.WorkflowInboundInterceptor]:
        return _WorkflowInbound
