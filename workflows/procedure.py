"""The procedure toolkit: what every fleetmend procedure workflow does the same way.

``Procedure`` is the base class of ``ReplicaLossRecovery`` and ``PlannedScaleDown``
(the SDK collects handlers from base classes). Their ``run()`` methods read as the
runbook; each step observes, decides with a pure function from ``fleet/`` and acts
through this toolkit:

* ``act(activity, request, summary)`` - one ledger-backed effect. It stamps the
  procedure's operation-id scope, dry-run and alert fingerprints on the request and
  applies **the one refused-effect policy**: a refused effect (recorded ``failed`` or
  ``needs_operator``), a divergent one, or an activity whose retry budget is spent
  stops the step and asks an operator - ``retry`` (the same action again, under a
  new operation id when the first one was recorded as refused), ``skip`` (with a
  reason: the operator takes responsibility, the procedure goes on *without* the
  effect) or ``abort``. The phase, the current details, ``status.refusal``, the
  incident channel and ``fleetmend status`` all say what was refused and the world's
  own error text. A procedure never acts on the assumption that a failed effect
  happened.
* ``observe(activity, request, summary)`` - a read, retried within the same bounded
  budget; when the budget is spent the operator is asked (``retry`` or ``abort``).
* ``deroute(...)`` - remove the router-only label and wait until the router no
  longer routes to the pods; a router that does not follow is escalated, not ignored.
* ``observe_pool(pool, summary)`` - one look at a pool (Kubernetes + gateway + engines).
* ``window(look, interval_s)`` - two looks an interval apart (a rate needs two).
* ``poll(look, until, interval_s, deadline, summary)`` - look until a condition holds or a
  deadline passes; says which it was. Every "wait until" of every procedure is this loop.
  ``window``, ``poll`` and ``now`` are ``Watch``: the readiness keeper samples with them too.
* ``run_bounded(activity, arg, budget=..., summary=...)`` - the one place any fleetmend workflow runs
  an activity: ``bounded_call(budget)`` gives it a maximum attempt count *and* a schedule-to-close
  (and refuses a budget without either). ``act``, ``observe``, ``call`` and ``notify`` use it, and so
  do FleetIncident's policy load and the ReadinessKeeper's sample; tests/test_bounded_activities.py
  fails on an activity call anywhere else in ``workflows/``.
* ``Record`` (the base of ``Procedure`` and of ``FleetIncident``): the status record
  (``decide``, ``figure``, ``set_phase``, ``begin``), the incident channel (``notify``) and the
  operation-id ``scope`` - one copy for every workflow that keeps a record.
* ``await_operator(what)`` - an approval gate (the ``approve`` Update). A wait on an operator,
  whatever its length (a day, a weekend), adds at most ``OPERATOR_WAIT_EVENTS_MAX`` history
  events: its reminders back off (x2 up to ``REMINDER_INTERVAL_CAP_S``) and stop after
  ``REMINDERS_MAX``; the wait itself is one timer, never a poll.
* ``await_release(what, released)`` - held in ``awaiting-operator`` on a decision made elsewhere (the
  removal breaker's reset), with the same bounded reminders.
* ``notify(topic, text)`` - the incident channel, through the ledger.
* ``enter(phase)`` / ``decide`` / ``figure`` - step boundaries and the record an SRE
  reads afterwards; ``status`` query; ``pause`` / ``resume`` / ``abort`` Updates.

Rejections live in the Update validators only: an exception other than
``ApplicationError`` in an Update handler would wedge the workflow (DESIGN.md §6b).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable
from datetime import timedelta
from typing import Any, NamedTuple, TypedDict, TypeVar, overload

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError
from temporalio.exceptions import TimeoutError as TemporalTimeoutError

with workflow.unsafe.imports_passed_through():
    from activities.act import ActActivities, EffectReport, EffectRequest, NotifyRequest, PodLabelsChange
    from activities.observe import DerouteSeen, DerouteWait, ObserveActivities, ObserveRequest
    from fleet import search_attributes as sa
    from fleet.incident import PoolRef
    from fleet.observation import LookVerdict, PartialLook, PoolObservation
    from fleet.recovery import (
        TERMINAL_PHASES,
        Decision,
        OperatorAction,
        Phase,
        PhaseSpan,
        ProcedureStatus,
        RecoveryTimings,
        Refusal,
        RetryBudget,
    )
    from fleet.slots import SlotDecision, Slots
    from fleet.vocabulary import POD_DELETION_COST_ANNOTATION, REMOVE_FIRST_DELETION_COST

ReqT = TypeVar("ReqT", bound=EffectRequest)
ArgT = TypeVar("ArgT")
ResultT = TypeVar("ResultT")

# States of an effect the procedure may build on.
_DONE_STATES = frozenset({"applied", "planned", "skipped"})

# An operator wait's reminders (``Procedure._wait_for_operator``): the interval doubles from the
# procedure's operator wait up to this cap, and after REMINDERS_MAX reminders the wait is silent.
REMINDER_INTERVAL_CAP_S = 8 * 3600.0
REMINDERS_MAX = 8
# What one reminder adds to the history: timer started + fired, a workflow task (3 events), the notify
# activity (scheduled, started, completed) and the workflow task after it (3).
EVENTS_PER_REMINDER = 11
# The history one wait on an operator adds however long it lasts: its reminders, the back-off's patch
# marker and the search-attribute upsert that records it (2), a timeout's timer (2) and the answer's
# workflow task (3), with one to spare. A day's wait measured +89 (tests/recovery/test_long_wait.py).
OPERATOR_WAIT_EVENTS_MAX = REMINDERS_MAX * EVENTS_PER_REMINDER + 8
# A read-only look that failed, or read nothing a step needs, is tried again after a backoff that
# doubles from the retry budget's max interval up to this (``Procedure._read``, ``read_enough``).
READ_BACKOFF_CAP_S = 60.0


def activity_retry(budget: RetryBudget) -> RetryPolicy:
    """The activities' retry policy: exponential backoff, bounded in attempts (time: ``bounded_timeouts``)."""
    if budget.attempts < 1:
        raise ValueError(f"an activity needs a maximum attempt count >= 1 (got {budget.attempts})")
    return RetryPolicy(
        initial_interval=timedelta(seconds=budget.initial_interval_s),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=budget.max_interval_s),
        maximum_attempts=budget.attempts,
    )


