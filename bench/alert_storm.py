"""How many alerts per second the webhook receiver accepts, next to a bare FastAPI endpoint,
and how long it takes to answer one Alertmanager group of 10,000 alerts.

    .venv/bin/python -m bench.alert_storm [--requests 2000] [--concurrency 32] [--group-alerts 10000]

Same machine, same run, same load generator (httpx, keep-alive, N concurrent),
same server stack (uvicorn, one process each, INFO logs to a file):

* **bare FastAPI** — ``POST /alerts`` reads the body and answers 200;
* **fleetmend, distinct alerts** — ``fleetmend webhook`` as shipped: bearer check,
  body limit, v4 validation, routing, and a signal-with-start into a real Temporal
  dev server for every alert (each notification carries a new fingerprint);
* **fleetmend, repeats** — Alertmanager re-sending the same groups: validated and
  routed, then absorbed by the receiver without a Temporal round trip.

Alerts name their pool directly (no Kubernetes lookups), so the figures are the
receiver's own cost plus Temporal's. The load generator, both servers and the
Temporal dev server share this machine's CPUs.

**Large groups** — one notification of ``--group-alerts`` alerts (a cluster-wide outage's
group, as Alertmanager sends it with the shipped ``max_alerts``): one real node loss of the
simulated cluster among noise (unknown nodes, gone pods, invalid names, alerts without a
rule), posted to ``fleetmend webhook`` with the *shipped* routing rules, so every node and
pod is resolved through the sim's Kubernetes API. Each round names fresh nodes and waits out
the lookup cache, so every round pays its lookups; Alertmanager gives up on a notification
after max(group_interval, 10 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi import FastAPI, Request

from sim.runner import start_sim
from sim.scenario import load_scenario, shipped_scenarios
from worker.devstack.temporal_dev import throwaway_dev_server
from worker.processes import free_port
from worker.webhook.examples import alert, example_alert, large_group, notification

POOL_RULES = """
version: 1
rules:
  - alert: PoolReplicaDown
    action: start-incident
    fault: node-lost
    entity: {namespace: namespace, service: service, replica_group: replica_group}
