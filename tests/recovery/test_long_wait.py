"""A real recovery waiting a day on an operator keeps its history under a stated bound.

The router-label-selected world: the router's label is a controller selector, so the recovery
cannot deroute the wedged pod by relabelling it and asks an operator to approve a force-delete
(step 2, before the admission keeper starts: the operator wait is all that runs). The
time-skipping dev server (DESIGN.md §6b) fast-forwards that recovery's own clock by 24 hours
while it waits; then the operator approves and the recovery completes against the simulated
fleet as usual. The bound is ``OPERATOR_WAIT_EVENTS_MAX`` (``workflows/procedure.py``): the
reminders back off and stop, the wait is one timer. Before the back-off, this day added one
reminder (a timer and a notify activity, 11 events) every ``approval_timeout_s`` (120 s here):
720 reminders, about 7 900 events.
"""

from __future__ import annotations

import asyncio
import itertools
from datetime import timedelta
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from fleet.recovery import OperatorAction, Phase
from fleet.vocabulary import FaultKind
from tests.support import (
    FAST,
    POOL,
    decisions,
    execute_update,
    finish,
    fleetmend_actions,
    incident_config,
    load_reaches,
    pod_report,
    wait_for_child,
    wait_for_phase,
)
from worker.devstack.rig import compressed_scenario, fleet_rig
from workflows.procedure import OPERATOR_WAIT_EVENTS_MAX, REMINDERS_MAX

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

A_DAY = timedelta(hours=24)


# Events the time-skipping server itself writes (one per skipped timer, and the fast-forward's option
# change): a production history has none of them.
TIME_SKIPPING_EVENTS = {
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIME_SKIPPING_TRANSITIONED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_OPTIONS_UPDATED,
}


async def history_length(handle: WorkflowHandle[Any, Any]) -> tuple[int, int]:
    """The history's length, and how many of its events the workflow wrote (without the time skipper's)."""
    events = [e async for e in handle.fetch_history_events()]
    return len(events), len([e for e in events if e.event_type not in TIME_SKIPPING_EVENTS])


async def settled_wait(handle: WorkflowHandle[Any, Any]) -> int:
    """The history's length once the wait is in place: the ask's notify done, the reminder timer started.

    The phase reads ``awaiting-operator`` before the ask's own notify activity has run; counting from
    there would charge that notify (6 events) to the day of waiting.
    """
    while True:
        events = [e async for e in handle.fetch_history_events()]
        described = await handle.describe()
        if (
            events[-1].event_type == EventType.EVENT_TYPE_TIMER_STARTED
            and not described.raw_description.pending_activities
        ):
            return len([e for e in events if e.event_type not in TIME_SKIPPING_EVENTS])
        await asyncio.sleep(0.1)


async def test_a_day_waiting_for_an_operator_adds_a_bounded_history_and_the_recovery_then_completes(
    time_skipping_env: WorkflowEnvironment, task_queue: str, ledger_url: str
) -> None:
    env = time_skipping_env
    async with fleet_rig(
        env.client,
        scenario=compressed_scenario("router-label-selected"),
        database_url=ledger_url,
        task_queue=task_queue,
    ) as rig:
        while len(await rig.routing_set(POOL)) < 2:  # the pool serves before the loss
            await asyncio.sleep(0.3)
        pod = (await rig.routing_set(POOL))[0]
        await rig.start_load(rate=30, duration_s=90, seed=6)
        await load_reaches(rig)
        await rig.inject(FaultKind.WEDGED_ENGINE, f"inference/{pod}")
        # Requests pile up on it: without any in flight the engine only looks slow, not wedged.
        await load_reaches(rig, pods=[pod], in_flight=True)
        # The incident and its recovery run on wall-clock time; only the day of waiting is skipped.
        with env.with_time_skipping_disabled():
            incident = await rig.report_loss(pod_report(pod, "fp-wedged"), incident_config())
        recovery = await wait_for_child(env.client, incident)
        waiting = await wait_for_phase(recovery, Phase.AWAITING_OPERATOR)
        assert waiting.awaiting and "force-delete" in waiting.awaiting
        before = await settled_wait(recovery)

        assert await env.fast_forward(recovery, A_DAY), "the recovery's clock did not reach a day later"

        total, after = await history_length(recovery)
        status = await wait_for_phase(recovery, Phase.AWAITING_OPERATOR)
        reminders = [d for d in status.decisions if d.summary.startswith("still waiting for an operator")]
        print(
            f"\nrecovery history: {before} events when the wait began, {after} after 24 h "
            f"(+{after - before}; bound +{OPERATOR_WAIT_EVENTS_MAX}; {total} with the time skipper's own "
            f"events); {len(reminders)} reminders, "
            f"the last after {reminders[-1].summary.split('after ')[1].split(' s')[0] if reminders else '-'} s"
        )
        assert after - before <= OPERATOR_WAIT_EVENTS_MAX, decisions(status)
        # The channel was reminded, on a backed-off schedule, and then left alone.
        assert len(reminders) == REMINDERS_MAX, decisions(status)
        gaps = [b.at - a.at for a, b in itertools.pairwise(reminders)]
        assert all(later >= 1.9 * earlier for earlier, later in itertools.pairwise(gaps)), gaps
        assert reminders[0].at - status.phases[-1].start >= FAST.approval_timeout_s - 1
        # Still nothing done to the pod while nobody answered.
        assert not [a for a in await fleetmend_actions(rig) if f"/pods/{pod}" in a["path"]]

        await execute_update(
            recovery,
            "approve",
            OperatorAction(operator="alice", reason="back after a day: pod wedged, delete it"),
        )
        done = await finish(recovery)
        assert done.phase == Phase.DONE, decisions(done)
        deletes = [
            a
            for a in await fleetmend_actions(rig)
            if a["verb"] == "DELETE" and a["path"].endswith(f"/pods/{pod}")
        ]
        assert len(deletes) == 1, decisions(done)