class BoundedCall(NamedTuple):
    """The options of one bounded activity call: attempts *and* time, never Temporal's unlimited default."""

    retry_policy: RetryPolicy
    start_to_close: timedelta
    schedule_to_close: timedelta
    heartbeat: timedelta | None


def bounded_call(
    budget: RetryBudget, *, timeout_s: float | None = None, heartbeat_s: float | None = None
) -> BoundedCall:
    """The bounded policy of one activity call from a ``RetryBudget``.

    ``timeout_s`` overrides one attempt's start-to-close (a long wait such as ``await_derouted``);
    the schedule-to-close then allows two such attempts. A budget that would leave the call
    unbounded (no attempts, no or infinite time) is a bug, refused here rather than at 3 a.m.
    """
    call_s = timeout_s or budget.call_timeout_s
    total_s = max(budget.budget_s, 2 * (timeout_s or 0.0))
    for name, value in (("schedule-to-close", total_s), ("start-to-close", call_s)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"an activity needs a finite, positive {name} (got {value})")
    return BoundedCall(
        retry_policy=activity_retry(budget),
        start_to_close=timedelta(seconds=call_s),
        schedule_to_close=timedelta(seconds=total_s),
        heartbeat=timedelta(seconds=heartbeat_s) if heartbeat_s else None,
    )


async def run_bounded(
    activity: Callable[..., Any],
    arg: Any,
    *,
    budget: RetryBudget,
    summary: str,
    timeout_s: float | None = None,
    heartbeat_s: float | None = None,
) -> Any:
    """Run one activity under ``bounded_call(budget)``: the only place a fleetmend workflow runs one.

    A spent budget raises ``ActivityError``; the caller says what that means (a procedure asks an
    operator, the readiness keeper records it and samples again). tests/test_bounded_activities.py
    fails on any ``workflow.execute_activity*`` / ``start_activity*`` outside this module.
    """
    bounded = bounded_call(budget, timeout_s=timeout_s, heartbeat_s=heartbeat_s)
    return await workflow.execute_activity(
        activity,
        arg,
        start_to_close_timeout=bounded.start_to_close,
        schedule_to_close_timeout=bounded.schedule_to_close,
        heartbeat_timeout=bounded.heartbeat,
        retry_policy=bounded.retry_policy,
        summary=summary[:190],
    )


def describe_failure(err: BaseException) -> str:
    """The world's own error text out of an activity failure (the innermost cause's message)."""
    parts: list[str] = []
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, TemporalTimeoutError):
            parts.append(f"timed out ({cause.type.name.lower() if cause.type else 'timeout'})")
        elif isinstance(cause, ApplicationError):
            parts.append(cause.message)
        cause = cause.__cause__
    retry_state = getattr(err, "retry_state", None)
    spent = {
        "MAXIMUM_ATTEMPTS_REACHED": "retry budget spent (attempts)",
        "TIMEOUT": "retry budget spent (time)",
    }
    head = spent.get(retry_state.name, "") if retry_state is not None else ""
    text = "; ".join(p for p in parts if p) or str(err)
    return f"{head}: {text}" if head else text


def timed_out(err: ActivityError) -> bool:
    """The activity's budget ran out on time (an attempt or the whole call timed out): the world was
    slow, not refusing - for a read, worth trying again later."""
    retry_state = getattr(err, "retry_state", None)
    if retry_state is not None and retry_state.name == "TIMEOUT":
        return True
    cause: BaseException | None = err.cause
    while cause is not None:
        if isinstance(cause, TemporalTimeoutError):
            return True
        cause = cause.__cause__
    return False


