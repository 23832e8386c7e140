"""What the removal breaker asks before it counts a node as dead: are its engines answering? A node that
holds only worker ranks of multi-node groups runs no API server of its own; it serves while each rank's
group leader answers. The probe reads the leader for a rank, so such a node is serving capacity, not
dead capacity that would be cordoned without asking. The simulated fleet over HTTP, the real activity,
no worker."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import Client

from activities.deps import ActivityDeps
from activities.observe import ObserveActivities
from fleet.vocabulary import LWS_WORKER_INDEX_LABEL
from ledger.store import EffectLedger
from tests.support import RANK_POOL, rank_pool
from worker.registry import activity_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_a_node_of_worker_ranks_serves_while_their_leaders_answer(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with rank_pool(temporal_client, task_queue, ledger_url, run_worker=False) as rig:
        pods = (await asyncio.to_thread(rig.core.list_namespaced_pod, RANK_POOL.namespace)).items
        ranks_by_node: dict[str, list[str]] = {}
        for pod in pods:
            index = (pod.metadata.labels or {}).get(LWS_WORKER_INDEX_LABEL)
            if index is not None and pod.spec.node_name:
                ranks_by_node.setdefault(pod.spec.node_name, []).append(index)
        workers_only = sorted(n for n, idx in ranks_by_node.items() if "0" not in idx)
        assert workers_only, f"no node holds only worker ranks: {ranks_by_node}"
        ledger = EffectLedger(ledger_url)
        try:
            deps = ActivityDeps(settings=activity_config(rig.settings), ledger=ledger)
            probe = ObserveActivities(deps).probe_node_engines
            for node in workers_only:
                seen = await asyncio.to_thread(probe, node)
                assert seen.engines > 0 and seen.answering == seen.engines and seen.unread == 0, seen
        finally:
            ledger.close()
