"""A recovery that asks an operator after step 3 keeps its admission with one watch, not a look per interval.

The gpu-node-loss world under load: the node dies, the recovery deroutes and starts shedding
(step 3), and its promotion of the warm spare is refused (422, an admission policy), so it waits
for an operator with the admission keeper running. While it waits, the keeper's looks run inside
one ``watch_admission`` activity that returns only when admission would move (or after
``admission_watch_s``): the history grows by ``WATCH_EVENTS_MAX`` events per watch and by each
admission change, not by a timer and an activity per look (11 events each). The test lets the
watch take 20 looks, asserts the history grew only by the watches and admission changes it
counts, then fixes the policy and retries; the watch is cancelled and the recovery completes.
Real Temporal, real Postgres, real Envoy, the simulated fleet.
"""

from __future__ import annotations

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

LOOKS = 20  # looks the watch takes while the operator is away
# The keeper looks every 0.5 s to 1 s; a watch lasts longer than the test.
TIMINGS = FAST.model_copy(
    update={"admission_interval_s": 0.5, "admission_max_interval_s": 1.0, "admission_watch_s": 600.0}
)
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


async def _watch_looks(client: Client, handle: WorkflowHandle[Any, Any]) -> int | None:
    """The running watch's look count (its last heartbeat), None while no watch runs."""
    described = await handle.describe()
    for pending in described.raw_description.pending_activities:
        if pending.activity_type.name == "watch_admission":
            if not pending.heartbeat_details.payloads:
                return 0
            [looks] = await client.data_converter.decode(pending.heartbeat_details.payloads)
            return int(looks)
    return None


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

        async def watching() -> int | None:
            return await _watch_looks(temporal_client, recovery)

        await until(
            watching,
            lambda n: n is not None,
            lambda _: "no admission watch started while the operator is asked",
            timeout_s=60,
        )
        before = await _history(recovery)
        looks = await until(
            watching,
            lambda n: n is not None and n >= LOOKS,
            lambda n: f"the admission watch took {n} look(s), not {LOOKS}",
            timeout_s=90,
        )
        assert looks is not None
        after = await _history(recovery)
        added = after[len(before) :]
        watches = _scheduled(added, "watch_admission")
        changes = _scheduled(added, "set_admission")
        bound = WATCH_EVENTS_MAX * watches + CHANGE_EVENTS_MAX * changes
        print(
            f"\noperator wait after step 3: {looks} looks in the current watch; history +{len(added)} events "
            f"({watches} new watch(es), {changes} admission change(s); bound {bound}); a timer and an activity "
            f"per look would have added about {11 * looks}"
        )
        assert len(added) <= bound, [e.event_type for e in added]
        # A watch ends on an admission change (or after admission_watch_s, longer than this test).
        assert watches <= changes, (watches, changes)
        status = await wait_for_phase(recovery, Phase.AWAITING_OPERATOR)
        assert status.figures.get("shed_levels"), decisions(status)  # the keeper kept admission

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
