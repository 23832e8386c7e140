"""An alert storm about one entity reaches exactly one FleetIncident.

1 000 distinct notifications about the same replica group (many Prometheus
replicas / many series of one failure) arrive concurrently, and Alertmanager
re-sends groups (its retries and group_interval repeats). Checked against the
real Temporal dev server: one workflow, every distinct alert delivered into it,
and repeats absorbed by the receiver instead of growing the incident's history.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from temporalio.client import Client

from tests.support import ServedWebhook, pool_alert_labels, report_loss_signals, workflow_ids
from worker.webhook.examples import alert, notification

STORM = 1000
CONCURRENCY = 64


def storm_payloads(service: str) -> list[dict[str, Any]]:
    """One notification per exporter instance, all about replica group ``<service>-0``."""
    return [
        notification(
            [
                alert(
                    pool_alert_labels(
                        "llm",
                        service,
                        replica_group=f"{service}-0",
                        instance=f"10.0.{i // 250}.{i % 250}:9400",
                    )
                )
            ]
        )
        for i in range(STORM)
    ]


async def post_all(served: ServedWebhook, payloads: list[dict[str, Any]]) -> list[httpx.Response]:
    limit = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:

        async def one(payload: dict[str, Any]) -> httpx.Response:
            async with limit:
                return await http.post(served.url, content=json.dumps(payload).encode(), headers=served.auth)

        return await asyncio.gather(*(one(p) for p in payloads))


async def test_a_storm_of_1000_alerts_and_repeats_for_one_entity_makes_exactly_one_workflow(
    served: ServedWebhook, temporal_client: Client, service: str
) -> None:
    payloads = storm_payloads(service)
    # Alertmanager re-sends groups while the first sends are still in flight (retries, HA peers).
    concurrent_repeats = payloads[:200]
    responses = await post_all(served, payloads + concurrent_repeats)
    assert {r.status_code for r in responses} == {200}

    workflow_id = f"incident/llm/{service}"
    assert await workflow_ids(temporal_client, f'TaskQueue = "{served.settings.task_queue}"', at_least=1) == [
        workflow_id
    ]
    runs = [wf async for wf in temporal_client.list_workflows(f'WorkflowId = "{workflow_id}"')]
    assert len(runs) == 1
    signals = await report_loss_signals(temporal_client, workflow_id)
    fingerprints = {p["alerts"][0]["fingerprint"] for p in payloads}
    assert {s["fingerprint"] for s in signals} == fingerprints
    assert {s["replica_group"] for s in signals} == {f"{service}-0"}
    assert len(signals) == STORM  # concurrent repeats waited for the first delivery instead of re-signalling

    # Later repeats of the same groups (group_interval / repeat_interval): nothing new is signalled.
    repeated = await post_all(served, payloads[:300])
    assert {r.json()["delivered"][0]["delivery"] for r in repeated} == {"duplicate"}
    assert len(await report_loss_signals(temporal_client, workflow_id)) == len(signals)
    assert served.metric("fleetmend_loss_reports_deduplicated_total") >= 300
    assert served.metric(
        "fleetmend_alerts_accepted_total", alertname="PoolReplicaDown", action="start-incident"
    ) == (STORM + len(concurrent_repeats) + 300)
