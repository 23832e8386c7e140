"""A bad health check on 60 % of a 512-node fleet: what fleetmend removes with its removal breaker, and what
the same per-node policy removes without one, in one run.

    .venv/bin/python -m bench.fleet_storm [--nodes 512] [--share 0.6] [--spread-s 30] [--out docs/fleet-storm.json]

Two fresh worlds of ``fleet-512`` (every part a process of its own, as in ``bench.fleet_scale``: the
simulator, a real Envoy configured by ``fleetmend gateway serve``, a ``fleetmend worker`` with its fast
path, the webhook, Temporal and Postgres), one after the other:

* ``breaker``: fleetmend as shipped (``FLEETMEND_REMOVAL_BREAKER`` default: in any 10 minutes at most
  max(1, 5 % of the GPU nodes) and never more than 16 nodes whose engines still answer);
* ``no-breaker``: the same fleetmend with a breaker that never trips (share 100 %, cap 100,000): the
  per-node policy "a GPU problem condition fences its node".

In each, users' load runs through Envoy to the four pools with the most routed engines on flagged nodes
(``POST /sim/v1/load``, one run per pool). After a no-fault window of ``--baseline-s``, the simulator's
``false-gpu-condition`` fault sets ``GpuXid=True`` on ``--share`` of the GPU nodes (a seeded sample),
spread over ``--spread-s`` seconds, while every GPU, DCGM series and engine stays fine. The bench then
waits until every fence has ended or waits on an operator and every pool's incident has decided, and
keeps the load running to the end of that window.

Every figure that grades fleetmend comes from the world's record:

* nodes cordoned: fleetmend's PATCHes of ``spec.unschedulable`` in the simulated API server's audit log;
* routed replicas per pool: the EndpointSlices' ready endpoints, sampled every few seconds through the
  storm; a pool below its count before the storm is reported (no signal alone may take a pool below
  it);
* goodput: the simulator's own load reports (requests completed within their deadline over requests
  finished), in the no-fault window and through the storm, per loaded pool;
* the breaker's own account (tripped, granted, held, its trip text) and the incidents' verdicts are
  fleetmend's state, read from Temporal, and printed beside the world's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from rich.table import Table
from temporalio.client import WorkflowExecutionStatus

from bench.fleet_scale import (
    TIMINGS,
    World,
    console,
    cordons,
    cpu_seconds,
    ledger_rows,
    reconcile_world,
    running_world,
    status_of,
    workflow_runs,
)
from fleet.breaker import BreakerLimits, BreakerStatus, breaker_workflow_id
from fleet.fence import fence_workflow_id
from fleet.incident import PoolRef
from fleet.recovery import Phase
from fleet.vocabulary import FaultKind
from ledger.scratch import acquire_server
from sim.control import FaultRequest

REPO = Path(__file__).resolve().parents[1]
LOADED_POOLS = 4
LOAD_RATE = 4.0  # requests per second per loaded pool (a TP=4 group serves about 15)
SAMPLE_S = 5.0
SETTLE_TIMEOUT_S = 300.0
MODES: dict[str, BreakerLimits | None] = {
    "breaker": None,  # the shipped default
    "no-breaker": BreakerLimits(fleet_share=1.0, min_nodes=100_000, max_nodes=100_000),
}
SEED = 1663  # NVSentinel #1663: the check that flagged every node of a type


def flagged_nodes(world: World, share: float) -> list[str]:
    nodes = sorted(n for rack in world.racks().values() for n in rack)
    return sorted(random.Random(SEED).sample(nodes, round(share * len(nodes))))


def served_model(world: World, pool: PoolRef) -> str:
    return next(m.served_name for m in world.scenario.models if m.name == pool.service)


def routed_per_pool(world: World) -> Counter[str]:
    return Counter(e.pool.key for e in world.endpoints())


async def sample_routed(world: World, low: dict[str, int], stop: asyncio.Event) -> int:
    """Keep each pool's lowest count of ready endpoints seen until ``stop``; returns the samples taken."""
    samples = 0
    while not stop.is_set():
        counts = await asyncio.to_thread(routed_per_pool, world)
        samples += 1
        for pool in low:
            low[pool] = min(low[pool], counts.get(pool, 0))
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_S)
        except TimeoutError:
            pass
    return samples


async def fences_settled(world: World, nodes: list[str]) -> dict[str, str]:
    """Each fence's phase (or its close status) now: of ``nodes`` ('' for one with no fence yet) and of
    every other node with a fence (a flagged node holding only pods no endpoint names, e.g. worker ranks)."""
    runs = {r.workflow_id: r for r in await workflow_runs(world.client) if r.type == "NodeFence"}
    others = [wid.split("/", 1)[1] for wid in runs if wid.split("/", 1)[1] not in set(nodes)]
    out: dict[str, str] = {}
    for node in [*nodes, *others]:
        run = runs.get(fence_workflow_id(node))
        if run is None:
            out[node] = ""
        elif run.close is not None:
            out[node] = Phase.DONE.value if run.status == WorkflowExecutionStatus.COMPLETED else "failed"
        else:
            status = await status_of(world.client, run.workflow_id)
            out[node] = status.phase.value if status is not None else "starting"
    return out


