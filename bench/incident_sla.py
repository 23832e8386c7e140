"""Fault -> incident opened, over repeated GPU-node losses: the fast path, and where the alert path starts.

    .venv/bin/python -m bench.incident_sla [--rounds 10] [--grace 50]

Each round serves a fresh ``gpu-node-loss`` cluster (the simulator at real speed, its
node-monitor grace set to ``--grace`` seconds: Kubernetes' default is 50 s since 1.32),
runs fleetmend's fast path against it (leader election on a Lease, informers on Nodes /
Pods / EndpointSlices, engine ``/health`` probes, delivery through the webhook's intake
into a real Temporal dev server), kills ``gpu-node-0`` and times, from the fault:

* **fast path: incident opened** — the pool's ``FleetIncident`` start time (signal-with-start);
* **alert path: node NotReady** — when the Node's Ready condition leaves True, as the node
  informer sees it. This is where the alert path *starts*: ``KubeNodeNotReady`` then still
  waits for a Prometheus scrape, the rule's ``for:`` and Alertmanager's ``group_wait`` —
  so the alert path's incident opens later than this figure, never earlier.

No worker runs: the figures are detection and delivery, not the recovery (``fleetmend demo``
shows a whole recovery). Shares this machine's CPUs with everything else running.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from kubernetes import client as kclient
from kubernetes import config as kconfig
from temporalio.client import Client

from fleet.incident import PoolRef, incident_workflow_id
from fleet.vocabulary import FaultKind
from sim.runner import start_sim
from worker.config import load_settings
from worker.devstack.rig import compressed_scenario
from worker.devstack.sim_wiring import settings_for_running_sim
from worker.devstack.temporal_dev import throwaway_dev_server
from worker.fastpath.service import build_fast_path

POOL = PoolRef(namespace="inference", service="llama")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def ready_endpoints(kubeconfig: Path) -> int:
    """Ready endpoints in the pool's EndpointSlices, as Kubernetes (and so Envoy) sees them."""
    cfg = kclient.Configuration()
    kconfig.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    with kclient.ApiClient(cfg) as api:
        slices = kclient.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
            POOL.namespace, label_selector=f"kubernetes.io/service-name={POOL.service}"
        )
    return sum(
        1 for s in slices.items for e in s.endpoints or [] if e.conditions is not None and e.conditions.ready
    )


async def one_round(temporal: Client, grace_s: float, index: int) -> tuple[float, float]:
    scenario = compressed_scenario("gpu-node-loss", node_monitor_grace_s=grace_s)
    sim = await asyncio.to_thread(start_sim, scenario, 1.0)
    try:
        import httpx

        settings = load_settings(
            temporal_address=temporal.service_client.config.target_host,
            task_queue=f"bench-sla-{index}",
            fastpath_lease_namespace="fleetmend",
            fastpath_lease_duration_s=3.0,
            fastpath_renew_deadline_s=2.0,
            fastpath_retry_period_s=0.5,
            fastpath_watch_timeout_s=10,
            **settings_for_running_sim(sim),
        )

        async def same_client() -> Client:
            return temporal

        fast = build_fast_path(settings, same_client, identity=f"bench-{index}")
        not_ready_at: list[float] = []
        original = fast._on_node

        def on_node(kind: str, node: dict[str, Any]) -> None:
            ready = next(
                (c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"),
                None,
            )
            if (
                (node.get("metadata") or {}).get("name") == "gpu-node-0"
                and ready
                and ready.get("status") != "True"
            ):
                if not not_ready_at:
                    not_ready_at.append(time.time())
            original(kind, node)

        fast._on_node = on_node  # type: ignore[method-assign]
        stop = asyncio.Event()
        task = asyncio.create_task(fast.run(stop))
        async with httpx.AsyncClient(base_url=str(sim.base_url), timeout=10) as http:
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(ready_endpoints, sim.kubeconfig) < 5:
                assert time.monotonic() < deadline, "the pool never came up"
                await asyncio.sleep(0.5)
            while not (fast.elector.leading and all(i.lists for i in fast.informers)):
                await asyncio.sleep(0.1)
            await asyncio.sleep(2)  # a few healthy probes
            fault_at = time.time()
            r = await http.post(
                "/sim/v1/faults", json={"kind": FaultKind.NODE_LOST.value, "target": "gpu-node-0"}
            )
            r.raise_for_status()
        handle = temporal.get_workflow_handle(incident_workflow_id(POOL))
        opened: float | None = None
        deadline = time.monotonic() + grace_s + 30
        while opened is None or not not_ready_at:
            assert time.monotonic() < deadline, "no incident / no NotReady in time"
            if opened is None:
                try:
                    desc = await handle.describe()
                    if desc.start_time is not None and desc.start_time.timestamp() >= fault_at - 1:
                        opened = desc.start_time.timestamp()
                except Exception:
                    pass
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(task, 20)
        await handle.terminate("bench round over")
        return opened - fault_at, not_ready_at[0] - fault_at
    finally:
        await asyncio.to_thread(sim.stop)


async def main(rounds: int, grace_s: float) -> None:
    env = await throwaway_dev_server()
    fast: list[float] = []
    node: list[float] = []
    async with env:
        for i in range(rounds):
            a, b = await one_round(env.client, grace_s, i)
            fast.append(a)
            node.append(b)
            print(
                f"round {i + 1}: fast path incident opened {a:.2f} s; node NotReady (alert path starts) {b:.2f} s"
            )
    print(f"\nfault -> ... over {rounds} GPU-node losses (node-monitor grace {grace_s:g} s)")
    print(f"{'':38} {'p50':>7} {'p99':>7} {'max':>7}")
    for name, values in (
        ("fast path: incident opened", fast),
        ("alert path: node NotReady (a floor)", node),
    ):
        print(f"{name:38} {statistics.median(values):7.2f} {quantile(values, 0.99):7.2f} {max(values):7.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--grace", type=float, default=50.0, help="node-monitor grace in seconds")
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.grace))
