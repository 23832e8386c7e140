"""A repeated inference never repeats an effect: agents' tool calls through the ledger vs straight to Jira.

The same arrivals (same seed) and the same loss, once per way of executing tool calls, in one run:
users stream completions through Envoy on the compressed ``gpu-node-loss`` pool; a share of them are
agents whose completions call 1-3 tools (a Jira ticket each) mid-stream (``sim.serving.agents``).
Once the victims hold streams, two engines are OOM-killed: their streams are cut, and each agent's
client retries its cut stream with the same ``x-request-id``, so the model emits the same tool calls
again. ``direct`` executes them straight against Jira (the baseline); ``ledger`` through fleetmend's
effect API under ``<request id>/<index>``.

Graded by the external system: Jira's own record of the issues it opened (duplicates = issues beyond
the first per tool call). The callers' view (proposed, performed, deduplicated) is printed beside it.
Run as ``python -m bench.agent_effects``; writes ``docs/agent-effects.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from fleet.incident import PoolRef
from fleet.vocabulary import FaultKind
from ledger.migrate import upgrade_head
from ledger.scratch import acquire_server
from sim.serving.agents import jira_record
from worker.devstack.rig import compressed_scenario, fleet_rig
from worker.devstack.temporal_dev import throwaway_dev_server

POOL = PoolRef(namespace="inference", service="llama")
OUT = Path(__file__).resolve().parent.parent / "docs" / "agent-effects.json"


async def one_run(through: str, *, rate: float, duration_s: float, share: float, seed: int) -> dict[str, Any]:
    pg = acquire_server()
    url = pg.create_database(f"bench_{uuid.uuid4().hex[:6]}")
    upgrade_head(url)
    env = await throwaway_dev_server()
    token = secrets.token_hex(8)
    try:
        scenario = compressed_scenario("gpu-node-loss")
        async with fleet_rig(
            env.client, scenario=scenario, database_url=url, task_queue=f"bench-{through}"
        ) as rig:
            await rig.pool_ready(POOL, 5, timeout_s=120)
            async with rig.effect_api(token) as api:
                agents = {"share": share, "tool_calls": [1, 3], "through": through, "client_retries": 1,
                          "effects_url": f"{api}/v1/effects", "effects_token": token, "jira_url": rig.base_url}  # fmt: skip
                started = time.monotonic()
                load = await rig.start_load(
                    rate=rate, duration_s=duration_s, seed=seed, output_tokens=[120, 300], agents=agents
                )
                victims = sorted(await rig.routing_set(POOL))[:2]
                # The victims hold streams once the run is a quarter in (open loop: arrivals do not wait).
                while time.monotonic() - started < duration_s / 4:
                    await asyncio.sleep(0.2)
                for pod in victims:
                    await rig.inject(FaultKind.POD_OOMKILLED, f"{POOL.namespace}/{pod}")
                report: dict[str, Any] = {}
                while True:
                    report = await rig.load_report(load)
                    if time.monotonic() - started > duration_s and report["in_flight"] == 0:
                        break
                    if time.monotonic() - started > duration_s + 600:
                        raise RuntimeError(
                            f"{report['in_flight']} request(s) still in flight 600 s after the last arrival"
                        )
                    await asyncio.sleep(0.5)
                async with httpx.AsyncClient(timeout=30) as http:
                    jira = await jira_record(http, rig.base_url)
    finally:
        await env.shutdown()
        pg.stop()
    effects = report["inference_effects"]
    return {
        "through": through,
        "requests": report["finished"],
        "goodput": report["goodput"],
        "inference_effects": {**effects, "external_duplicates": jira["duplicates"]},
        "jira": jira,
    }


async def main(rate: float, duration_s: float, share: float, seed: int) -> None:
    rows = []
    for through in ("direct", "ledger"):
        row = await one_run(through, rate=rate, duration_s=duration_s, share=share, seed=seed)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\nagents ({share:.0%} of {rate:g} req/s for {duration_s:g} s, seed {seed}), two engines OOM-killed mid-run"
    )
    print(
        f"{'through':8} {'tool calls':>10} {'performed':>9} {'deduplicated':>12} {'Jira issues':>11} {'Jira duplicates':>15}"
    )
    for r in rows:
        e = r["inference_effects"]
        print(f"{r['through']:8} {e['proposed']:>10} {e['performed']:>9} {e['deduplicated']:>12} "
              f"{r['jira']['issues']:>11} {r['jira']['duplicates']:>15}")  # fmt: skip
    OUT.write_text(
        json.dumps(
            {"rate": rate, "duration_s": duration_s, "agent_share": share, "seed": seed, "runs": rows},
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rate",
        type=float,
        default=6.0,
        help="arrivals per second (120-300 output tokens each: ~85 % of the pool)",
    )
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    parser.add_argument("--share", type=float, default=0.5, help="share of requests that are agents'")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    asyncio.run(main(args.rate, args.duration, args.share, args.seed))