async def storm(world: World, mode: str, share: float, spread_s: float, baseline_s: float) -> dict[str, Any]:
    flagged = flagged_nodes(world, share)
    endpoints = world.endpoints()
    hosted = {e.node for e in endpoints}
    on_flagged = Counter(e.pool for e in endpoints if e.node in set(flagged))
    loaded = [p for p, _ in sorted(on_flagged.items(), key=lambda kv: (-kv[1], kv[0].key))[:LOADED_POOLS]]
    before = routed_per_pool(world)
    low = dict(before)
    async with httpx.AsyncClient(base_url=world.sim.base_url, timeout=30.0) as http:
        duration = baseline_s + spread_s + SETTLE_TIMEOUT_S + 60.0
        runs: dict[str, str] = {}
        started: dict[str, float] = {}
        for i, pool in enumerate(loaded):
            started[pool.key] = (await http.get("/sim/v1/clock")).json()["now"]
            body = {"rate": LOAD_RATE, "duration_s": duration, "seed": i, "model": served_model(world, pool)}
            reply = await http.post("/sim/v1/load", json=body)
            reply.raise_for_status()
            runs[pool.key] = str(reply.json()["id"])
        await asyncio.sleep(baseline_s)
        mark: dict[str, float] = {}
        now = (await http.get("/sim/v1/clock")).json()["now"]
        for key in runs:
            mark[key] = now - started[key]  # each load's own clock: sim seconds since it started
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_routed(world, low, stop))
        cpu_before = {p.name: cpu_seconds(p.pid) for p in world.procs}
        start = time.time()
        spacing = spread_s / max(1, len(flagged) - 1)
        for i, node in enumerate(flagged):
            await asyncio.sleep(max(0.0, start + i * spacing - time.time()))
            fault = FaultRequest(kind=FaultKind.FALSE_GPU_CONDITION, target=node, params={})
            (await http.post("/sim/v1/faults", json=fault.model_dump(mode="json"))).raise_for_status()
        flagged_s = time.time() - start
        # Every fenced node's fence ends or waits on an operator, and no pool's incident is still deciding.
        expect = sorted(set(flagged) & hosted)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        said = time.monotonic()
        while True:
            phases = await fences_settled(world, expect)
            open_incidents = [
                r for r in await workflow_runs(world.client) if r.type == "FleetIncident" and r.close is None
            ]
            unsettled = [
                n for n, p in phases.items() if p not in (Phase.DONE.value, Phase.AWAITING_OPERATOR.value)
            ]
            if not unsettled and not open_incidents:
                break
            if time.monotonic() > deadline:
                break
            if time.monotonic() > said + 20:
                said = time.monotonic()
                console.print(
                    f"  {mode}: {len(unsettled)} fences unsettled, {len(open_incidents)} incidents open"
                )
            await asyncio.sleep(2.0)
        settled_s = time.time() - start
        await asyncio.sleep(SAMPLE_S)  # one more sample of the routed set after the last decision
        stop.set()
        samples = await sampler
        end = time.time()
        cpu = {p.name: round(cpu_seconds(p.pid) - cpu_before[p.name], 1) for p in world.procs}
        goodput: dict[str, Any] = {}
        for key, run in runs.items():
            base = (await http.get(f"/sim/v1/load/{run}", params={"until_s": mark[key]})).json()
            during = (await http.get(f"/sim/v1/load/{run}", params={"since_s": mark[key]})).json()
            await http.delete(f"/sim/v1/load/{run}")

            def frac(r: dict[str, Any]) -> float | None:
                return round(r["goodput"] / r["finished"], 4) if r["finished"] else None

            goodput[key] = {
                "no_fault": frac(base),
                "storm": frac(during),
                "finished": [base["finished"], during["finished"]],
                "truncated_streams": during["truncated_streams"],
                # What the requests that were not goodput met, through the storm (the users' own record).
                "storm_outcomes": {
                    k: during[k]
                    for k in ("late", "shed", "rejected", "terminal_errors", "retried", "in_flight")
                },
            }
    cordoned = cordons(world, start)
    phases = await fences_settled(world, expect)
    breaker = await world.client.get_workflow_handle(breaker_workflow_id(world.settings.task_queue)).query(
        "status", result_type=BreakerStatus
    )
    all_runs = await workflow_runs(world.client)
    verdicts: Counter[str] = Counter()
    for r in all_runs:
        if r.type == "ReplicaLossRecovery" and r.start >= start - 1.0:
            st = await status_of(world.client, r.workflow_id)
            verdicts[st.phase.value if st is not None else "?"] += 1
    ratios = [
        g["storm"] / g["no_fault"] for g in goodput.values() if g["storm"] is not None and g["no_fault"]
    ]
    return {
        "mode": mode,
        "breaker_limits": (MODES[mode] or BreakerLimits()).model_dump(mode="json"),
        "nodes": world.nodes,
        "flagged_nodes": len(flagged),
        "flagged_share": share,
        "flagged_over_s": round(flagged_s, 1),
        "flagged_nodes_serving_managed_pools": len(expect),
        "fences_started": len(phases),
        "nodes_cordoned": len(cordoned),
        "fences": dict(Counter(phases.values())),
        "breaker": {
            "tripped": breaker.tripped,
            "trip": breaker.trip.reason if breaker.trip else None,
            "granted_in_window": len(breaker.granted_in_window),
            "held": len(breaker.held),
            "cap": breaker.cap_for_last_fleet,
        },
        "recoveries_by_phase": dict(sorted(verdicts.items())),
        "fleet_events": sum(1 for r in all_runs if r.type == "FleetEvent"),
        "pools_below_their_routed_count": sorted(p for p, n in low.items() if n < before[p]),
        "routed_samples": samples,
        "routed_replicas": {"before": sum(before.values()), "lowest_sum": sum(low.values())},
        "goodput": goodput,
        "goodput_storm_over_no_fault_min": round(min(ratios), 4) if ratios else None,
        "settled_after_s": round(settled_s, 1),
        # CPU seconds each process spent from the first flag to the end (2 cores = 2 s per second).
        "cpu_s_during_storm": cpu,
        "window_s": round(end - start, 1),
        "ledger_rows": await asyncio.to_thread(ledger_rows, world.database_url),
        "reconcile": await asyncio.to_thread(reconcile_world, world),
    }


