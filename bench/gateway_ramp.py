"""Ramping a cold replica through Envoy: Envoy's own time-based slow start vs fleetmend's
measured-rate weights, on the same replacement, printed side by side.

Each policy gets a fresh compressed ``gpu-node-loss`` world (sim at real speed, a real Envoy
configured by fleetmend's control plane) under the same open-loop load. One serving engine is
OOM-killed; it restarts cold (empty prefix cache, warming over the scenario's warm-up) on the same
pod IP and rejoins the routing set. Then:

* ``equal``: plain round robin, the new replica gets its equal share at once;
* ``envoy-slow-start``: the cluster's ``slow_start_config`` (window = the warm-up time), Envoy's
  peer baseline: a new host's weight grows with time since it joined, whatever it serves;
* ``fleetmend-measured``: every interval the replicas' ``/metrics`` are read and the weights set
  with the product's own ``fleet.warmth.plan_weights`` (the replica-loss ramp, step 9),
  through the gateway adapter.

Printed: requests that arrived while the replacement was cold, how many it served, and how many
of those missed their deadline (late, or failed), per policy.

Also per policy, from the load generator's own record: the new replica's TTFT p99 over the window
and the time until it took its full share (fleetmend: its weights said every replica warm; slow
start: the window; equal: at once). Writes ``docs/gateway-ramp.json``.

Run:  .venv/bin/python -m bench.gateway_ramp [--rate 30] [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from activities.envoy_gateway import EnvoyGateway
from fleet.engine_metrics import EngineSnapshot, parse_engine_metrics
from fleet.gateway import GatewayPolicy
from fleet.incident import PoolRef
from fleet.vocabulary import FaultKind
from fleet.warmth import plan_weights
from gateway.resources import UPSTREAM_HEADER, DataPlaneSettings
from gateway.store import GatewayStore
from ledger.migrate import upgrade_head
from ledger.scratch import acquire_server
from ledger.store import make_engine
from sim.runner import start_sim
from sim.serving.loadgen import GatewayTarget, LoadSpec, percentile, start_load
from worker.devstack.gateway import LocalGateway
from worker.devstack.rig import compressed_scenario

POOL = PoolRef(namespace="inference", service="llama")
MODEL = "meta-llama/Llama-3.1-70B-Instruct"
WARM_UP_S = 15.0
POLICIES = ("equal", "envoy-slow-start", "fleetmend-measured")
OUT = Path(__file__).resolve().parent.parent / "docs" / "gateway-ramp.json"


async def _scrape(http: httpx.AsyncClient, ips: dict[str, str]) -> dict[str, EngineSnapshot]:
    out: dict[str, EngineSnapshot] = {}
    for pod, ip in ips.items():
        try:
            out[pod] = parse_engine_metrics((await http.get(f"http://{ip}:8000/metrics", timeout=2)).text)
        except httpx.HTTPError:
            continue
    return out


async def one_policy(url: str, policy: str, rate: float, seconds: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"fleetmend-ramp-{policy}-"))
    sim = await asyncio.to_thread(start_sim, compressed_scenario("gpu-node-loss", warm_up_s=WARM_UP_S), 1.0)
    # The peers' policies as a user would run them, on round robin (equal share; Envoy's slow start on
    # its round robin); fleetmend's measured-rate weights on its own default, least request.
    data_plane = DataPlaneSettings(
        slow_start_window_s=WARM_UP_S if policy == "envoy-slow-start" else None,
        balancing="least-request" if policy == "fleetmend-measured" else "round-robin",
    )
    gateway = LocalGateway(
        kubeconfig=Path(sim.kubeconfig), database_url=url, workdir=work / "gateway", data_plane=data_plane
    )
    await asyncio.to_thread(gateway.start)
    store = GatewayStore(make_engine(url, pool_size=2))
    envoy = EnvoyGateway(store)

    def pod_ips() -> dict[str, str]:
        return {
            p["metadata"]["name"]: p["status"]["podIP"]
            for p in sim.world.store.list("pods")
            if (p.get("status") or {}).get("podIP") and p["metadata"]["name"] in routed
        }

    def replica_of(upstream: str) -> str | None:
        ip = upstream.rsplit(":", 1)[0]
        return next((pod for pod, pip in pod_ips().items() if pip == ip), None)

    routed: set[str] = set()
    try:
        while (
            len(routed := {e.pod for e in (await asyncio.to_thread(envoy.routing_set, POOL)).endpoints}) < 5
        ):
            await asyncio.sleep(0.5)
        await asyncio.sleep(WARM_UP_S + 2)  # everyone warm before the fault
        target = GatewayTarget(
            gateway.url,
            upstream_header=UPSTREAM_HEADER,
            host_for=lambda _m: "llama.inference",
            replica_of=replica_of,
        )
        run = start_load(target, LoadSpec(rate=rate, duration_s=seconds + 10, seed=11, model=MODEL))
        await asyncio.sleep(5)
        victim = sorted(routed)[0]
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=10) as http:
            await http.post(
                "/sim/v1/faults", json={"kind": FaultKind.POD_OOMKILLED, "target": f"inference/{victim}"}
            )
            while victim in {e.pod for e in (await asyncio.to_thread(envoy.routing_set, POOL)).endpoints}:
                await asyncio.sleep(0.05)
            while victim not in {e.pod for e in (await asyncio.to_thread(envoy.routing_set, POOL)).endpoints}:
                await asyncio.sleep(0.05)
            rejoined = run.sim_now()
            before = await _scrape(http, pod_ips())
            started = time.monotonic()
            full_share_s: float | None = 0.0 if policy == "equal" else None
            if policy == "envoy-slow-start":
                full_share_s = WARM_UP_S
            interval = 2.0
            while time.monotonic() - started < WARM_UP_S + 5:
                await asyncio.sleep(interval)
                if policy != "fleetmend-measured":
                    continue
                after = await _scrape(http, pod_ips())
                plan = plan_weights(before, after, interval, [victim], ttft_slo_s=2.0, warm_fraction=0.9)
                await asyncio.to_thread(envoy.apply, POOL, GatewayPolicy(weights=plan.weights))
                before = after
                if plan.all_warm:
                    full_share_s = round(time.monotonic() - started, 1)
                    break
        report_window = (rejoined, rejoined + WARM_UP_S)
        await run.wait()
    finally:
        store.engine.dispose()
        await asyncio.to_thread(gateway.stop)
        await asyncio.to_thread(sim.stop)
    cold = [r for r in run.results if report_window[0] <= r.arrived_at <= report_window[1]]
    on_new = [r for r in cold if r.replica == victim]
    missed = [r for r in on_new if r.outcome != "goodput"]
    ttfts = [r.ttft_s for r in on_new if r.ttft_s is not None]
    return {
        "policy": policy,
        "arrived_while_cold": len(cold),
        "served_by_new": len(on_new),
        "new_missed_deadline": len(missed),
        "new_ttft_p99_s": percentile(ttfts, 0.99),
        "full_share_after_s": full_share_s,
        "all_missed_deadline": sum(1 for r in cold if r.outcome not in ("goodput", "shed")),
        "goodput_while_cold": sum(1 for r in cold if r.outcome == "goodput"),
    }


async def main(rate: float, seconds: float) -> None:
    pg = acquire_server()
    rows = []
    for policy in POLICIES:
        url = pg.create_database("ramp")
        upgrade_head(url)
        try:
            rows.append(await one_policy(url, policy, rate, seconds))
        finally:
            pg.drop_database(url)
    print(f"\ncold replacement rejoining under {rate:.0f} req/s, first {WARM_UP_S:.0f} s after it rejoined")
    print(
        f"{'policy':22}{'arrived':>9}{'on new':>9}{'new late':>10}{'new late %':>12}{'all late':>10}{'new TTFT p99':>14}"
    )
    for row in rows:
        share = row["new_missed_deadline"] / row["served_by_new"] if row["served_by_new"] else 0.0
        print(
            f"{row['policy']:22}{row['arrived_while_cold']:9}{row['served_by_new']:9}"
            f"{row['new_missed_deadline']:10}{share:12.1%}{row['all_missed_deadline']:10}{row['new_ttft_p99_s']!s:>14}"
        )
    # One file, a block per load: runs at other rates are kept.
    kept = json.loads(OUT.read_text()) if OUT.exists() else {}
    by_rate = kept.get("by_rate", {})
    by_rate[f"{rate:g}"] = {"seconds": seconds, "warm_up_s": WARM_UP_S, "runs": rows}
    OUT.write_text(json.dumps({"by_rate": by_rate}, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=30.0)
    parser.add_argument("--seconds", type=float, default=40.0)
    args = parser.parse_args()
    asyncio.run(main(args.rate, args.seconds))
