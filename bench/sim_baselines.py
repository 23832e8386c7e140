"""Figures of the baselines fleetmend is compared against, measured on the simulator.

1. Kubernetes-default deroute: how long (sim seconds) the gateway keeps routing to a
   dead replica when only Kubernetes acts (readiness probe period x failure threshold,
   node-monitor grace, equal-share routing, no gateway retries), and how many user
   requests fail meanwhile.
2. Naive scale-down: deleting a pod that is streaming, with vLLM's default
   ``--shutdown-timeout=0``, versus a drain (shutdown timeout 30 s).

Run:  .venv/bin/python bench/sim_baselines.py [--speed 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator
from typing import Any

from sim.control import FaultRequest

from fleet.gateway import Outcome
from fleet.vocabulary import FaultKind, Tier
from sim.app import BoundPorts, serve
from sim.scenario import parse_scenario
from sim.serving.baselines import KubernetesDefaults, apply_kubernetes_default_routing, measure_deroute
from sim.serving.layer import ServingLayer
from sim.serving.loadgen import start_load
from sim.world import SimWorld

NS = "inference"
POOL = f"{NS}/llama"
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
    stop = asyncio.Event()
    bound: asyncio.Future[BoundPorts] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(world, "127.0.0.1", 0, ready=bound.set_result, stop=stop))
    await bound
    layer: ServingLayer = world.serving  # type: ignore[attr-defined]
    try:
        while len(layer.router.routing_set(POOL).endpoints) < 4:
            await asyncio.sleep(0.02)
        apply_kubernetes_default_routing(layer, POOL)
        yield world, layer
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def deroute_case(
    speed: float, label: str, kind: FaultKind, on_node: bool, **params: Any
) -> dict[str, Any]:
    async with simulator(speed) as (world, layer):
        load = start_load(
            layer, 8.0, duration_s=600.0, seed=1, tiers={Tier.STANDARD: 1.0}, output_tokens=(8, 16)
        )
        await world.clock.sleep(5.0)
        victim = layer.router.routing_set(POOL).endpoints[0]
        target = victim.node if on_node else f"{NS}/{victim.pod}"
        assert target is not None
        if kind == FaultKind.GPU_XID:
            params = {"gpu": _gpu_of(layer, victim.node or "", victim.pod), **params}
        measured = await measure_deroute(
            layer, POOL, victim.pod, FaultRequest(kind=kind, target=target, params=params)
        )
        await load.stop()
        failed = [
            e
            for e in layer.journal.query(pool=POOL, replica=victim.pod, limit=1_000_000).entries
            if e.outcome == Outcome.TERMINAL_ERROR
        ]
        pod = layer.kube.pod(NS, victim.pod) or {}
        probe = layer.prober.settings_for(pod)
        return {
            "case": label,
            "deroute_s": measured.sim_seconds_to_deroute,
            "failed_requests": len(failed),
            "probe_floor_s": probe.period_s * (probe.failure_threshold - 1),
            "probe_ceiling_s": probe.period_s * probe.failure_threshold,
            "probe": f"{probe.period_s:g}s x {probe.failure_threshold}",
        }


def _gpu_of(layer: ServingLayer, node: str, pod: str) -> int:
    from sim.serving.telemetry import gpu_assignment

    return next(i for i, p in gpu_assignment(layer.kube, node).items() if p["metadata"]["name"] == pod)


async def scale_down_case(speed: float, shutdown_timeout_s: float) -> dict[str, Any]:
    async with simulator(speed, shutdown_timeout_s=shutdown_timeout_s) as (world, layer):
        load = start_load(
            layer, 12.0, duration_s=600.0, seed=2, tiers={Tier.STANDARD: 1.0}, output_tokens=(16, 32)
        )
        await world.clock.sleep(20.0)
        victim = layer.router.routing_set(POOL).endpoints[0].pod
        engine = layer.supervisor.get(f"{NS}/{victim}")
        assert engine is not None
        in_flight = engine.num_running + engine.num_waiting
        start = world.clock.now()
        world.control.delete("pods", NS, victim)  # what `kubectl delete pod` / a plain scale-down does
        world.kick()
        while world.store.find("pods", NS, victim) is not None and world.clock.now() - start < 120:
            await world.clock.sleep(0.1)
        gone_after = world.clock.now() - start
        await world.clock.sleep(2.0)
        await load.stop()
        entries = layer.journal.query(pool=POOL, replica=victim, since=start, limit=1_000_000).entries
        return {
            "shutdown_timeout_s": shutdown_timeout_s,
            "in_flight_at_delete": in_flight,
            "truncated": sum(1 for e in entries if e.outcome == Outcome.TERMINAL_ERROR and e.truncated),
            "completed": sum(1 for e in entries if e.outcome in (Outcome.COMPLETED, Outcome.LATE)),
            "pod_gone_after_s": round(gone_after, 1),
        }


async def main(speed: float) -> None:
    print("Kubernetes-default path: time until the gateway stops routing to a dead replica (sim seconds)")
    print(
        "  readiness probe from the pod spec (period x failureThreshold); "
        f"node-monitor grace {DEFAULTS.node_monitor_grace_s:g}s; equal-share routing; no gateway retries"
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
