"""fleetmend's own worker metrics: recoveries by outcome, phase durations, effects.

They are recorded by a workflow interceptor through ``workflow.metric_meter()``,
so they leave through the same Prometheus endpoint as the Temporal SDK's
metrics (``FLEETMEND_WORKER_METRICS_PORT``, one scrape target) and the SDK
suppresses them while a workflow is replayed: a recovery is counted once, when
it really ends, however often a worker replays its history. Every procedure
(``ReplicaLossRecovery``, ``PlannedScaleDown``) returns its final
``ProcedureStatus``; the interceptor reads phases and effect counts from it.

* ``fleetmend_procedures_total{workflow_type, outcome}`` — outcome = final phase
  (done, not-a-loss, bad-rollout, aborted, ...) or ``failed`` when the run raised;
* ``fleetmend_procedures_verified_total{workflow_type, passed}``;
* ``fleetmend_phase_duration_seconds{workflow_type, phase}`` — a histogram;
* ``fleetmend_effects_total{workflow_type, result}`` — applied, deduplicated,
  planned, divergent, ... as the procedure counted them.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from temporalio.worker import (
    ExecuteWorkflowInput,
    Interceptor,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)

with workflow.unsafe.imports_passed_through():
    from fleet.recovery import ProcedureStatus

PROCEDURE_TYPES = frozenset({"ReplicaLossRecovery", "PlannedScaleDown"})
PHASE_DURATION = "fleetmend_phase_duration_seconds"
# Phase durations span sub-second derouting to half-hour replacements.
PHASE_DURATION_BUCKETS: tuple[float, ...] = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800, 3600)


class _ProcedureMetrics(WorkflowInboundInterceptor):
    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        wf_type = workflow.info().workflow_type
        if wf_type not in PROCEDURE_TYPES:
            return await super().execute_workflow(input)
        meter = workflow.metric_meter()
        procedures = meter.create_counter(
            "fleetmend_procedures_total", "fleetmend procedures that ended, by final phase"
        )
        try:
            result = await super().execute_workflow(input)
        except BaseException:
            procedures.add(1, {"workflow_type": wf_type, "outcome": "failed"})
            raise
        status = result if isinstance(result, ProcedureStatus) else None
        if status is None and isinstance(result, dict):
            status = ProcedureStatus.model_validate(result)
        if status is None:
            procedures.add(1, {"workflow_type": wf_type, "outcome": "unknown"})
            return result
        procedures.add(1, {"workflow_type": wf_type, "outcome": status.phase.value})
        if status.verification is not None:
            meter.create_counter(
                "fleetmend_procedures_verified_total", "Procedures verified after they acted, by result"
            ).add(1, {"workflow_type": wf_type, "passed": str(status.verification.passed).lower()})
        durations = meter.create_histogram_float(PHASE_DURATION, "Time spent in each procedure phase", "s")
        for span in status.phases:
            if span.end is not None:
                durations.record(
                    max(0.0, span.end - span.start), {"workflow_type": wf_type, "phase": span.name.value}
                )
        effects = meter.create_counter(
            "fleetmend_effects_total", "Effects the procedure went through the ledger with"
        )
        for key, value in status.figures.items():
            if key.startswith("effects_") and isinstance(value, int) and value > 0:
                effects.add(value, {"workflow_type": wf_type, "result": key.removeprefix("effects_")})
        return result


class ProcedureMetricsInterceptor(Interceptor):
    """Pass to ``Worker(interceptors=[...])``; records the metrics above."""

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor] | None:
        return _ProcedureMetrics