def is_cancellation(err: ActivityError) -> bool:
    """The activity ended because the workflow itself is being cancelled: re-raise, never handle it."""
    return isinstance(err.cause, CancelledError)


def _resolved_by_ledger(err: ActivityError) -> bool:
    """The ledger resolved the operation for good (needs_operator, divergent): not a spent budget."""
    cause = err.cause
    return isinstance(cause, ApplicationError) and cause.non_retryable


class Aborted(Exception):
    """An operator aborted the procedure (the ``abort`` Update), or it gave up waiting."""


def should_continue_as_new() -> bool:
    """History getting long, or a newer worker version is the target: hand over to a fresh run."""
    info = workflow.info()
    return info.is_continue_as_new_suggested() or info.is_target_worker_deployment_version_changed()


class Watch:
    """Looking at the world over time, the same way in every workflow (procedures, incident, keeper)."""

    def now(self) -> float:
        return workflow.now().timestamp()

    async def window(
        self,
        look: Callable[[str], Awaitable[ResultT]],
        interval_s: float,
        *,
        summary: str,
        first: ResultT | None = None,
    ) -> tuple[ResultT, ResultT]:
        """Two looks ``interval_s`` apart (a rate, a queue's trend, a counter's delta needs two).

        ``first``: a look the workflow already took (it starts the window; only the second is taken).
        """
        if first is None:
            first = await look(f"{summary}: first look")
        await workflow.sleep(interval_s, summary=f"{summary}: interval"[:190])
        second = await look(f"{summary}: second look")
        return first, second

    async def poll(
        self,
        look: Callable[[], Awaitable[ResultT]],
        until: Callable[[ResultT], bool],
        *,
        interval_s: float,
        deadline: float | None,
        summary: str,
        on_miss: Callable[[ResultT], None] | None = None,
        first: ResultT | None = None,
        look_at_deadline: bool = False,
        backoff_to_s: float | None = None,
    ) -> tuple[ResultT, bool]:
        """Look until ``until(look())`` holds or ``deadline`` (workflow time) has passed.

        Returns the last look and whether the condition held (False: the deadline passed;
        the caller says what that means). ``on_miss`` runs after every look that did not
        satisfy the condition, before the interval (to record what is still awaited).
        ``deadline=None`` polls until the condition holds. ``first``: a look the workflow
        already took, judged before any new one (a wait resumed after an operator answered
        starts with an interval, not a look). ``look_at_deadline``: the interval before the
        deadline is cut short so that one look falls on it (a deadline promised to an operator).
        ``backoff_to_s``: the interval doubles after every miss up to this (a long watch whose
        history must stay bounded: the looks of a wait of length W are about log2(cap / interval) + W / cap).
        """
        value = first
        while True:
            if value is None:
                value = await look()
            if until(value):
                return value, True
            now = self.now()
            if deadline is not None and now > deadline:
                return value, False
            if on_miss is not None:
                on_miss(value)
            interval = interval_s
            if look_at_deadline and deadline is not None:
                interval = min(interval_s, max(0.05, deadline - now))
            await workflow.sleep(interval, summary=summary[:190])
            if backoff_to_s is not None:
                interval_s = min(backoff_to_s, 2 * interval_s)
            value = None


