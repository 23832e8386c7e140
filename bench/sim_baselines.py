"""Figures of the baselines fleetmend is compared against, measured on the simulator.

1. Kubernetes-default deroute: how long (sim seconds) a dead replica stays in the routing set when
   only Kubernetes acts (readiness probe period x failure threshold, node-monitor grace), and how
   many user requests it answers with a failure meanwhile, through an Envoy that routes equal
   shares and does not retry (``KUBERNETES_DEFAULT_POLICY``), its own health checks a minute apart
   and fleetmend's ejection out of reach (Envoy's default outlier rule, 5 consecutive 5xx, stays).
2. Naive scale-down: deleting a pod that is streaming, with vLLM's default
   ``--shutdown-timeout=0``, versus a drain (shutdown timeout 30 s).

Users' requests go load generator -> Envoy (configured by fleetmend's control plane from the
simulator's Kubernetes API) -> engines on their pod IPs; the ledger's Postgres is a scratch one.

Run:  .venv/bin/python -m bench.sim_baselines [--speed 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from activities.envoy_gateway import EnvoyGateway
from fleet.incident import PoolRef
from fleet.vocabulary import FaultKind, Tier
from gateway.resources import DataPlaneSettings
from gateway.store import GatewayStore
from ledger.migrate import upgrade_head
from ledger.scratch import acquire_server
from ledger.store import make_engine
from sim.control import FaultRequest
from sim.scenario import parse_scenario
from sim.serving.baselines import KUBERNETES_DEFAULT_POLICY, KubernetesDefaults, measure_deroute
from sim.serving.kubeview import routed_pods
from sim.serving.layer import ServingLayer
from sim.serving.loadgen import RequestResult, start_load
from sim.world import SimWorld
from worker.devstack.gateway import serve_behind_envoy

NS = "inference"
POOL = f"{NS}/llama"
POOL_REF = PoolRef(namespace=NS, service="llama")
# Envoy as a plain Kubernetes Service would route: no active health checks to speak of, no
# fleetmend ejection rule in reach.
KUBERNETES_LIKE = DataPlaneSettings(health_check_interval_s=60, consecutive_gateway_failure=1000)
DEFAULTS = KubernetesDefaults()

SCENARIO: dict[str, Any] = {
    "name": "bench-baselines",
    "namespace": NS,
    "timings": {"node_monitor_grace_s": DEFAULTS.node_monitor_grace_s, "crash_loop_backoff_s": 10.0},
    "nodes": [
        {"prefix": "gpu-node", "count": 2, "gpus": 8, "labels": {"topology.kubernetes.io/zone": "zone-a"}}
    ],
    "models": [
        {
            "name": "llama-8b",
            "served_name": "meta-llama/Llama-3.1-8B-Instruct",
            "gpus_per_pod": 4,
            "image_pull_s": 1,
            "weight_load_s": 2,
            "warm_up_s": 0,
            "warm_rate_tokens_per_s": 400,
            "shutdown_timeout_s": 0,
            "termination_grace_s": 30,
            "revisions": [{"name": "r1", "image": "vllm/vllm-openai:v0.10.2", "engine_version": "0.10.2"}],
        }
    ],
    "workloads": [{"name": "llama", "model": "llama-8b", "replicas": 4}],
    "load": {
        "probe_period_s": DEFAULTS.probe_period_s,
        "probe_failure_threshold": DEFAULTS.probe_failure_threshold,
        "engine": {"max_tokens_per_seq_s": 4.0},
    },
}


@contextlib.asynccontextmanager
async def simulator(speed: float, **model: Any) -> AsyncIterator[tuple[SimWorld, ServingLayer]]:
    data = copy.deepcopy(SCENARIO)
    data["models"][0].update(model)
    world = SimWorld(parse_scenario(data), speed=speed)
    pg = acquire_server()
    url = pg.create_database("baselines")
    upgrade_head(url)
    engine = make_engine(url, pool_size=2)
    try:
        with tempfile.TemporaryDirectory(prefix="fleetmend-baselines-") as work:
            async with serve_behind_envoy(world, url, Path(work), KUBERNETES_LIKE):
                layer: ServingLayer = world.serving  # type: ignore[attr-defined]
                envoy = EnvoyGateway(GatewayStore(engine))
                while (
                    len(routed_pods(layer.kube, POOL)) < 4 or len(envoy.routing_set(POOL_REF).endpoints) < 4
                ):
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(envoy.apply, POOL_REF, KUBERNETES_DEFAULT_POLICY)
                yield world, layer
    finally:
        engine.dispose()
        pg.drop_database(url)


async def deroute_case(
    speed: float, label: str, kind: FaultKind, on_node: bool, **params: Any
) -> dict[str, Any]:
    async with simulator(speed) as (world, layer):
        load = start_load(
            layer, 8.0, duration_s=600.0, seed=1, tiers={Tier.STANDARD: 1.0}, output_tokens=(8, 16)
        )
        await world.clock.sleep(5.0)
        victim, node = routed_pods(layer.kube, POOL)[0]
        target = node if on_node else f"{NS}/{victim}"
        assert target is not None
        if kind == FaultKind.GPU_XID:
            params = {"gpu": _gpu_of(layer, node or "", victim), **params}
        measured = await measure_deroute(
            layer, POOL, victim, FaultRequest(kind=kind, target=target, params=params), load=load
        )
        await load.stop()
        pod = layer.kube.pod(NS, victim) or {}
        probe = layer.prober.settings_for(pod)
        return {
            "case": label,
            "deroute_s": measured.sim_seconds_to_deroute,
            "failed_requests": measured.requests_failed_on_replica,
            "probe_floor_s": probe.period_s * (probe.failure_threshold - 1),
            "probe_ceiling_s": probe.period_s * probe.failure_threshold,
            "probe": f"{probe.period_s:g}s x {probe.failure_threshold}",
        }


def _gpu_of(layer: ServingLayer, node: str, pod: str) -> int:
    from sim.serving.telemetry import gpu_assignment

    return next(i for i, p in gpu_assignment(layer.kube, node).items() if p["metadata"]["name"] == pod)


def _ended_of_first(results: list[RequestResult], sent: int) -> int:
    """How many of the first ``sent`` requests of a load have ended (ids end in their number)."""
    return sum(1 for r in results if int(r.request_id.rsplit("-", 1)[1]) <= sent)


async def scale_down_case(speed: float, shutdown_timeout_s: float) -> dict[str, Any]:
    async with simulator(speed, shutdown_timeout_s=shutdown_timeout_s) as (world, layer):
        load = start_load(
            layer, 12.0, duration_s=600.0, seed=2, tiers={Tier.STANDARD: 1.0}, output_tokens=(16, 32)
        )
        await world.clock.sleep(20.0)
        victim = routed_pods(layer.kube, POOL)[0][0]
        engine = layer.supervisor.get(f"{NS}/{victim}")
        assert engine is not None
        in_flight = engine.num_running + engine.num_waiting
        start, since, sent = world.clock.now(), load.sim_now(), load.sent
        world.control.delete("pods", NS, victim)  # what `kubectl delete pod` / a plain scale-down does
        world.kick()
        while world.store.find("pods", NS, victim) is not None and world.clock.now() - start < 120:
            await world.clock.sleep(0.1)
        gone_after = world.clock.now() - start
        # Every request sent before the delete has ended (a cut stream reaches its user through
        # Envoy in wall time, whatever the sim's speed).
        while _ended_of_first(load.results, sent) < sent and world.clock.now() - start < 600:
            await world.clock.sleep(0.5)
        await load.stop()
        # The victim's requests that ended after the delete, as their users saw them (it was healthy
        # before: every cut stream is the delete's).
        ended = [r for r in load.results if r.replica == victim and r.arrived_at + (r.e2e_s or 0.0) >= since]
        cut = [
            r
            for r in load.results
            if r.replica == victim and r.status == 200 and r.outcome == "terminal_error"
        ]
        return {
            "shutdown_timeout_s": shutdown_timeout_s,
            "in_flight_at_delete": in_flight,
            "truncated": len(cut),
            "completed": sum(1 for r in ended if r.outcome in ("goodput", "late")),
            "pod_gone_after_s": round(gone_after, 1),
        }


async def main(speed: float) -> None:
    print("Kubernetes-default path: time until the gateway stops routing to a dead replica (sim seconds)")
    print(
        "  readiness probe from the pod spec (period x failureThreshold); "
        f"node-monitor grace {DEFAULTS.node_monitor_grace_s:g}s; Envoy: equal shares, no retries"
    )
    cases = [
        (
            "Xid 79, API server stays up answering 503 (keep-alive)",
            FaultKind.GPU_XID,
            True,
            {"code": 79, "keep_alive": True},
        ),
        ("Xid 79, process exits after vLLM's 5 s watchdog", FaultKind.GPU_XID, True, {"code": 79}),
        ("node lost (kubelet silent)", FaultKind.NODE_LOST, True, {}),
    ]
    for label, kind, on_node, params in cases:
        row = await deroute_case(speed, label, kind, on_node, **params)
        deroute = row["deroute_s"]
        shown = f"{deroute:6.1f}s" if deroute is not None else "  never"
        print(
            f"  {label:56s} deroute after {shown} (probe {row['probe']}: "
            f"{row['probe_floor_s']:g}-{row['probe_ceiling_s']:g}s); "
            f"user requests failed on it: {row['failed_requests']}"
        )
    print()
    print("Naive scale-down: delete a streaming pod (termination grace 30 s)")
    for timeout in (0.0, 30.0):
        row = await scale_down_case(speed, timeout)
        print(
            f"  --shutdown-timeout={timeout:<4g} in flight {row['in_flight_at_delete']:3d} -> streams truncated "
            f"{row['truncated']:3d}, completed {row['completed']:3d}; pod gone after {row['pod_gone_after_s']}s"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, default=20.0, help="sim clock speed factor")
    asyncio.run(main(parser.parse_args().speed))
