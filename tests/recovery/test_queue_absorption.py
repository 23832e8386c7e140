"""One rank of a two-group pool lost under load, no spare: the survivor's queue absorbs part of the
gap first, and the admission keeper follows the queue and the counted arrivals from then on (never
refusing past the gap)."""

from __future__ import annotations

import pytest
from temporalio.client import Client

from fleet.vocabulary import FaultKind
from tests.support import (
    RANK_POOL,
    decisions,
    finish,
    incident_config,
    load_reaches,
    pod_report,
    rank_pool,
    wait_for_child,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_the_survivors_queue_absorbs_first_and_the_keeper_follows_it(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    pool = RANK_POOL
    async with rank_pool(temporal_client, task_queue, ledger_url) as rig:
        leaders = await rig.routing_set(pool)
        assert len(leaders) == 2, leaders
        # ~80 % of the two groups: one survivor cannot carry it while its LeaderWorkerSet re-creates the other.
        load = await rig.start_load(rate=24, duration_s=60, seed=12, model=None, pool=pool.key)
        await load_reaches(rig, pool)
        worker_pod = f"{leaders[0]}-1"
        await rig.inject(FaultKind.RANK_LOST, f"inference/{worker_pod}")
        report = pod_report(worker_pod, "fp-absorb", alert="FleetmendRankLost", pool=pool)
        incident = await rig.report_loss(report, incident_config(pool, queue_wait_budget_s=1.0))
        status = await finish(await wait_for_child(temporal_client, incident))
        text_ = decisions(status)
        assert status.figures["groups_lost"] == 1, text_

        levels = status.figures["shed_levels"]
        first = levels[0]
        # At protect the survivor's queue was nearly empty: it absorbed part of the gap at least.
        assert first["gap"] > 0 and first["refused"] < first["gap"], levels
        assert "within the 1 s wait budget" in text_, text_
        # The keeper re-read the queue and the gateway's count and re-admitted, never refusing past the gap.
        assert "queues re-read" in text_ and "counted by the gateway over" in text_, text_
        assert any(lv["refused"] != first["refused"] for lv in levels[1:-1]), levels
        assert all(lv["refused"] <= lv["gap"] + 1e-3 for lv in levels), levels
        assert levels[-1]["refused"] == 0 and status.figures.get("shedding_lifted") is True, levels
        # Every refusal the users got was Envoy's shed answer with a Retry-After.
        users = await rig.load_report(load)
        assert users["shed"] > 0, users
        assert users["shed"] == users["shed_with_retry_after"], users
