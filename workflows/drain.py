"""Step 3 of the planned scale-down (DESIGN.md §4): drain the victims, bounded by a deadline.

Poll the victims' running + waiting requests to zero; at the deadline report what
is still streaming and wait for an operator's ``extend`` or ``accept_cut`` (no
answer: extend once by the original deadline, then ask again and wait). ``Drain``
is a base of ``PlannedScaleDown``: the SDK collects its Updates from base classes,
as it does the toolkit's.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.drain import DrainActivities, DrainLook
    from fleet.incident import PoolRef
    from fleet.recovery import OperatorAction, Phase, ProcedureStatus, RetryBudget
    from fleet.scale_down import DrainProgress, ScaleDownInput, deadline_choice
    from workflows.procedure import Aborted, Procedure

# A drain look is a few scrapes: a short timeout lets a drain resume quickly on another worker.
_LOOK_TIMEOUT_S = 10.0


class Drain(Procedure):
    """The drain step, its deadline and the operator's answers to it."""

    def __init__(
        self, status: ProcedureStatus, *, budget: RetryBudget, dry_run: bool, operator_wait_s: float
    ) -> None:
        super().__init__(status, budget=budget, dry_run=dry_run, operator_wait_s=operator_wait_s)
        self._at_deadline = False
        self._extension: OperatorAction | None = None
        self._cut_accepted: OperatorAction | None = None
        self._last_progress: DrainProgress | None = None

    async def drain(self, inp: ScaleDownInput, leaders: list[str]) -> None:
        """Poll the victims' running + waiting requests to zero; at the deadline, ask an operator."""
        await self.enter(
            Phase.DRAINING,
            f"Draining {', '.join(leaders)}: waiting for running + waiting requests to reach zero "
            f"(deadline {inp.drain_deadline_s:g} s)",
        )
        started = self.now()
        deadline = started + inp.drain_deadline_s
        unanswered = 0
        while True:
            progress, _ = await self.poll(
                lambda: self._look(inp.pool, leaders),
                lambda p: p.drained or inp.dry_run,
                interval_s=inp.poll_interval_s,
                deadline=deadline,
                summary="drain poll",
                on_miss=partial(self._still_draining, deadline=deadline),
                look_at_deadline=True,
            )
            if progress.drained:
                self.figure("drain_seconds", round(self.now() - started, 2))
                self.decide(f"drained: {progress.summary()}")
                return
            if inp.dry_run:
                self.decide(f"dry-run: would wait for {progress.summary()}")
                return
            self.figure("in_flight_at_deadline", progress.in_flight)
            verdict, extra_s = await self._deadline_reached(inp, progress, unanswered)
            if verdict == "cut":
                return
            if verdict == "unanswered":
                unanswered += 1
            deadline = self.now() + extra_s
            await self.enter(Phase.DRAINING, f"Draining, {extra_s:g} s more: {progress.summary()}")

    def _still_draining(self, progress: DrainProgress, *, deadline: float) -> None:
        self.set_details(
            f"**Phase:** draining\n\n{progress.summary()}; deadline in {deadline - self.now():.0f} s"
        )

    async def _deadline_reached(
        self, inp: ScaleDownInput, progress: DrainProgress, unanswered: int
    ) -> tuple[str, float]:
        """Report what still streams and wait for ``extend`` / ``accept_cut``; no answer: extend once."""
        what = (
            f"drain deadline passed with {progress.summary()}: `extend` (extend_s) to wait longer, or "
            "`accept_cut` to terminate now and cut them"
        )
        self.decide(what, {"still_streaming": progress.model_dump(mode="json")})
        self._extension = self._cut_accepted = None
        self._at_deadline = True
        status = self._status
        status.awaiting = what
        await self.enter(Phase.AWAITING_OPERATOR, f"**Awaiting operator**: {what}")
        await self.notify(f"drain-deadline-{len(status.decisions)}", f"[fleetmend] {inp.pool.key}: {what}")
        try:
            await workflow.wait_condition(
                lambda: (
                    self._extension is not None or self._cut_accepted is not None or self._abort is not None
                ),
                timeout=timedelta(seconds=inp.operator_timeout_s),
                timeout_summary="operator: extend or accept_cut",
            )
        except TimeoutError:
            choice = deadline_choice(unanswered)
            if choice == "extend":
                self.decide(
                    f"no operator answered within {inp.operator_timeout_s:g} s: extending the drain once by "
                    f"{inp.drain_deadline_s:g} s; at the next deadline the procedure asks again and waits"
                )
                return "unanswered", inp.drain_deadline_s
            self.decide(f"still no answer after {inp.operator_timeout_s:g} s: asking again")
            return "unanswered", inp.poll_interval_s
        finally:
            self._at_deadline = False
            status.awaiting = None
        if self._abort is not None:
            raise Aborted()
        if self._cut_accepted is not None:
            a = self._cut_accepted
            self.figure("cut_accepted_in_flight", progress.in_flight)
            self.figure("cut_accepted_by", a.operator)
            self.decide(f"cut accepted by {a.operator} ({a.reason}): terminating with {progress.summary()}")
            return "cut", 0.0
        assert self._extension is not None
        extra = self._extension.extend_s or inp.drain_deadline_s
        self.decide(f"drain extended by {extra:g} s by {self._extension.operator}: {self._extension.reason}")
        return "extended", extra

    @workflow.update(
        name="extend", description="Give the drain more time (extend_s, default the drain deadline)"
    )
    def extend(self, action: OperatorAction) -> ProcedureStatus:
        self._extension = action
        return self._status

    @extend.validator
    def _validate_extend(self, action: OperatorAction) -> None:
        self._require_deadline("nothing to extend")

    @workflow.update(
        name="accept_cut",
        description="Terminate now although streams are still running on the victims (they are cut and "
        "recorded)",
    )
    def accept_cut(self, action: OperatorAction) -> ProcedureStatus:
        self._cut_accepted = action
        return self._status

    @accept_cut.validator
    def _validate_accept_cut(self, action: OperatorAction) -> None:
        self._require_deadline("nothing to cut")
        if not action.reason:
            raise ValueError(
                "accepting a cut needs a reason (it goes into the record next to the cut streams)"
            )

    async def _look(self, pool: PoolRef, leaders: list[str]) -> DrainProgress:
        await self.checkpoint()  # between drain looks an operator may pause or abort
        progress = await self.observe(
            DrainActivities.drain_look,
            DrainLook(pool=pool, pods=leaders),
            "drain: running + waiting on the victims",
            timeout_s=_LOOK_TIMEOUT_S,
        )
        self._last_progress = progress
        self.figure("victims_in_flight", progress.in_flight)
        return progress

    def _require_deadline(self, what: str) -> None:
        """``extend`` and ``accept_cut`` answer the drain deadline's question, and only that."""
        self._require_running()
        if not self._at_deadline:
            raise ValueError(
                f"{what}: the drain is not waiting at its deadline (phase {self._status.phase.value}); "
                "extend and accept_cut apply once the deadline passed and status.awaiting asks for them"
            )
