"""How long the alert path takes to tell fleetmend, measured with the shipped configs.

Serves the compressed ``gpu-node-loss`` world (sim at real speed; Kubernetes' own 50 s node-monitor
grace and 300 s taint tolerations kept) and runs the real Prometheus and Alertmanager (Debian
packages) with ``deploy/`` exactly as shipped: the 15 s scrape and evaluation intervals, every
rule's ``for:``, the fleetmend route's ``group_wait`` / ``group_interval``. Only the addresses are
templated to loopback. Alertmanager posts to a receiver standing where fleetmend's webhook would,
which checks the bearer token and records when each notification arrived.

Each round starts a fresh Prometheus and Alertmanager (a new Alertmanager group, so the first
notification waits ``group_wait`` as it would for a first incident, not ``group_interval``),
waits until Prometheus has scraped the world, lets a random share of a scrape interval pass (a
fault does not land in step with the scrape), then injects the fault and times, from it:

* **fired**: the alert's ``startsAt`` (Prometheus saw the condition: scrape + evaluation + ``for:``);
* **delivered**: the first notification naming the fault's pod reached the receiver (+ Alertmanager's
  ``group_wait`` and the post).

Faults: an OOM-killed serving container (``FleetmendServingPodOOMKilled``, ``for: 0m``) and a lost
GPU node (its pods stay Ready for the node-monitor grace; then ``FleetmendServingEndpointUnroutable``,
``for: 1m``). The README used to quote a 25 s "floor" computed from ``deploy/`` (scrape + ``for:`` +
``group_wait``) instead: a fault just before a scrape is seen sooner, one just after it later.

Run:  .venv/bin/python -m bench.alert_path [--oom 5] [--node-lost 2] [--json docs/alert-path.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request

from bench.gateway_ejection import shipped_alert_timings
from fleet.vocabulary import FaultKind
from sim.runner import RunningSim, start_sim
from worker.devstack.rig import compressed_scenario
from worker.processes import free_port
from worker.webhook.pipeline import alert_pipeline, pipeline_binaries

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "inference"
SCRAPE_S = 15.0  # deploy/prometheus/prometheus.yml's global scrape_interval (checked in main)
ROUND_TIMEOUT_S = 300.0


@dataclass
class Delivery:
    """One notification as the receiver saw it."""

    received_at: float
    alerts: list[dict[str, Any]]


@dataclass
class Receiver:
    """Stands where fleetmend's webhook would: checks the bearer token, records each notification."""

    token: str
    deliveries: list[Delivery] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/alerts/alertmanager")
        async def notified(request: Request, authorization: str = Header("")) -> dict[str, str]:
            if authorization != f"Bearer {self.token}":
                raise HTTPException(401, "bearer token missing or wrong")
            body = await request.json()
            self.deliveries.append(Delivery(time.time(), list(body.get("alerts", []))))
            return {"status": "recorded"}

        return app

    def first(self, alertname: str, pods: set[str], since: float) -> tuple[Delivery, dict[str, Any]] | None:
        for delivery in self.deliveries:
            if delivery.received_at < since:
                continue
            for alert in delivery.alerts:
                labels = alert.get("labels", {})
                if (
                    alert.get("status") == "firing"
                    and labels.get("alertname") == alertname
                    and labels.get("pod") in pods
                ):
                    return delivery, alert
        return None


@contextlib.asynccontextmanager
async def served(receiver: Receiver) -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(receiver.app(), host="127.0.0.1", port=port, log_config=None, access_log=False)
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@dataclass
class Round:
    fault: str
    alertname: str
    target: str
    fired_s: float  # the alert's startsAt, from the fault
    delivered_s: float  # its first notification at the receiver, from the fault
    group_alerts: int  # alerts in that notification


def _serving_pods(sim: RunningSim, node: str | None = None) -> list[str]:
    return sorted(
        p["metadata"]["name"]
        for p in sim.world.store.list("pods", NAMESPACE)
        if p["metadata"].get("labels", {}).get("fleetmend.io/role") == "serving"
        and (node is None or p["spec"].get("nodeName") == node)
        and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", [])
        )
    )