class Record(Watch):
    """A workflow an SRE reads and hears from: its status record, search attributes, the incident
    channel, and the operation-id scope its ledger effects are keyed by (procedures and FleetIncident)."""

    def __init__(self, status: ProcedureStatus, *, budget: RetryBudget, dry_run: bool) -> None:
        self._status = status
        self._budget = budget
        self._dry_run = dry_run
        self._fingerprints: list[str] = []

    @property
    def dry_run(self) -> bool:
        """Effects are recorded as planned, not performed (``act``'s ``report_only`` aside)."""
        return self._dry_run

    @property
    def scope(self) -> str:
        """Operation-id scope: one procedure's whole life (retries, replays, continue-as-new), never another's."""
        info = workflow.info()
        return f"{info.workflow_id}@{info.first_execution_run_id}"

    def set_fingerprints(self, fingerprints: list[str]) -> None:
        self._fingerprints = sorted(set(fingerprints))[:20]

    async def notify(self, topic: str, text: str) -> None:
        """Post to the incident channel through the ledger. A refused post is recorded, never escalated
        (the channel is how an operator hears of escalations)."""
        request = NotifyRequest(
            step="notify",
            topic=topic,
            text=text,
            scope=self.scope,
            dry_run=self._dry_run,
            fingerprints=self._fingerprints,
        )
        try:
            report: EffectReport = await run_bounded(
                ActActivities.notify, request, budget=self._budget, summary=f"incident channel: {topic}"
            )
        except ActivityError as err:
            self.decide(f"incident channel unreachable ({describe_failure(err)}); message was: {text}")
            return
        self._count(report)

    # ================================================================ the record

    def begin(self, kind: str, pool: PoolRef, **extra: Any) -> None:
        """Search attributes every procedure carries (the UI's filters); ``extra`` keyword SAs by key name."""
        pairs: list[SearchAttributeUpdate[Any]] = [
            sa.FLEETMEND_KIND.value_set(kind),
            sa.FLEETMEND_NAMESPACE.value_set(pool.namespace),
            sa.FLEETMEND_POOL.value_set(pool.key),
            sa.FLEETMEND_PHASE.value_set(self._status.phase.value),
            sa.FLEETMEND_DRY_RUN.value_set(self._status.dry_run),
        ]
        if "severity" in extra:
            pairs.append(sa.FLEETMEND_SEVERITY.value_set(str(extra["severity"])))
        workflow.upsert_search_attributes(pairs)

    def set_phase(self, phase: Phase) -> None:
        """The current phase, in the status and in the search attribute the UI filters on."""
        self._status.phase = phase
        workflow.upsert_search_attributes([sa.FLEETMEND_PHASE.value_set(phase.value)])

    def decide(
        self, summary: str, figures: dict[str, Any] | None = None, *, phase: Phase | None = None
    ) -> None:
        """One entry of the record; ``phase`` when it is about another phase than the current one."""
        self._status.decisions.append(
            Decision(phase=phase or self._status.phase, summary=summary, figures=figures or {}, at=self.now())
        )

    def figure(self, key: str, value: Any) -> None:
        self._status.figures[key] = value

    def set_details(self, text: str) -> None:
        workflow.set_current_details(text)

    def _count(self, report: EffectReport) -> None:
        figures = self._status.figures
        key = f"effects_{report.state}"
        figures[key] = figures.get(key, 0) + 1
        if report.replayed:
            figures["effects_deduplicated"] = figures.get("effects_deduplicated", 0) + 1

    async def await_slot(
        self,
        look: Callable[[], Awaitable[Slots]],
        decide: Callable[[Slots], SlotDecision],
        *,
        queued: Callable[[], Awaitable[None]],
        interval_s: float,
        wait_s: float,
        summary: str,
        still_queued: str,
    ) -> bool:
        """Bounded remediation, fleet-wide (``fleet.slots``): wait, queued and visibly, until ``decide``
        finds a free slot in what ``look`` counts. ``queued`` runs once the work is queued (a phase, the
        UI's details). Looks back off to 8 x ``interval_s``; after ``wait_s`` the wait ends saying
        ``still_queued`` (False: the caller says what that means)."""
        first = await look()
        decision = decide(first)
        if decision.free:
            return True
        self.decide(decision.reason, {"slots": first.model_dump(mode="json")})
        await queued()
        slots, free = await self.poll(
            look,
            lambda slots: decide(slots).free,
            interval_s=interval_s,
            deadline=self.now() + wait_s,
            summary=summary,
            backoff_to_s=8 * interval_s,
        )
        now = decide(slots)
        self.decide(now.reason if free else f"{now.reason}; {still_queued}")
        return free


class Opening(TypedDict):
    """What ``Procedure.__init__`` takes (``super().__init__(**opening(...))``)."""

    status: ProcedureStatus
    budget: RetryBudget
    dry_run: bool
    operator_wait_s: float


def opening(
    pool: PoolRef, phase: Phase, timings: RecoveryTimings, *, dry_run: bool, figures: dict[str, Any]
) -> Opening:
    """The opening of a procedure that runs on recovery timings (replica loss, node fence, fleet
    event): its status record in ``phase``, the activity budget and the operator wait."""
    status = ProcedureStatus(
        workflow=workflow.info().workflow_id, pool=pool, phase=phase, dry_run=dry_run, figures=figures
    )
    return Opening(
        status=status, budget=timings.retry, dry_run=dry_run, operator_wait_s=timings.approval_timeout_s
    )


