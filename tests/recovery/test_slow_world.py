"""A slow world delays a recovery, never stops it: the survivors' /metrics answer too late (the
simulator's slow-metrics fault: an engine's API server too busy for its scrapes) while a node is lost.
Real Temporal, real Postgres, the simulated fleet over HTTP, a real worker."""

from __future__ import annotations

import asyncio
import time

import pytest
from temporalio.client import Client, WorkflowHandle

from fleet.recovery import OperatorAction, Phase, ProcedureStatus
from fleet.vocabulary import FaultKind
from tests.support import (
    FAST,
    POOL,
    decisions,
    execute_update,
    finish,
    gpu_pool,
    incident_config,
    load_reaches,
    node_report,
    status_of,
    wait_for_child,
    wait_for_phase,
)
from worker.devstack.rig import FleetRig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LOST_NODE = "gpu-node-0"


async def _survivors(rig: FleetRig) -> list[str]:
    """The routed replicas that are not on the node about to be lost."""
    pods = (await asyncio.to_thread(rig.core.list_namespaced_pod, POOL.namespace)).items
    node_of = {p.metadata.name: p.spec.node_name for p in pods}
    return [p for p in await rig.routing_set(POOL) if node_of.get(p) != LOST_NODE]


async def _slow_scrapes(rig: FleetRig, pods: list[str], *, clear: bool = False) -> None:
    for pod in pods:
        params = {"clear": True} if clear else {"delay_s": 60}
        await rig.inject(FaultKind.SLOW_METRICS, f"{POOL.namespace}/{pod}", **params)


async def _said(handle: WorkflowHandle[object, object], text: str, timeout_s: float = 90) -> ProcedureStatus:
    """The recovery's status once one of its decisions says ``text``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await status_of(handle)
        if any(text in d.summary for d in status.decisions):
            return status
        if time.monotonic() > deadline or status.phase in (Phase.DONE, Phase.ABORTED):
            raise AssertionError(f"never said {text!r}:\n{decisions(status)}")
        await asyncio.sleep(0.3)


async def test_survivors_scrapes_timing_out_delay_the_recovery_and_it_completes_on_those_read_without_an_operator(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url) as rig:
        survivors = await _survivors(rig)
        await rig.start_load(rate=40, duration_s=90, seed=7)
        await load_reaches(rig)
        await _slow_scrapes(rig, survivors)
        await rig.inject(FaultKind.NODE_LOST, LOST_NODE)
        incident = await rig.report_loss(node_report(LOST_NODE), incident_config())
        child = await wait_for_child(temporal_client, incident)
        waiting = await _said(child, "looking again")
        assert "the survivors' load: none of" in decisions(waiting)
        assert "GET /metrics answered nothing within" in decisions(waiting), decisions(waiting)
        # The world catches up, but for one survivor, which stays too slow to the end: the step decides on
        # the two it reads and names the third, counted neither idle nor dead.
        still_slow, caught_up = survivors[0], survivors[1:]
        await _slow_scrapes(rig, caught_up, clear=True)
        status = await finish(child)
        text_ = decisions(status)
        assert status.phase == Phase.DONE, text_
        assert f"the survivors' load: deciding on the {len(caught_up)} of {len(survivors)} read" in text_, (
            text_
        )
        assert f"1 not read: {still_slow}" in text_, text_  # the shedding arithmetic names it
        assert all(p.name is not Phase.AWAITING_OPERATOR for p in status.phases), text_
        assert status.figures.get("refusals", 0) == 0, text_


async def test_scrapes_that_never_answer_ask_an_operator_with_the_reason_then_retry_completes(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    patience = FAST.retry.model_copy(update={"read_patience_s": 6.0})
    timings = FAST.model_copy(update={"retry": patience})
    async with gpu_pool(temporal_client, task_queue, ledger_url) as rig:
        survivors = await _survivors(rig)
        await rig.start_load(rate=40, duration_s=90, seed=7)
        await load_reaches(rig)
        await _slow_scrapes(rig, survivors)
        await rig.inject(FaultKind.NODE_LOST, LOST_NODE)
        incident = await rig.report_loss(node_report(LOST_NODE), incident_config(timings=timings))
        child = await wait_for_child(temporal_client, incident)
        asking = await wait_for_phase(child, Phase.AWAITING_OPERATOR, timeout_s=90)
        refusal = asking.refusal
        assert refusal is not None and refusal.step == "survivors", decisions(asking)
        assert refusal.what == "read the survivors' load", refusal
        assert f"none of {len(survivors)} read in" in refusal.error, refusal.error
        assert all(p in refusal.error for p in survivors), refusal.error  # every unread survivor named
        assert "GET /metrics answered nothing within" in refusal.error, refusal.error
        assert asking.awaiting is not None and "read the survivors' load failed" in asking.awaiting
        await _slow_scrapes(rig, survivors, clear=True)
        await execute_update(child, "retry", OperatorAction(operator="bob", reason="engines answer again"))
        status = await finish(child)
        assert status.phase == Phase.DONE, decisions(status)
