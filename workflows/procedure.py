"""What every fleetmend procedure workflow shares: phases, decisions, the status query, operator Updates.

``Procedure`` is a base class for ``@workflow.defn`` classes (the SDK collects
handlers from base classes). It keeps the operator-visible state
(``ProcedureStatus``) and gives each procedure the same steering:

* ``status`` query - phase, decisions, figures, what it awaits;
* ``pause`` / ``resume`` / ``abort`` / ``approve`` Updates, validated (a
  rejection is raised in the validator only: an exception in an Update handler
  other than ``ApplicationError`` would wedge the workflow, DESIGN.md §6b);
* ``_enter(phase)`` - a step boundary: honours pause/abort, closes the previous
  phase span, upserts ``FleetmendPhase`` and the current details shown in the UI;
* ``_decide`` / ``_figure`` - the record an SRE reads afterwards.

Subclasses call ``super().__init__()``, set ``self._status`` when the run
starts, and may override ``_on_phase_entered`` to do work at every boundary.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from fleet import search_attributes as sa
    from fleet.recovery import TERMINAL_PHASES, Decision, OperatorAction, Phase, PhaseSpan, ProcedureStatus


# Kubernetes and router calls are quick; a retry storm must not hammer a sick API server.
ACTIVITY_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=5),
)
ACTIVITY_TIMEOUT = timedelta(seconds=30)


class Aborted(Exception):
    """An operator aborted the procedure (the ``abort`` Update), or it gave up waiting."""


class Procedure:
    def __init__(self) -> None:
        self._status: ProcedureStatus | None = None
        self._paused = False
        self._abort: OperatorAction | None = None
        self._awaiting: str | None = None
        self._approval: OperatorAction | None = None

    # ================================================================ operator steering

    @workflow.query(name="status", description="Phase, decisions and figures of this procedure")
    def status(self) -> ProcedureStatus:
        return self._status_()

    @workflow.update(name="pause", description="Hold the procedure at the next step boundary")
    def pause(self, action: OperatorAction) -> ProcedureStatus:
        self._paused = True
        self._status_().paused = True
        self._decide(f"paused by {action.operator}: {action.reason}")
        return self._status_()

    @pause.validator
    def _validate_pause(self, action: OperatorAction) -> None:
        self._require_running()
        if self._paused:
            raise ValueError("already paused; use resume")

    @workflow.update(name="resume", description="Continue a paused procedure")
    def resume(self, action: OperatorAction) -> ProcedureStatus:
        self._paused = False
        self._status_().paused = False
        self._decide(f"resumed by {action.operator}: {action.reason}")
        return self._status_()

    @resume.validator
    def _validate_resume(self, action: OperatorAction) -> None:
        self._require_running()
        if not self._paused:
            raise ValueError("not paused")

    @workflow.update(
        name="abort",
        description="Stop the procedure at the next step boundary (effects already "
        "applied stay applied and recorded)",
    )
    def abort(self, action: OperatorAction) -> ProcedureStatus:
        self._abort = action
        self._decide(f"abort requested by {action.operator}: {action.reason}")
        return self._status_()

    @abort.validator
    def _validate_abort(self, action: OperatorAction) -> None:
        self._require_running()
        if not action.reason:
            raise ValueError("an abort needs a reason (it goes into the incident record)")

    @workflow.update(
        name="approve", description="Approve the step the procedure is waiting for (see status.awaiting)"
    )
    def approve(self, action: OperatorAction) -> ProcedureStatus:
        self._approval = action
        return self._status_()

    @approve.validator
    def _validate_approve(self, action: OperatorAction) -> None:
        self._require_running()
        if self._awaiting is None:
            raise ValueError("nothing is awaiting approval right now (see the status query's 'awaiting')")

    def _require_running(self) -> None:
        if self._status is None:
            raise ValueError("the procedure has not started yet")
        if self._status.phase in TERMINAL_PHASES:
            raise ValueError(f"the procedure has ended (phase {self._status.phase.value})")

    # ================================================================ phases and the record

    def _finish(self, phase: Phase) -> ProcedureStatus:
        status = self._status_()
        now = self._now()
        if status.phases and status.phases[-1].end is None:
            status.phases[-1].end = now
        status.phase = phase
        status.phases.append(PhaseSpan(name=phase, start=now, end=now))
        workflow.upsert_search_attributes([sa.FLEETMEND_PHASE.value_set(phase.value)])
        self._set_details(f"**{phase.value}** — {status.decisions[-1].summary if status.decisions else ''}")
        return status

    async def _enter(self, phase: Phase, details: str) -> None:
        await self._checkpoint()
        status = self._status_()
        now = self._now()
        if status.phases and status.phases[-1].end is None:
            status.phases[-1].end = now
        status.phases.append(PhaseSpan(name=phase, start=now))
        status.phase = phase
        workflow.upsert_search_attributes([sa.FLEETMEND_PHASE.value_set(phase.value)])
        self._set_details(f"**Phase:** {phase.value}\n\n{details}")
        await self._on_phase_entered(phase)

    async def _on_phase_entered(self, phase: Phase) -> None:
        """Hook run at every step boundary (after the phase is recorded)."""

    async def _announce_awaiting(self, what: str) -> None:
        """Hook: tell the incident channel an operator is needed (the procedures post through the ledger)."""

    async def _await_operator(self, what: str, timeout_s: float) -> OperatorAction | None:
        """Stop in ``awaiting-operator`` until the ``approve`` Update answers; back to the previous phase.

        Returns the approval, or None when nobody answered within ``timeout_s`` (each procedure
        decides what silence means); raises ``Aborted`` when an operator aborted instead.
        """
        self._awaiting = what
        self._approval = None
        status = self._status_()
        status.awaiting = what
        previous = status.phase
        await self._enter(
            Phase.AWAITING_OPERATOR, f"**Awaiting operator**: {what} — use the `approve` Update"
        )
        await self._announce_awaiting(what)
        try:
            await workflow.wait_condition(
                lambda: self._approval is not None or self._abort is not None,
                timeout=timedelta(seconds=timeout_s),
                timeout_summary="operator approval",
            )
        except TimeoutError:
            return None
        finally:
            self._awaiting = None
            status.awaiting = None
        if self._abort is not None:
            raise Aborted()
        approval = self._approval
        assert approval is not None
        await self._enter(previous, f"approved: {what}")
        return approval

    async def _checkpoint(self) -> None:
        if self._abort is not None:
            raise Aborted()
        if self._paused:
            self._set_details("**Paused** by an operator — use the `resume` Update")
            await workflow.wait_condition(lambda: not self._paused or self._abort is not None)
            if self._abort is not None:
                raise Aborted()

    def _decide(self, summary: str, figures: dict[str, Any] | None = None) -> None:
        status = self._status_()
        status.decisions.append(
            Decision(phase=status.phase, summary=summary, figures=figures or {}, at=self._now())
        )

    def _figure(self, key: str, value: Any) -> None:
        self._status_().figures[key] = value

    def _set_details(self, text: str) -> None:
        workflow.set_current_details(text)

    def _now(self) -> float:
        return workflow.now().timestamp()

    def _status_(self) -> ProcedureStatus:
        assert self._status is not None
        return self._status