class Procedure(Record):
    """The toolkit; a subclass's ``@workflow.init`` builds its state and calls ``super().__init__``
    (``opening(...)`` builds its arguments for the procedures on recovery timings)."""

    def __init__(
        self, status: ProcedureStatus, *, budget: RetryBudget, dry_run: bool, operator_wait_s: float
    ) -> None:
        super().__init__(status, budget=budget, dry_run=dry_run)
        self._operator_wait_s = operator_wait_s
        self._paused = False
        self._abort: OperatorAction | None = None
        self._awaiting: str | None = None
        self._approval: OperatorAction | None = None
        self._answer: tuple[str, OperatorAction] | None = None
        self._refusals = 0
        # Steps that run side by side (triage beside the ramp) ask one question at a time.
        self._escalation = asyncio.Lock()

    # ================================================================ operator steering

    @workflow.query(name="status", description="Phase, decisions and figures of this procedure")
    def status(self) -> ProcedureStatus:
        return self._status

    @workflow.update(name="pause", description="Hold the procedure at the next step boundary")
    def pause(self, action: OperatorAction) -> ProcedureStatus:
        self._paused = True
        self._status.paused = True
        self.decide(f"paused by {action.operator}: {action.reason}")
        return self._status

    @pause.validator
    def _validate_pause(self, action: OperatorAction) -> None:
        self._require_running()
        if self._paused:
            raise ValueError("already paused; use resume")

    @workflow.update(name="resume", description="Continue a paused procedure")
    def resume(self, action: OperatorAction) -> ProcedureStatus:
        self._paused = False
        self._status.paused = False
        self.decide(f"resumed by {action.operator}: {action.reason}")
        return self._status

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
        self.decide(f"abort requested by {action.operator}: {action.reason}")
        return self._status

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
        return self._status

    @approve.validator
    def _validate_approve(self, action: OperatorAction) -> None:
        self._require_running()
        if self._awaiting is None:
            if self._status.refusal is not None:
                raise ValueError(
                    "the procedure is waiting on a refused effect, not an approval: answer with retry, "
                    "skip (with a reason) or abort"
                )
            raise ValueError("nothing is awaiting approval right now (see the status query's 'awaiting')")

    @workflow.update(
        name="retry", description="Try the refused effect (or the step whose retry budget is spent) again"
    )
    def retry(self, action: OperatorAction) -> ProcedureStatus:
        self._answer = ("retry", action)
        return self._status

    @retry.validator
    def _validate_retry(self, action: OperatorAction) -> None:
        self._require_refusal()

    @workflow.update(
        name="skip",
        description="Go on without the refused effect (the operator did it by hand, or it is not needed); "
        "needs a reason",
    )
    def skip(self, action: OperatorAction) -> ProcedureStatus:
        self._answer = ("skip", action)
        return self._status

    @skip.validator
    def _validate_skip(self, action: OperatorAction) -> None:
        refusal = self._require_refusal()
        if not refusal.can_skip:
            raise ValueError(
                f"{refusal.what} cannot be skipped (the procedure needs its answer): retry or abort"
            )
        if not action.reason:
            raise ValueError("a skip needs a reason (it goes into the incident record next to the refusal)")

    def _require_running(self) -> None:
        if self._status.phase in TERMINAL_PHASES:
            raise ValueError(f"the procedure has ended (phase {self._status.phase.value})")

    def _require_refusal(self) -> Refusal:
        self._require_running()
        if self._status.refusal is None:
            raise ValueError("no refused effect is waiting for an answer (see the status query's 'refusal')")
        return self._status.refusal

    # ================================================================ acting and observing

    async def act(
        self,
        activity: Callable[[Any, ReqT], EffectReport],
        request: ReqT,
        summary: str,
        *,
        report_only: bool = False,
    ) -> EffectReport:
        """Perform one effect through the ledger; a refusal stops here until an operator answers.

        ``report_only``: the effect changes nothing the workload sees by the API's own definition (a
        DeviceTaintRule with effect ``None`` only reports what NoExecute would evict), so a dry run
        performs it too - that report is what a dry run is for."""
        attempt = 0
        while True:
            await self.checkpoint()
            step = request.step if attempt == 0 else f"{request.step}~{attempt}"
            stamped = request.model_copy(
                update={
                    "step": step,
                    "scope": self.scope,
                    "dry_run": self._dry_run and not report_only,
                    "fingerprints": self._fingerprints,
                }
            )
            try:
                report: EffectReport = await run_bounded(
                    activity, stamped, budget=self._budget, summary=summary
                )
            except ActivityError as err:
                # Budget spent, divergent, or needs an operator: the ledger row (if any) is unresolved
                # or flagged; a retry asks about the same operation id again.
                refusal = Refusal(step=step, what=summary, error=describe_failure(err), attempt=attempt)
                if await self.escalate(refusal) == "skip":
                    return EffectReport(op_id="", kind="", target="", state="skipped", error=refusal.error)
                if _resolved_by_ledger(err):
                    attempt += 1  # needs_operator / divergent is final for that op id: a retry is a new one
                continue
            self._count(report)
            if report.state in _DONE_STATES:
                return report
            refusal = Refusal(step=step, what=summary, error=report.error or report.state, attempt=attempt)
            if await self.escalate(refusal) == "skip":
                return report
            attempt += 1  # the refusal is recorded under its op id; the retry is a new operation

    @overload
    async def observe(
        self,
        activity: Callable[[Any, ArgT], Awaitable[ResultT]],
        arg: ArgT,
        summary: str,
        *,
        timeout_s: float | None = None,
        heartbeat_s: float | None = None,
    ) -> ResultT: ...

    @overload
    async def observe(
        self,
        activity: Callable[[Any, ArgT], ResultT],
        arg: ArgT,
        summary: str,
        *,
        timeout_s: float | None = None,
        heartbeat_s: float | None = None,
    ) -> ResultT: ...

    async def observe(
        self,
        activity: Callable[[Any, ArgT], Any],
        arg: ArgT,
        summary: str,
        *,
        timeout_s: float | None = None,
        heartbeat_s: float | None = None,
    ) -> Any:
        """A read of the world, with the bounded retry budget; a spent budget is tried again with backoff
        for the budget's ``read_patience_s``, then an operator is asked (retry / abort)."""
        return await self._read(
            lambda: run_bounded(
                activity,
                arg,
                budget=self._budget,
                summary=summary,
                timeout_s=timeout_s,
                heartbeat_s=heartbeat_s,
            ),
            summary,
        )

    async def call(self, activity: Callable[[ArgT], Any], arg: ArgT, summary: str) -> Any:
        """A read implemented as a plain function activity (e.g. ``incident_on_pool``), same budget."""
        return await self._read(
            lambda: run_bounded(activity, arg, budget=self._budget, summary=summary), summary
        )

    async def _read(self, attempt: Callable[[], Awaitable[ResultT]], summary: str) -> ResultT:
        """Run a read-only activity until it answers.

        A read is safe to repeat, so one slow pass of the world (its retry budget spent on timeouts,
        ``timed_out``) never stops the step: the read is tried again with backoff (``max_interval_s``
        doubling to ``READ_BACKOFF_CAP_S``) until ``read_patience_s`` have passed since it first started;
        only then is an operator asked, with the world's error and how long the read has been failing.
        A read the world refuses (403, 404, a bad answer) asks at once, as an effect does. Workflows that
        started before this replay their immediate ask (patch).
        """
        started = self.now()
        backoff = self._budget.max_interval_s
        waiting_said = False
        while True:
            try:
                return await attempt()
            except ActivityError as err:
                error = describe_failure(err)
                waited = self.now() - started
                patient = workflow.patched("reads-outwait-a-slow-world")
                if patient and is_cancellation(err):
                    raise
                if patient and timed_out(err) and waited + backoff <= self._budget.read_patience_s:
                    if not waiting_said:
                        waiting_said = True
                        self.decide(
                            f"{summary}: could not read ({error}); reading again with backoff for up to "
                            f"{self._budget.read_patience_s:.0f} s before asking an operator"
                        )
                    await workflow.sleep(backoff, summary=f"{summary}: read again"[:190])
                    backoff = min(READ_BACKOFF_CAP_S, 2 * backoff)
                    continue
                if patient and timed_out(err):
                    error = f"{error} (failing for {waited:.0f} s)"
                await self.escalate(Refusal(step="observe", what=summary, error=error, can_skip=False))
                started, backoff, waiting_said = self.now(), self._budget.max_interval_s, False

    async def read_enough(
        self,
        look: Callable[[], Awaitable[ResultT]],
        partial: Callable[[ResultT, float], PartialLook],
        *,
        what: str,
        step: str,
    ) -> ResultT:
        """Look until enough of the engines a step needs answered (``partial`` judges, with the seconds
        waited: ``fleet.observation.judge_partial_look``), then return that look.

        A partial look proceeds (the step decides on what it read and the record names the rest); a look
        where nothing needed was read is taken again with backoff for the budget's ``read_patience_s``;
        past that an operator is asked - ``retry`` (look again), ``skip`` (decide on the look as it is) or
        ``abort`` - with every unread engine and why.
        """
        started = self.now()
        backoff = self._budget.max_interval_s
        seen = await look()
        looked_again = False
        while True:
            judged = partial(seen, self.now() - started)
            if judged.verdict is LookVerdict.PROCEED:
                if judged.unread or looked_again:
                    self.decide(judged.reason, {"unread": judged.unread, "read": list(judged.read)})
                return seen
            if not workflow.patched("partial-looks"):
                return seen  # a recovery that started before this decided on the look as it was
            if judged.verdict is LookVerdict.LOOK_AGAIN:
                if not looked_again:
                    self.decide(judged.reason, {"unread": judged.unread})
                looked_again = True
                await workflow.sleep(backoff, summary=f"{what}: look again"[:190])
                backoff = min(READ_BACKOFF_CAP_S, 2 * backoff)
            else:
                refusal = Refusal(step=step, what=what, error=judged.reason)
                if await self.escalate(refusal) == "skip":
                    return seen
                started, backoff = self.now(), self._budget.max_interval_s
            seen = await look()

    async def observe_pool(
        self,
        pool: PoolRef,
        summary: str,
        *,
        check_progress_of: Iterable[str] = (),
        focus_nodes: Iterable[str] = (),
        focus_pods: Iterable[str] = (),
        light: bool = False,
    ) -> PoolObservation:
        """One look at a pool: its workloads, pods, EndpointSlices, the gateway and the engines."""
        return await self.observe(
            ObserveActivities.observe_pool,
            ObserveRequest(
                pool=pool,
                check_progress_of=sorted(check_progress_of),
                focus_nodes=sorted(focus_nodes),
                focus_pods=sorted(focus_pods),
                light=light,
            ),
            summary,
        )

    async def deroute(
        self, pool: PoolRef, pods: list[str], label: str, *, step: str, why: str, timeout_s: float
    ) -> DerouteSeen | None:
        """Remove the router-only label from ``pods``, then wait until the router no longer routes to them.

        Returns when that was first seen (None in dry-run). A router that keeps routing
        to them past ``timeout_s`` is escalated (retry the wait, skip, or abort).
        """
        for pod in pods:
            await self.act(
                ActActivities.patch_pod_metadata,
                PodLabelsChange(step=step, namespace=pool.namespace, pod=pod, labels={label: None}),
                f"{why}: remove router-only label {label} from {pod}",
            )
        return await self.await_out_of_routing(pool, pods, timeout_s=timeout_s)

    async def await_out_of_routing(
        self, pool: PoolRef, pods: list[str], *, timeout_s: float
    ) -> DerouteSeen | None:
        if self._dry_run or not pods:
            return None
        while True:
            seen = await self.observe(
                ObserveActivities.await_derouted,
                DerouteWait(pool=pool, pods=sorted(pods), timeout_s=timeout_s),
                "wait until the router no longer routes to them",
                timeout_s=timeout_s + 30,
                heartbeat_s=10,
            )
            if not seen.still_routed:
                return seen
            refusal = Refusal(
                step="await-out-of-routing",
                what=f"take {', '.join(seen.still_routed)} out of routing",
                error=f"still routed {timeout_s:.0f} s after derouting: the router follows neither the "
                "router-only label nor EndpointSlice readiness - check its configuration",
            )
            if await self.escalate(refusal) == "skip":
                return seen

    async def route(
        self, pool: PoolRef, pods: Iterable[str], label: str, value: str, *, step: str, why: str
    ) -> None:
        """Add the router-only label to ``pods`` (nothing else about them changes: a role label may be a selector)."""
        for pod in pods:
            await self.act(
                ActActivities.patch_pod_metadata,
                PodLabelsChange(step=step, namespace=pool.namespace, pod=pod, labels={label: value}),
                f"{why}: route to {pod} ({label}={value})",
            )

    async def annotate(
        self, pool: PoolRef, pod: str, annotations: dict[str, str | None], *, step: str, why: str
    ) -> None:
        await self.act(
            ActActivities.patch_pod_metadata,
            PodLabelsChange(step=step, namespace=pool.namespace, pod=pod, annotations=annotations),
            why,
        )

    async def mark_removed_first(self, pool: PoolRef, pods: Iterable[str], *, step: str, why: str) -> None:
        """Pod-deletion-cost on ``pods`` before their workload scales down: its ReplicaSet removes them first."""
        for pod in pods:
            await self.annotate(
                pool,
                pod,
                {POD_DELETION_COST_ANNOTATION: REMOVE_FIRST_DELETION_COST},
                step=step,
                why=f"{why}: pod-deletion-cost {REMOVE_FIRST_DELETION_COST} on {pod} (removed first)",
            )

    # ================================================================ asking an operator

    async def escalate(self, refusal: Refusal) -> str:
        """Stop in ``awaiting-operator`` until ``retry`` / ``skip`` / ``abort``; returns "retry" or "skip"."""
        async with self._escalation:
            return await self._escalate(refusal)

    async def _escalate(self, refusal: Refusal) -> str:
        self._refusals += 1
        self.figure("refusals", self._refusals)
        status = self._status
        status.refusal = refusal
        answers = "`retry`, `skip` (with a reason) or `abort`" if refusal.can_skip else "`retry` or `abort`"
        what = f"{refusal.what} failed: {refusal.error}"
        self.decide(f"stopped: {what}; asking an operator ({answers})", {"refusal": refusal.model_dump()})
        previous = status.phase
        status.awaiting = f"{what} — answer with {answers}"
        self._answer = None
        await self.enter(Phase.AWAITING_OPERATOR, f"**Refused:** {what}\n\nAnswer with {answers}.")
        await self.notify(
            f"refusal-{self._refusals}",
            f"[fleetmend] {status.pool.key}: {what}. The procedure stopped and waits for an operator: "
            f"{answers} (`fleetmend retry|skip|abort {status.workflow}`).",
        )
        try:
            await self._wait_for_operator(lambda: self._answer is not None, what)
        finally:
            status.awaiting = None
            status.refusal = None
        answer = self._answer
        assert answer is not None
        choice, action = answer
        if choice == "skip":
            self.decide(
                f"skipped by {action.operator}: {refusal.what} ({action.reason}); going on without it",
                {"skipped": refusal.model_dump()},
            )
        else:
            self.decide(f"retry requested by {action.operator}: {refusal.what}")
        await self.enter(previous, f"{choice} by {action.operator}: {refusal.what}")
        return choice

    async def await_operator(self, what: str, timeout_s: float | None = None) -> OperatorAction | None:
        """An approval gate: ``awaiting-operator`` until ``approve``; back to the previous phase.

        With ``timeout_s``, returns None when nobody answered in time (the procedure says what
        silence means); without, it waits as long as it takes, reminding the channel on a backed-off,
        bounded schedule (``_wait_for_operator``: at most ``OPERATOR_WAIT_EVENTS_MAX`` events). Raises
        ``Aborted`` when an operator aborted instead.
        """
        self._awaiting = what
        self._approval = None
        status = self._status
        status.awaiting = what
        previous = status.phase
        await self.enter(Phase.AWAITING_OPERATOR, f"**Awaiting operator**: {what} — use the `approve` Update")
        await self.notify(
            f"approval-{len(status.decisions)}", f"[fleetmend] {status.pool.key}: operator needed — {what}"
        )
        try:
            answered = await self._wait_for_operator(lambda: self._approval is not None, what, timeout_s)
        finally:
            self._awaiting = None
            status.awaiting = None
        if not answered:
            return None
        approval = self._approval
        assert approval is not None
        await self.enter(previous, f"approved: {what}")
        return approval

    async def await_release(self, what: str, released: Callable[[], bool], *, quiet: bool = False) -> None:
        """Hold in ``awaiting-operator`` until ``released()`` (a decision made elsewhere: the removal
        breaker's reset), saying so in the status, the UI and the channel; back to the previous phase.
        ``quiet``: the one who holds it tells the channel, once for every holder (the breaker's trip post),
        so this procedure posts nothing: a storm of held fences is one message, not hundreds.
        Raises ``Aborted`` when an operator aborts instead."""
        status = self._status
        previous = status.phase
        status.awaiting = what
        await self.enter(Phase.AWAITING_OPERATOR, f"**Held**: {what}")
        if not quiet:
            await self.notify(
                f"held-{len(status.decisions)}", f"[fleetmend] {status.pool.key}: held — {what}"
            )
        try:
            if quiet:
                await workflow.wait_condition(lambda: released() or self._abort is not None)
                if self._abort is not None:
                    raise Aborted()
            else:
                await self._wait_for_operator(released, what)
        finally:
            status.awaiting = None
        await self.enter(previous, f"released: {what}")

    async def _wait_for_operator(
        self, answered: Callable[[], bool], what: str, timeout_s: float | None = None
    ) -> bool:
        """Wait for ``answered()`` (or an abort), reminding the incident channel on a backed-off schedule.

        The first reminder comes after ``operator_wait_s``; each next one twice as long after the last,
        up to ``REMINDER_INTERVAL_CAP_S`` apart, and after ``REMINDERS_MAX`` reminders the wait goes on
        silent (the phase, ``fleetmend status`` and the UI still say who is awaited). A reminder is one
        timer and one notify activity, so a wait of any length adds at most ``OPERATOR_WAIT_EVENTS_MAX``
        history events: a day's wait no longer grows the recovery's history with every chunk.
        Workflows that started before the back-off replay the fixed chunk they ran with (patch).
        """
        waited = 0.0
        interval = self._operator_wait_s
        reminders = 0
        backs_off: bool | None = None  # asked at the first reminder, where the two schedules part
        while True:
            if backs_off and reminders >= REMINDERS_MAX:
                chunk: float | None = None if timeout_s is None else timeout_s - waited
            else:
                chunk = interval if timeout_s is None else min(interval, timeout_s - waited)
            try:
                await workflow.wait_condition(
                    lambda: answered() or self._abort is not None,
                    timeout=None if chunk is None else timedelta(seconds=max(chunk, 0.001)),
                    timeout_summary=f"operator: {what}"[:190],
                )
            except TimeoutError:
                assert chunk is not None
                waited += chunk
                if timeout_s is not None and waited >= timeout_s:
                    return False
                if backs_off is None:
                    backs_off = workflow.patched("operator-reminders-back-off")
                reminders += 1
                last = backs_off and reminders >= REMINDERS_MAX
                await self.notify(
                    f"reminder-{len(self._status.decisions)}",
                    f"[fleetmend] {self._status.pool.key}: still waiting for an operator ({waited:.0f} s): {what}"
                    + (" (last reminder: the procedure keeps waiting)" if last else ""),
                )
                self.decide(f"still waiting for an operator after {waited:.0f} s: {what}")
                if backs_off:
                    interval = min(2 * interval, max(self._operator_wait_s, REMINDER_INTERVAL_CAP_S))
                continue
            if self._abort is not None:
                raise Aborted()
            return True

    # ================================================================ phases and the record

    def finish(self, phase: Phase) -> ProcedureStatus:
        status = self._status
        now = self.now()
        if status.phases and status.phases[-1].end is None:
            status.phases[-1].end = now
        status.phases.append(PhaseSpan(name=phase, start=now, end=now))
        self.set_phase(phase)
        self.set_details(f"**{phase.value}** — {status.decisions[-1].summary if status.decisions else ''}")
        return status

    async def enter(self, phase: Phase, details: str) -> None:
        await self.checkpoint()
        status = self._status
        now = self.now()
        if status.phases and status.phases[-1].end is None:
            status.phases[-1].end = now
        status.phases.append(PhaseSpan(name=phase, start=now))
        self.set_phase(phase)
        self.set_details(f"**Phase:** {phase.value}\n\n{details}")
        await self.on_phase_entered(phase)

    async def on_phase_entered(self, phase: Phase) -> None:
        """Hook run at every step boundary (after the phase is recorded)."""

    async def checkpoint(self) -> None:
        if self._abort is not None:
            raise Aborted()
        if self._paused:
            self.set_details("**Paused** by an operator — use the `resume` Update")
            await workflow.wait_condition(lambda: not self._paused or self._abort is not None)
            if self._abort is not None:
                raise Aborted()