async def _scraped(http: httpx.AsyncClient, prometheus_url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        answer = await http.get(
            f"{prometheus_url}/api/v1/query",
            params={"query": 'count(kube_pod_status_ready{job="kube-state-metrics"})'},
        )
        return bool(answer.json()["data"]["result"])
    return False


def _seconds_after(stamp: str, fault_at: float) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - fault_at


async def one_round(
    sim: RunningSim,
    receiver: Receiver,
    address: str,
    binaries: tuple[str, str],
    fault: FaultKind,
    target: str,
    pods: set[str],
    alertname: str,
    rng: random.Random,
) -> Round:
    work = Path(tempfile.mkdtemp(prefix="fleetmend-alert-path-"))
    sim_address = sim.base_url.removeprefix("http://")
    async with (
        alert_pipeline(
            work,
            binaries=binaries,
            sim_address=sim_address,
            webhook_address=address,
            webhook_token=receiver.token,
            shipped_timings=True,
        ) as pipeline,
        httpx.AsyncClient(timeout=10) as http,
    ):
        deadline = time.monotonic() + 60
        while not await _scraped(http, pipeline.prometheus_url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus did not scrape the sim within 60 s; logs {pipeline.logs}")
            await asyncio.sleep(0.5)
        await asyncio.sleep(rng.uniform(0, SCRAPE_S))  # the fault lands anywhere in a scrape interval
        fault_at = time.time()
        answer = await http.post(f"{sim.base_url}/sim/v1/faults", json={"kind": fault, "target": target})
        answer.raise_for_status()
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while (found := receiver.first(alertname, pods, fault_at)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{alertname} for {sorted(pods)} not delivered within {ROUND_TIMEOUT_S:.0f} s "
                    f"of the fault; logs {pipeline.logs}"
                )
            await asyncio.sleep(0.1)
        delivery, alert = found
        return Round(
            fault=str(fault),
            alertname=alertname,
            target=target,
            fired_s=round(_seconds_after(alert["startsAt"], fault_at), 3),
            delivered_s=round(delivery.received_at - fault_at, 3),
            group_alerts=len(delivery.alerts),
        )


async def main(oom_rounds: int, node_rounds: int, seed: int) -> dict[str, Any]:
    binaries = pipeline_binaries()
    if binaries is None:
        raise SystemExit(
            "the alert path needs the Debian packages `prometheus` and `prometheus-alertmanager`; "
            "`make system-deps` installs them"
        )
    configs = shipped_alert_timings()
    if configs["scrape_interval_s"] != SCRAPE_S:
        raise SystemExit(f"deploy/ scrapes every {configs['scrape_interval_s']} s; update SCRAPE_S")
    rng = random.Random(seed)
    receiver = Receiver(secrets.token_urlsafe(24))
    rounds: list[Round] = []
    sim = await asyncio.to_thread(start_sim, compressed_scenario("gpu-node-loss"), 1.0)
    try:
        async with served(receiver) as address:
            deadline = time.monotonic() + 120
            while len(_serving_pods(sim)) < 5:
                if time.monotonic() > deadline:
                    raise RuntimeError("the world's serving pods did not turn Ready within 120 s")
                await asyncio.sleep(0.5)
            for index in range(oom_rounds):
                victim = _serving_pods(sim)[index % 5]
                rounds.append(
                    await one_round(
                        sim, receiver, address, binaries, FaultKind.POD_OOMKILLED,
                        f"{NAMESPACE}/{victim}", {victim}, "FleetmendServingPodOOMKilled", rng,
                    )
                )  # fmt: skip
                print(f"  {rounds[-1]}", flush=True)
            nodes = sorted({p["spec"]["nodeName"] for p in sim.world.store.list("pods", NAMESPACE)})
            for node in [n for n in nodes if _serving_pods(sim, n)][:node_rounds]:
                rounds.append(
                    await one_round(
                        sim, receiver, address, binaries, FaultKind.NODE_LOST, node,
                        set(_serving_pods(sim, node)), "FleetmendServingEndpointUnroutable", rng,
                    )
                )  # fmt: skip
                print(f"  {rounds[-1]}", flush=True)
    finally:
        await asyncio.to_thread(sim.stop)
    return {"configs": configs, "seed": seed, "rounds": [asdict(r) for r in rounds]}


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for alertname in sorted({r["alertname"] for r in result["rounds"]}):
        runs = [r for r in result["rounds"] if r["alertname"] == alertname]
        fired = [r["fired_s"] for r in runs]
        delivered = [r["delivered_s"] for r in runs]
        rows.append(
            {
                "alert": alertname,
                "n": len(runs),
                "fired_p50_s": round(statistics.median(fired), 1),
                "delivered_min_s": round(min(delivered), 1),
                "delivered_p50_s": round(statistics.median(delivered), 1),
                "delivered_max_s": round(max(delivered), 1),
            }
        )
    return rows


def report(result: dict[str, Any]) -> None:
    configs = result["configs"]
    print(
        f"\nfault -> fleetmend's webhook by the alert path, shipped configs (scrape/eval "
        f"{configs['scrape_interval_s']:.0f} s, group_wait {configs['group_wait_s']:.0f} s), seconds"
    )
    print(f"{'alert':38}{'n':>3}{'fired p50':>11}{'min':>8}{'p50':>8}{'max':>8}")
    for row in result["summary"]:
        print(
            f"{row['alert']:38}{row['n']:3}{row['fired_p50_s']:11.1f}{row['delivered_min_s']:8.1f}"
            f"{row['delivered_p50_s']:8.1f}{row['delivered_max_s']:8.1f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--oom", type=int, default=5, help="OOM-kill rounds (one serving pod each)")
    parser.add_argument("--node-lost", type=int, default=2, help="GPU-node-loss rounds (one node each)")
    parser.add_argument(
        "--seed", type=int, default=7, help="seeds where in a scrape interval each fault lands"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rounds and summary here")
    args = parser.parse_args()
    if args.oom < 0 or args.node_lost < 0 or args.oom + args.node_lost == 0:
        parser.error("give at least one round: --oom N and/or --node-lost N (N >= 0)")
    outcome = asyncio.run(main(args.oom, args.node_lost, args.seed))
    outcome["summary"] = summary(outcome)
    outcome["command"] = (
        f"python -m bench.alert_path --oom {args.oom} --node-lost {args.node_lost} --seed {args.seed}"
    )
    report(outcome)
    if args.json is not None:
        args.json.write_text(json.dumps(outcome, indent=2) + "\n")
        print(f"written to {args.json}")
