"""A stand-in for ``ReplicaLossRecovery`` (same workflow name) and the incident channel, for the test
of FleetIncident's own continue-as-new: a recovery that ends *failed* when told, so the incident
carries a failed recovery awaiting ``resolve`` across the hand-over (the worker-roll test runs the
real recovery). Module without side effects: the workflow sandbox re-imports it.
"""

from __future__ import annotations

from pydantic import BaseModel
from temporalio import activity, workflow

with workflow.unsafe.imports_passed_through():
    from activities.act import EffectReport, NotifyRequest
    from fleet.incident import LossReport
    from fleet.recovery import Phase, ProcedureStatus, RecoveryInput


class Finish(BaseModel):
    phase: Phase = Phase.DONE
    lost: list[str] = []  # the groups (single-pod: named as their pods) the recovery says it handled


@workflow.defn(name="ReplicaLossRecovery")
class StubRecovery:
    def __init__(self) -> None:
        self._finish: Finish | None = None
        self._reports: list[LossReport] = []

    @workflow.signal(name="finish")
    def finish(self, how: Finish) -> None:
        self._finish = how

    @workflow.signal(name="add_losses")
    def add_losses(self, reports: list[LossReport]) -> None:
        self._reports.extend(reports)

    @workflow.run
    async def run(self, inp: RecoveryInput) -> ProcedureStatus:
        await workflow.wait_condition(lambda: self._finish is not None)
        assert self._finish is not None
        return ProcedureStatus(
            workflow=workflow.info().workflow_id,
            pool=inp.pool,
            phase=self._finish.phase,
            figures={
                "reports": len(inp.reports) + len(self._reports),
                "first_report": inp.reports[0].pod,
                "lost_groups": self._finish.lost,
                "lost_pods": self._finish.lost,
            },
        )


NOTIFIED: list[str] = []


@activity.defn(name="notify")
def stub_notify(req: NotifyRequest) -> EffectReport:
    """The incident channel: records the message (the real one goes through the ledger)."""
    NOTIFIED.append(req.text)
    return EffectReport(op_id=f"{req.scope}/{req.topic}", kind="notify", target="channel", state="applied")
