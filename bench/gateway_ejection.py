"""How fast a dead engine leaves Envoy's rotation, with no help from fleetmend or any alert.

Serves the compressed ``gpu-node-loss`` world (sim at real speed, engines on their pod IPs) behind
a real Envoy configured by fleetmend's control plane, sends load through Envoy, then repeatedly
kills one serving engine (an OOM kill: the process dies, its socket closes) and times, from the
fault, when Envoy's admin stops routing to that pod (its active health check on ``/health``)
and when the last user request failed on it. Each killed pod restarts before the next round.
Beside it, the shipped alert path's timings for the same fault, read from ``deploy/`` (the scrape
interval, the rule's ``for:``, Alertmanager's ``group_wait``); ``bench.alert_path`` measures that path.

Run:  .venv/bin/python -m bench.gateway_ejection [--worlds 3] [--oom 3] [--rate 20]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from activities.envoy_gateway import EnvoyGateway
from fleet.incident import PoolRef
from fleet.vocabulary import FaultKind
from gateway.resources import UPSTREAM_HEADER
from gateway.store import GatewayStore
from ledger.migrate import upgrade_head
from ledger.scratch import acquire_server
from ledger.store import make_engine
from sim.runner import start_sim
from worker.devstack.gateway import LocalGateway
from worker.devstack.rig import compressed_scenario

POOL = PoolRef(namespace="inference", service="llama")
ROOT = Path(__file__).resolve().parent.parent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", text.strip())
    if not match:
        return 0.0
    value, unit = float(match.group(1)), match.group(2)
    return value / 1000 if unit == "ms" else value * 60 if unit == "m" else value


def shipped_alert_timings() -> dict[str, float]:
    """The shipped alert path's timings for a dead engine: scrape interval, the shortest ``for:`` of its
    rules, the fleetmend route's group_wait (not a floor: a fault just before a scrape is seen sooner;
    ``bench.alert_path`` measures the path)."""
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    rules = yaml.safe_load((ROOT / "deploy/prometheus/rules.yml").read_text())
    am = yaml.safe_load((ROOT / "deploy/alertmanager/alertmanager.yml").read_text())
    scrape = _seconds(prom.get("global", {}).get("scrape_interval", "1m"))
    fors = [
        _seconds(r.get("for", "0s"))
        for g in rules.get("groups", [])
        for r in g.get("rules", [])
        if "alert" in r and re.search(r"Engine|Replica|Down|Health", r["alert"])
    ]
    # The route that delivers to fleetmend sets its own group_wait; the top route's (or Alertmanager's
    # 30 s default) applies only where it does not. (An earlier version read the top route's alone and
    # printed 30 s against the shipped 10 s.)
    top = am.get("route", {})
    fleetmend = [r for r in top.get("routes", []) if r.get("receiver") == "fleetmend"]
    group_wait = _seconds(
        (fleetmend[0] if fleetmend else {}).get("group_wait") or top.get("group_wait") or "30s"
    )
    return {"scrape_interval_s": scrape, "for_s": min(fors) if fors else 0.0, "group_wait_s": group_wait}


async def _routed(envoy: EnvoyGateway) -> set[str]:
    return {e.pod for e in (await asyncio.to_thread(envoy.routing_set, POOL)).endpoints}


async def _timed_out_of_rotation(envoy: EnvoyGateway, pods: set[str], fault_at: float) -> float:
    while pods & await _routed(envoy):
        await asyncio.sleep(0.02)
    return time.time() - fault_at


async def one_world(url: str, rate: float, oom_rounds: int, results: dict[str, list[float]]) -> None:
    """OOM kills (the pod leaves the EndpointSlice) then node losses (the pods stay Ready in the
    EndpointSlice for the node-monitor grace: only Envoy's health check takes them out)."""
    work = Path(tempfile.mkdtemp(prefix="fleetmend-ejection-"))
    sim = await asyncio.to_thread(start_sim, compressed_scenario("gpu-node-loss"), 1.0)
    gateway = LocalGateway(kubeconfig=Path(sim.kubeconfig), database_url=url, workdir=work / "gateway")
    await asyncio.to_thread(gateway.start)
    store = GatewayStore(make_engine(url, pool_size=2))
    envoy = EnvoyGateway(store)
    try:
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=10) as http:
            await http.put("/sim/v1/gateway", json={"url": gateway.url, "upstream_header": UPSTREAM_HEADER})
            while len(await _routed(envoy)) < 5:
                await asyncio.sleep(0.5)
            load = (await http.post("/sim/v1/load", json={"rate": rate, "duration_s": 600.0})).json()
            await asyncio.sleep(3)
            for round_ in range(oom_rounds):
                victim = sorted(await _routed(envoy))[round_ % 5]
                fault_at = time.time()
                await http.post(
                    "/sim/v1/faults", json={"kind": FaultKind.POD_OOMKILLED, "target": f"inference/{victim}"}
                )
                results["pod-oomkilled"].append(await _timed_out_of_rotation(envoy, {victim}, fault_at))
                while len(await _routed(envoy)) < 5:  # restarted
                    await asyncio.sleep(0.5)
            for node in ("gpu-node-0", "gpu-node-1", "gpu-node-2"):
                pods = {
                    p["metadata"]["name"]
                    for p in sim.world.store.list("pods")
                    if p["spec"].get("nodeName") == node
                }
                victims = pods & await _routed(envoy)
                if not victims:
                    continue
                fault_at = time.time()
                await http.post("/sim/v1/faults", json={"kind": FaultKind.NODE_LOST, "target": node})
                results["node-lost"].append(await _timed_out_of_rotation(envoy, victims, fault_at))
                await asyncio.sleep(3)
                failed = [
                    e.ended_at - fault_at
                    for v in victims
                    for e in await asyncio.to_thread(
                        envoy.request_outcomes, POOL, replica=v, since=fault_at - 60
                    )
                    if e.outcome.value != "completed" and e.ended_at >= fault_at
                ]
                results["node-lost: last failed request"].append(max(failed, default=0.0))
            await http.delete(f"/sim/v1/load/{load['id']}")
    finally:
        store.engine.dispose()
        await asyncio.to_thread(gateway.stop)
        await asyncio.to_thread(sim.stop)


