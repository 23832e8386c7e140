"""Planned scale-down figures: streams cut by a naive scale-down vs fleetmend's drain, and how long each step took.

Runs the shipped ``scale-down`` pool (8 replicas) with vLLM's default
``--shutdown-timeout=0`` under streaming load, twice on fresh simulators:

* naive: delete two streaming pods (what ``kubectl delete pod`` or a plain
  ``kubectl scale`` does) and count the streams Envoy's access log shows cut;
* fleetmend: ``PlannedScaleDown`` 8 -> 6 on a real Temporal dev server with a
  real worker and an embedded Postgres ledger.

Run:  .venv/bin/python -m bench.scale_down [--rate 16] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

from temporalio.testing import WorkflowEnvironment

from fleet.incident import PoolRef
from fleet.recovery import ProcedureStatus
from fleet.scale_down import ScaleDownInput
from ledger.migrate import upgrade_head
from ledger.scratch import acquire_server
from sim.scenario import SCENARIO_DIR, Scenario, load_scenario
from worker.devstack.rig import fleet_rig
from worker.devstack.temporal_dev import throwaway_dev_server

POOL = PoolRef(namespace="inference", service="llama")
LOAD: dict[str, Any] = {"tiers": {"standard": 1.0}, "output_tokens": [100, 300]}


def scenario() -> Scenario:
    s = load_scenario(SCENARIO_DIR / "scale-down.yaml")
    return s.model_copy(update={"models": [s.models[0].model_copy(update={"shutdown_timeout_s": 0.0})]})


async def naive(env: WorkflowEnvironment, url: str, rate: float) -> dict[str, Any]:
    async with fleet_rig(
        env.client, scenario=scenario(), database_url=url, task_queue="naive", run_worker=False
    ) as rig:
        await rig.start_load(rate=rate, duration_s=60, seed=5, **LOAD)
        await asyncio.sleep(4)
        victims = (await rig.routing_set(POOL))[:2]
        for pod in victims:
            await asyncio.to_thread(rig.core.delete_namespaced_pod, pod, POOL.namespace)
        await asyncio.sleep(2)
        return {"cut": await rig.cut_streams(POOL, victims)}


async def fleetmend(env: WorkflowEnvironment, url: str, rate: float) -> dict[str, Any]:
    queue = f"bench-{uuid.uuid4().hex[:6]}"
    async with fleet_rig(env.client, scenario=scenario(), database_url=url, task_queue=queue) as rig:
        await rig.start_load(rate=rate, duration_s=60, seed=5, **LOAD)
        await asyncio.sleep(4)
        inp = ScaleDownInput(
            pool=POOL,
            target_groups=6,
            drain_deadline_s=60,
            poll_interval_s=0.3,
            group_capacity_tokens_per_s=2400,
        )
        t0 = time.monotonic()
        handle = await env.client.start_workflow(
            "PlannedScaleDown", inp, id=f"bench-{uuid.uuid4().hex[:8]}", task_queue=queue
        )
        status = ProcedureStatus.model_validate(await handle.result())
        wall = time.monotonic() - t0
        f = status.figures
        return {
            "cut": await rig.cut_streams(POOL, f["victims"]),
            "completed": f["victim_requests_completed"],
            "stop_routing_s": f["stop_routing_seconds"],
            "drain_s": f["drain_seconds"],
            "terminate_s": f["terminate_seconds"],
            "total_s": round(wall, 1),
            "passed": bool(status.verification and status.verification.passed),
        }


async def main(rate: float, rounds: int) -> None:
    pg = acquire_server()
    url = pg.create_database("bench")
    upgrade_head(url)
    env = await throwaway_dev_server()
    try:
        print(
            f"scale-down 8 -> 6, streaming load {rate:g} req/s of 100-300 tokens, vLLM --shutdown-timeout=0"
        )
        for n in range(1, rounds + 1):
            a = await naive(env, url, rate)
            b = await fleetmend(env, url, rate)
            print(f"  round {n}: naive pod deletion cut {a['cut']:3d} stream(s)")
            print(
                f"  round {n}: fleetmend          cut {b['cut']:3d} stream(s); {b['completed']} victim requests "
                f"completed; stop routing {b['stop_routing_s']:.2f} s, drain {b['drain_s']:.1f} s, terminate "
                f"{b['terminate_s']:.1f} s, whole procedure {b['total_s']:.1f} s; verification "
                f"{'passed' if b['passed'] else 'FAILED'}"
            )
    finally:
        await env.shutdown()
        pg.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=16.0, help="arrivals per second")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(main(args.rate, args.rounds))