"""

BARE = "bare FastAPI endpoint (read body, 200)"
DISTINCT = "fleetmend receiver, distinct alerts (signal-with-start each)"
REPEATS = "fleetmend receiver, Alertmanager repeats (absorbed)"

bare_app = FastAPI()


@bare_app.post("/alerts")
async def bare_alerts(request: Request) -> dict[str, str]:
    await request.body()
    return {"status": "ok"}


@dataclass
class Result:
    name: str
    requests: int
    ok: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rate(self) -> float:
        return self.ok / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def payloads(service: str, count: int, round_: int = 0) -> list[bytes]:
    """``count`` notifications about one replica group, each with its own fingerprint."""
    labels = {
        "alertname": "PoolReplicaDown",
        "namespace": "bench",
        "service": service,
        "severity": "critical",
    }
    return [
        json.dumps(
            notification(
                [
                    alert(
                        {
                            **labels,
                            "replica_group": f"{service}-0",
                            "instance": f"10.{round_}.{i // 250}.{i % 250}",
                        }
                    )
                ]
            )
        ).encode()
        for i in range(count)
    ]


async def storm(
    name: str, url: str, bodies: list[bytes], headers: dict[str, str], concurrency: int
) -> Result:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    latencies: list[float] = []
    ok = 0

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal ok
        while not queue.empty():
            body = queue.get_nowait()
            started = time.perf_counter()
            response = await http.post(url, content=body, headers=headers)
            latencies.append((time.perf_counter() - started) * 1000)
            ok += response.status_code == 200

    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return Result(name, len(bodies), ok, seconds, latencies)


@contextmanager
def server(argv: list[str], env: dict[str, str], port: int, log: Path) -> Iterator[str]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(base + "/docs", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@dataclass
class GroupResult:
    alerts: int
    body_bytes: int
    seconds: list[float]
    answers: list[dict[str, object]]


async def large_groups(
    fleetmend: Path, temporal_address: str, group_alerts: int, rounds: int, scratch: Path
) -> GroupResult:
    token = secrets.token_hex(32)
    scenario = load_scenario(shipped_scenarios()["gpu-node-loss"])
    namespace = f"bench-{secrets.token_hex(3)}"
    with start_sim(scenario.model_copy(update={"namespace": namespace}), serving=False) as sim:
        port = free_port()
        argv = [str(fleetmend), "webhook", "--port", str(port)]
        env = {
            "FLEETMEND_WEBHOOK_TOKEN": token,
            "FLEETMEND_WEBHOOK_HOST": "127.0.0.1",
            "FLEETMEND_TEMPORAL_ADDRESS": temporal_address,
            "FLEETMEND_TASK_QUEUE": f"bench-{secrets.token_hex(4)}",
            "FLEETMEND_KUBECONFIG": str(sim.kubeconfig),
            "FLEETMEND_KUBE_CONTEXT": "sim",
        }
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        seconds: list[float] = []
        answers: list[dict[str, object]] = []
        size = 0
        with server(argv, env, port, scratch / "webhook-groups.log") as hook:
            async with httpx.AsyncClient(timeout=120) as http:
                # A running receiver: its Kubernetes client and Temporal connection already exist.
                first = example_alert("node-not-ready", overrides={"node": "gpu-node-0", "round": "warm-up"})
                warm = json.dumps(large_group([first], 1, namespace=namespace))
                (
                    await http.post(hook + "/alerts/alertmanager", content=warm, headers=headers)
                ).raise_for_status()
                await asyncio.sleep(5.5)
                for round_ in range(rounds):
                    real = example_alert(
                        "node-not-ready", overrides={"node": "gpu-node-0", "round": str(round_)}
                    )
                    body = json.dumps(
                        large_group([real], group_alerts, namespace=namespace, seed=f"r{round_}-")
                    )
                    size = len(body)
                    started = time.perf_counter()
                    response = await http.post(hook + "/alerts/alertmanager", content=body, headers=headers)
                    seconds.append(time.perf_counter() - started)
                    if response.status_code != 200:
                        raise RuntimeError(
                            f"the group got HTTP {response.status_code}: {response.text[:300]}"
                        )
                    answer = response.json()
                    if answer["incidents"] != [f"incident/{namespace}/llama"]:
                        raise RuntimeError(f"the node loss did not reach its incident: {answer['incidents']}")
                    answers.append({k: answer[k] for k in ("alerts", "ignored_count", "ignored_by_reason")})
                    await asyncio.sleep(5.5)  # past the webhook's 5 s lookup cache
    return GroupResult(group_alerts, size, seconds, answers)


async def run(
    requests: int, concurrency: int, rounds: int, group_alerts: int
) -> tuple[list[Result], GroupResult]:
    bin_dir = Path(sys.executable).parent
    token = secrets.token_hex(32)
    service = f"storm-{secrets.token_hex(3)}"
    results: list[Result] = []
    env_ = await throwaway_dev_server()
    async with env_ as temporal:
        with tempfile.TemporaryDirectory(prefix="fleetmend-bench-") as scratch:
            tmp = Path(scratch)
            (tmp / "rules.yaml").write_text(POOL_RULES)
            bare_port, hook_port = free_port(), free_port()
            bare_argv = [str(bin_dir / "uvicorn"), "bench.alert_storm:bare_app", "--port", str(bare_port)]
            hook_argv = [
                str(bin_dir / "fleetmend"),
                "webhook",
                "--port",
                str(hook_port),
                "--rules",
                str(tmp / "rules.yaml"),
            ]
            hook_env = {
                "FLEETMEND_WEBHOOK_TOKEN": token,
                "FLEETMEND_WEBHOOK_HOST": "127.0.0.1",
                "FLEETMEND_TEMPORAL_ADDRESS": temporal.client.service_client.config.target_host,
                "FLEETMEND_TASK_QUEUE": f"bench-{secrets.token_hex(4)}",
            }
            warm = payloads(f"{service}-warm", 100)
            with (
                server(bare_argv, {}, bare_port, tmp / "bare.log") as bare,
                server(hook_argv, hook_env, hook_port, tmp / "webhook.log") as hook,
            ):
                url = hook + "/alerts/alertmanager"
                auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
                await storm("warm-up", bare + "/alerts", warm, {}, concurrency)
                await storm("warm-up", url, warm, auth, concurrency)
                # Interleaved rounds: background load on the machine hits every endpoint alike.
                for round_ in range(rounds):
                    distinct = payloads(service, requests, round_)
                    results.append(await storm(BARE, bare + "/alerts", distinct, {}, concurrency))
                    results.append(await storm(DISTINCT, url, distinct, auth, concurrency))
                    results.append(await storm(REPEATS, url, distinct, auth, concurrency))
            runs = [
                wf async for wf in temporal.client.list_workflows(f'WorkflowId = "incident/bench/{service}"')
            ]
            if len(runs) != 1:
                raise RuntimeError(f"expected exactly one incident workflow, found {len(runs)}")
            groups = await large_groups(
                bin_dir / "fleetmend",
                temporal.client.service_client.config.target_host,
                group_alerts,
                rounds,
                tmp,
            )
    return results, groups


def median_of(results: list[Result], name: str) -> Result:
    runs = sorted((r for r in results if r.name == name), key=lambda r: r.rate)
    return runs[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="notifications per run (one alert each)")
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent connections")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median round is shown")
    parser.add_argument(
        "--group-alerts", type=int, default=10_000, help="alerts in the one large notification"
    )
    args = parser.parse_args()
    results, groups = asyncio.run(run(args.requests, args.concurrency, args.rounds, args.group_alerts))
    print(
        f"alert storm: {args.requests} notifications x 1 alert, {args.concurrency} concurrent connections, "
        f"loopback, median of {args.rounds} interleaved rounds; {os.cpu_count()} CPUs shared by the load "
        f"generator, both servers and Temporal (load average now {os.getloadavg()[0]:.1f})"
    )
    print(f"{'endpoint':<62} {'alerts/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'200s':>6}")
    shown = [median_of(results, name) for name in (BARE, DISTINCT, REPEATS)]
    for r in shown:
        print(f"{r.name:<62} {r.rate:>9.0f} {r.pct(0.5):>8.1f} {r.pct(0.99):>8.1f} {r.ok:>6}")
    bare, distinct, repeats = shown
    print(
        f"ratio receiver/bare: distinct alerts {distinct.rate / bare.rate:.2f}, repeats {repeats.rate / bare.rate:.2f}"
    )
    print("exactly one incident workflow for the storm's pool after all rounds")
    ordered = sorted(groups.seconds)
    print(
        f"one {groups.alerts:,}-alert notification ({groups.body_bytes / 1e6:.1f} MB; 1 real node loss, "
        f"{groups.alerts - 1:,} noise; shipped rules, every node and pod resolved through the sim's Kubernetes "
        f"API): median {ordered[len(ordered) // 2]:.2f} s, max {ordered[-1]:.2f} s over {len(ordered)} rounds; "
        f"answer {groups.answers[-1]}"
    )


if __name__ == "__main__":
    main()