async def main(worlds: int, oom_rounds: int, rate: float) -> None:
    pg = acquire_server()
    results: dict[str, list[float]] = {
        "pod-oomkilled": [],
        "node-lost": [],
        "node-lost: last failed request": [],
    }
    for _ in range(worlds):
        url = pg.create_database("ejection")
        upgrade_head(url)
        try:
            await one_world(url, rate, oom_rounds, results)
        finally:
            pg.drop_database(url)
    floor = shipped_alert_timings()
    print(f"\nfault -> out of Envoy's rotation, under {rate:.0f} req/s through Envoy (seconds)")
    print(f"{'':34}{'n':>4}{'p50':>8}{'p99':>8}{'max':>8}")
    for name, values in results.items():
        if values:
            print(
                f"{name:34}{len(values):4}{statistics.median(values):8.2f}{percentile(values, 0.99):8.2f}"
                f"{max(values):8.2f}"
            )
    print(
        f"the alert path (shipped configs: scrape and evaluation every {floor['scrape_interval_s']:.0f} s, "
        f"for {floor['for_s']:.0f} s, group_wait {floor['group_wait_s']:.0f} s) is measured by "
        "`python -m bench.alert_path` (docs/alert-path.json)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, default=3, help="fresh worlds; each loses 3 nodes")
    parser.add_argument("--oom", type=int, default=3, help="OOM kills per world before the node losses")
    parser.add_argument("--rate", type=float, default=20.0)
    args = parser.parse_args()
    asyncio.run(main(args.worlds, args.oom, args.rate))
