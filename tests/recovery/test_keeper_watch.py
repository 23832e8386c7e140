"""A recovery that asks an operator after step 3 keeps its admission with one watch, not a look per interval.

The gpu-node-loss world under load: the node dies, the recovery deroutes and starts shedding
(step 3), and its promotion of the warm spare is refused (422, an admission policy), so it waits
for an operator with the admission keeper running. While it waits, the keeper's looks run inside
one ``watch_admission`` activity that returns only when admission would move (or after
``admission_watch_s``): the history grows by ``WATCH_EVENTS_MAX`` events per watch and by each
admission change, not by a timer and an activity per look (11 events each). With
``admission_watch_s`` compressed from an hour to 6 s, the test lets four such "hours" pass, asserts
the history grew only by those watches and the admission changes, and that the looks (several per
watch) added nothing; then it fixes the policy and retries: the running watch is cancelled and the
recovery completes.
Real Temporal, real Postgres, real Envoy, the simulated fleet.
"""

from __future__ import annotations

import time
from datetime import UTC
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowHandle

from fleet.recovery import OperatorAction, Phase
from fleet.vocabulary import FaultKind
from tests.support import (
    FAST,
    decisions,
    execute_update,
    finish,
    gpu_pool,
    incident_config,
    load_reaches,
    node_report,
    refused_promotion,
    until,
    wait_for_child,
    wait_for_phase,
)
from workflows.admission import WATCH_EVENTS_MAX

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# The keeper looks every 0.5 s to 1 s; each watch returns after 6 s (an hour of waiting, compressed).
TIMINGS = FAST.model_copy(
    update={"admission_interval_s": 0.5, "admission_max_interval_s": 1.0, "admission_watch_s": 6.0}
)
WATCHES = 4  # compressed hours the operator stays away
# One admission change: the set_admission activity and its workflow task (the ledger is inside the activity).
CHANGE_EVENTS_MAX = 6


async def _history(handle: WorkflowHandle[Any, Any]) -> list[HistoryEvent]:
    return [e async for e in handle.fetch_history_events()]


def _scheduled(events: list[HistoryEvent], activity: str) -> int:
    return sum(
        1
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == activity
    )


async def _watch_running_for(handle: WorkflowHandle[Any, Any]) -> float | None:
    """How long the running watch's attempt has run (s), None while no watch runs."""
    described = await handle.describe()
    for pending in described.raw_description.pending_activities:
        if pending.activity_type.name == "watch_admission" and pending.HasField("last_started_time"):
            return time.time() - pending.last_started_time.ToDatetime(UTC).timestamp()
    return None


async def _watched(client: Client, events: list[HistoryEvent]) -> list[dict[str, Any]]:
    """What each watch that ended in ``events`` returned (``AdmissionWatched``: moved, looks, ...)."""
    scheduled = {
        e.event_id
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == "watch_admission"
    }
    out: list[dict[str, Any]] = []
    for e in events:
        done = e.activity_task_completed_event_attributes
        if (
            e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
            and done.scheduled_event_id in scheduled
        ):
            [result] = await client.data_converter.decode(done.result.payloads)
            out.append(result)
    return out


async def test_an_operator_wait_after_step_3_adds_watches_not_looks_and_the_retry_completes(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url) as rig:
        await rig.refuse(refused_promotion("422"))
        await rig.start_load(rate=30, duration_s=200, seed=11)
        await load_reaches(rig)
        await rig.inject(FaultKind.NODE_LOST, "gpu-node-0")
        incident = await rig.report_loss(
            node_report("gpu-node-0", fingerprint="fp-watch"), incident_config(timings=TIMINGS)
        )
        recovery = await wait_for_child(temporal_client, incident)
        waiting = await wait_for_phase(recovery, Phase.AWAITING_OPERATOR, timeout_s=120)
        assert waiting.refusal is not None and waiting.refusal.what.startswith("promote spare"), decisions(
            waiting
        )

        async def ended_watches() -> list[dict[str, Any]]:
            return await _watched(temporal_client, await _history(recovery))

        await until(
            ended_watches,
            bool,
            lambda _: "no admission watch ended while the operator is asked",
            timeout_s=60,
        )
        before = await _history(recovery)
        since = len(await _watched(temporal_client, before))
        await until(
            ended_watches,
            lambda ended: len(ended) - since >= WATCHES,
            lambda ended: f"{len(ended or []) - since} admission watch(es) ended, not {WATCHES}",
            timeout_s=120,
        )
        after = await _history(recovery)
        added = after[len(before) :]
        ended = await _watched(temporal_client, added)
        looks = sum(int(w["looks"]) for w in ended)
        changes = _scheduled(added, "set_admission")
        bound = WATCH_EVENTS_MAX * (len(ended) + 1) + CHANGE_EVENTS_MAX * changes
        print(
            f"\noperator wait after step 3: {len(ended)} watches ({TIMINGS.admission_watch_s:g} s each, an hour "
            f"compressed) took {looks} looks; history +{len(added)} events, {changes} admission change(s) "
            f"(bound {bound}); a timer and an activity per look would have added about {11 * looks}"
        )
        assert len(added) <= bound, [e.event_type for e in added]
        # The looks ran inside the watches: several per watch, none of them in the history.
        assert looks >= 2 * len(ended), ended
        # A watch that did not move admission ran its whole period.
        assert [w for w in ended if not w["moved"]], ended
        status = await wait_for_phase(recovery, Phase.AWAITING_OPERATOR)
        assert status.figures.get("shed_levels"), decisions(status)  # the keeper kept admission

        # The operator answers while a watch has just started (seconds left to run): the answer cancels it.
        await until(
            lambda: _watch_running_for(recovery),
            lambda seconds: seconds is not None and seconds < 1.5,
            lambda seconds: f"no freshly started admission watch (the running one for {seconds} s)",
            timeout_s=30,
            interval_s=0.1,
        )
        await rig.refuse()  # the admission policy fixed
        await execute_update(recovery, "retry", OperatorAction(operator="alice", reason="policy fixed"))
        done = await finish(recovery, timeout_s=200)
        assert done.phase == Phase.DONE, decisions(done)
        assert done.verification is not None and done.verification.passed, decisions(done)
        history = await _history(recovery)
        cancelled = [
            e for e in history if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED
        ]
        assert cancelled, "the operator's answer did not cancel the admission watch"
