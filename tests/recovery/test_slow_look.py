"""One look at a pool against a slow world: the engines that answered late are named unread, with the
reason, and the look returns within its time with the rest. The simulated fleet over HTTP, the real
activity, no worker."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import Client

from activities.deps import ActivityDeps
from activities.observe import ObserveActivities, ObserveRequest
from fleet.observation import EngineHealth
from fleet.vocabulary import FaultKind
from ledger.store import EffectLedger
from tests.support import POOL, gpu_pool
from worker.registry import activity_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_a_look_names_the_engine_too_slow_to_answer_and_reads_the_others(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url, run_worker=False) as rig:
        routed = await rig.routing_set(POOL)
        slow, others = routed[0], routed[1:]
        await rig.inject(FaultKind.SLOW_METRICS, f"{POOL.namespace}/{slow}", delay_s=60)
        ledger = EffectLedger(ledger_url)
        try:
            deps = ActivityDeps(settings=activity_config(rig.settings), ledger=ledger)
            obs = await asyncio.to_thread(ObserveActivities(deps).observe_pool, ObserveRequest(pool=POOL))
        finally:
            ledger.close()
        group_of = {g.leader_pod: g.id for g in obs.snapshot.groups}
        assert set(obs.unread_engines) == {group_of[slow]}, obs.unread_engines
        assert "GET /metrics answered nothing within" in obs.unread_engines[group_of[slow]]
        assert group_of[slow] not in obs.engines
        assert obs.pods[slow].engine_health is EngineHealth.OK  # /health answered: present, not dead
        assert {group_of[p] for p in others} <= set(obs.engines), obs.engines.keys()
