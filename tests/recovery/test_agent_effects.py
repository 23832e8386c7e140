"""A repeated inference never repeats an effect, graded by the external system's own log.

Agents' completions stream tool calls (a Jira ticket each) through Envoy; two replicas die mid-stream,
the clients retry their cut streams with the same idempotency key, and the model emits the same tool
calls again. Here the baseline executes the tool calls straight against Jira; fleetmend's users go through the
effect API under ``<request id>/<index>`` (the peak demo). Jira's own record of the issues it opened
is the grade (``sim.serving.agents.jira_duplicates``)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import httpx
import pytest
from temporalio.client import Client

from fleet.vocabulary import FaultKind
from sim.serving.agents import jira_record
from tests.support import POOL, gpu_pool, load_reaches

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN = secrets.token_hex(8)
DURATION_S = 12.0


async def agents_under_a_loss(
    temporal_client: Client, task_queue: str, ledger_url: str, through: str
) -> tuple[dict[str, int], dict[str, int]]:
    """The inference_effects the callers saw, and Jira's duplicates, for one way of executing."""
    async with gpu_pool(temporal_client, task_queue, ledger_url) as rig:
        async with rig.effect_api(TOKEN) as api:
            agents = {"share": 0.6, "tool_calls": [1, 3], "through": through, "client_retries": 1,
                      "effects_url": f"{api}/v1/effects", "effects_token": TOKEN, "jira_url": rig.base_url}  # fmt: skip
            started = time.monotonic()
            load = await rig.start_load(
                rate=16, duration_s=DURATION_S, seed=11, output_tokens=[120, 300], agents=agents
            )
            victims = sorted(await rig.routing_set(POOL))[:2]
            # Until each victim holds several agents' streams at once, some of them past a tool call.
            await load_reaches(rig, pods=victims, requests=8, in_flight=True, timeout_s=60)
            for pod in victims:  # two engines die mid-stream (OOM): their streams are cut
                await rig.inject(FaultKind.POD_OOMKILLED, f"{POOL.namespace}/{pod}")
            report: dict[str, Any] = {}
            for _ in range(1500):  # arrivals end after DURATION_S; then until nothing is in flight
                report = await rig.load_report(load)
                if (
                    report["window_s"]
                    and time.monotonic() - started > DURATION_S
                    and report["in_flight"] == 0
                ):
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError(f"the users' requests did not all finish: {report}")
            async with httpx.AsyncClient(timeout=10) as http:
                jira = await jira_record(http, rig.base_url)
    return dict(report["inference_effects"]), jira


async def test_executed_directly_a_repeated_inference_opens_a_second_ticket_in_jira(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    """The baseline: the tool calls run straight against Jira, and every repeat is another ticket in
    Jira's own log. The same loss through the effect API (no duplicate in Jira's log, the repeats
    deduplicated) is the peak demo's check (``tests/demo/test_demo_scenarios.py``, scenario
    ``gpu-node-loss-peak``), and both ways side by side on one seed are ``bench.agent_effects``."""
    seen, jira = await agents_under_a_loss(temporal_client, task_queue, ledger_url, "direct")
    # The loss cut agents' streams after a tool call ran, and their clients retried them.
    assert seen["retried_after_a_tool_call"] > 0, seen
    assert jira["duplicates"] > 0, (seen, jira)
    assert seen["deduplicated"] == 0, seen  # nothing stood between the callers and Jira
