"""``RemovalBreaker``: the fleet's one removal breaker (``fleet.breaker``), as a long-lived workflow.

Procedures ask it (the ``ask`` Update, sent by the ``ask_breaker`` activity as an Update-With-Start)
before they remove capacity whose engines still answer; dead capacity never asks. Its answers are
decided one Update at a time inside this workflow, so its count is exact however many procedures ask
at once, and it survives any worker's crash. An operator resets a tripped breaker with the ``reset``
Update (a reason is required, like every operator action); each held procedure is then signalled
(``breaker_reset``) to read the world again and decide anew. The current state is the ``status``
query (``fleetmend breaker status``) and the workflow's current details in the Temporal UI. A trip and
a reset are each posted once to the incident channel through the ledger (its ``notify`` effect, op id
``fleetmend:breaker/removals/<task queue>@<first run>/breaker/<trip-N|reset-N>``), so the ledger records both.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.act import ActActivities, NotifyRequest
    from fleet import breaker
    from fleet.breaker import BreakerDecision, BreakerInput, BreakerState, BreakerStatus, RemovalRequest
    from fleet.recovery import OperatorAction, RetryBudget
    from workflows.procedure import run_bounded

RELEASE_SIGNAL = "breaker_reset"


@workflow.defn(name="RemovalBreaker")
class RemovalBreaker:
    """Count, grant or hold removals of serving capacity; release the held on an operator's reset."""

    @workflow.init
    def __init__(self, inp: BreakerInput) -> None:
        self._state: BreakerState = inp.state or BreakerState()
        self._releases: list[str] = []
        self._posts: list[tuple[str, str]] = []  # (topic, text) for the incident channel
        self._last_cap: int | None = None

    @workflow.run
    async def run(self, inp: BreakerInput) -> None:
        while True:
            await workflow.wait_condition(
                lambda: bool(self._releases or self._posts) or workflow.info().is_continue_as_new_suggested()
            )
            posts, self._posts = self._posts, []
            for topic, text in posts:
                await self._post(topic, text)
            released, self._releases = self._releases, []
            for requester in released:
                try:
                    await workflow.get_external_workflow_handle(requester).signal(RELEASE_SIGNAL)
                except Exception as err:  # it ended meanwhile (aborted, finished): nothing to release
                    workflow.logger.info("breaker: %s not released: %s", requester, err)
            if workflow.info().is_continue_as_new_suggested():
                await workflow.wait_condition(workflow.all_handlers_finished)
                if self._releases or self._posts:
                    continue  # a reset or a trip came in meanwhile: release and post before moving on
                workflow.continue_as_new(BreakerInput(state=self._state))

    @workflow.update(name="ask", description="May this node's still-serving capacity be removed?")
    def ask(self, req: RemovalRequest) -> BreakerDecision:
        was_tripped = self._state.trip is not None
        decision, self._state = breaker.decide(self._state, req, workflow.now().timestamp())
        self._last_cap = decision.cap
        if self._state.trip is not None and not was_tripped:
            self._posts.append(
                (
                    f"trip-{len(self._state.resets) + 1}",
                    f"[fleetmend] REMOVAL BREAKER TRIPPED: {self._state.trip.reason}. Held: {req.action} "
                    f"{req.node} ({req.answering} of {req.engines} engines there still answer), asked by "
                    f"{req.requester}. Every later removal of serving capacity is held; dead capacity is "
                    "still fenced. Once the signal is understood: `fleetmend breaker reset --reason ...`.",
                )
            )
        self._show()
        return decision

    @workflow.update(
        name="reset", description="Close a tripped breaker (with a reason); the held decide again"
    )
    def reset(self, action: OperatorAction) -> BreakerStatus:
        released, self._state = breaker.reset(
            self._state, action.operator, action.reason, workflow.now().timestamp()
        )
        self._releases += released
        self._posts.append(
            (
                f"reset-{len(self._state.resets)}",
                f"[fleetmend] removal breaker reset by {action.operator}: {action.reason}. "
                f"{len(released)} held procedure(s) read the world again and decide anew: "
                f"{', '.join(released) or 'none'}.",
            )
        )
        self._show()
        return self.status()

    @reset.validator
    def _validate_reset(self, action: OperatorAction) -> None:
        if self._state.trip is None:
            raise ValueError("the removal breaker is not tripped: nothing to reset")
        if not action.reason.strip():
            raise ValueError(
                "a reset needs a reason (say why the signal can be trusted again; it goes into the record)"
            )

    @workflow.query(name="status", description="Tripped or not, what is held, what was granted")
    def status(self) -> BreakerStatus:
        now = workflow.now().timestamp()
        return BreakerStatus(
            tripped=self._state.trip is not None,
            trip=self._state.trip,
            held=self._state.held,
            granted_in_window=[g for g in self._state.granted if now - g.at < self._state.limits.window_s],
            cap_for_last_fleet=self._last_cap,
            dead_passed=self._state.dead_passed,
            resets=self._state.resets,
        )

    def _show(self) -> None:
        s = self._state
        if s.trip is not None:
            text = f"**TRIPPED** - {s.trip.reason}\n\n{len(s.held)} request(s) held; reset with a reason."
        else:
            text = f"closed - {len(s.granted)} serving node(s) granted in the window; {s.dead_passed} dead passed"
        workflow.set_current_details(text)

    async def _post(self, topic: str, text: str) -> None:
        """One incident-channel post through the ledger; an unreachable channel is logged, never fatal."""
        info = workflow.info()
        request = NotifyRequest(
            step="breaker", topic=topic, text=text, scope=f"{info.workflow_id}@{info.first_execution_run_id}"
        )
        try:
            await run_bounded(
                ActActivities.notify, request, budget=RetryBudget(), summary=f"incident channel: {topic}"
            )
        except ActivityError as err:
            workflow.logger.warning("breaker: post %s not delivered: %s", topic, err)