def print_rows(rows: list[dict[str, Any]]) -> None:
    table = Table(title="Bad health check: GpuXid on a share of the fleet, engines serving")
    for col in ("mode", "flagged", "cordoned", "breaker", "fences", "recoveries", "pools below", "goodput"):
        table.add_column(col)
    for r in rows:
        b = r["breaker"]
        table.add_row(
            r["mode"],
            f"{r['flagged_nodes']} of {r['nodes']} ({r['flagged_nodes_serving_managed_pools']} serving)",
            str(r["nodes_cordoned"]),
            f"{'TRIPPED' if b['tripped'] else 'closed'}, {b['granted_in_window']} granted, {b['held']} held",
            json.dumps(r["fences"]),
            json.dumps(r["recoveries_by_phase"]),
            str(len(r["pools_below_their_routed_count"])),
            f"storm/no-fault min {r['goodput_storm_over_no_fault_min']}",
        )
    console.print(table)


async def main(args: argparse.Namespace) -> None:
    pg = await asyncio.to_thread(acquire_server)
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="fleet-storm-") as tmp:
            for mode in [m for m in args.modes.split(",") if m]:
                if mode not in MODES:
                    raise SystemExit(f"unknown mode {mode!r}: choose from {', '.join(MODES)}")
                console.print(f"[bold]{args.nodes} nodes, {mode}[/]")
                limits = MODES[mode]
                extra = {"removal_breaker": limits} if limits is not None else {}
                home = Path(args.workdir or tmp) / f"{args.nodes}-storm-{mode}"
                async with running_world(args.nodes, 1, pg, home, TIMINGS, **extra) as world:
                    rows.append(await storm(world, mode, args.share, args.spread_s, args.baseline_s))
                console.print(json.dumps(rows[-1])[:800])
    finally:
        await asyncio.to_thread(pg.stop)
    print_rows(rows)
    out = Path(args.out)
    doc: dict[str, Any] = {
        "about": (__doc__ or "").split("\n\n")[0],
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "runs": rows,
        "command": " ".join(["python -m bench.fleet_storm", *sys.argv[1:]]),
        "finished_at": datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {out}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=512)
    parser.add_argument("--share", type=float, default=0.6, help="share of the GPU nodes flagged")
    parser.add_argument(
        "--spread-s", type=float, default=30.0, help="the flags arrive over this many seconds"
    )
    parser.add_argument("--baseline-s", type=float, default=30.0, help="the no-fault load window")
    parser.add_argument("--modes", default=",".join(MODES), help=f"modes to run ({', '.join(MODES)})")
    parser.add_argument("--workdir", default=None, help="keep each world's logs here")
    parser.add_argument("--out", default=str(REPO / "docs" / "fleet-storm.json"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
