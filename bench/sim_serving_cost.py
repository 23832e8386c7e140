"""CPU cost of the simulated serving layer under load (it shares 2 cores with Temporal and Postgres).

Serves the shipped ``gpu-node-loss`` scenario (5 serving replicas + 1 warm spare) with the serving
layer attached, puts Envoy and fleetmend's control plane in front of its engines (as the dev stack
does; the ledger's Postgres is a scratch one) and drives open-loop load through Envoy, then prints
CPU seconds per wall second and per request: this process (the simulator, its engines' servers,
the load generator and the control plane) and Envoy's.

Run:  .venv/bin/python -m bench.sim_serving_cost [--rate 30] [--speed 1] [--duration 60]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from ledger.migrate import upgrade_head
from ledger.scratch import acquire_server
from sim.scenario import load_scenario, shipped_scenarios
from sim.serving.kubeview import routed_pods
from sim.serving.layer import ServingLayer
from sim.serving.loadgen import start_load
from sim.world import SimWorld
from worker.devstack.gateway import serve_behind_envoy


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process (``/proc/<pid>/stat``, fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main(rate: float, speed: float, duration: float) -> None:
    world = SimWorld(load_scenario(shipped_scenarios()["gpu-node-loss"]), speed=speed)
    pg = acquire_server()
    url = pg.create_database("serving-cost")
    upgrade_head(url)
    try:
        with tempfile.TemporaryDirectory(prefix="fleetmend-serving-cost-") as work:
            async with serve_behind_envoy(world, url, Path(work)) as (_, gateway):
                layer: ServingLayer = world.serving  # type: ignore[attr-defined]
                world.clock.advance(600)  # skip start-up: pull + load + warm-up
                for _ in range(200):  # up to 10 s for the pool to be routed
                    routed = len(routed_pods(layer.kube, "inference/llama"))
                    if routed >= 5:
                        break
                    await asyncio.sleep(0.05)
                assert gateway.envoy is not None and gateway.envoy.proc is not None
                envoy = gateway.envoy.proc.pid
                envoy0 = process_cpu_s(envoy)
                cpu0, wall0 = time.process_time(), time.monotonic()
                report = await start_load(world, rate, duration_s=duration, seed=1).wait()
                cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
                envoy_cpu = process_cpu_s(envoy) - envoy0
    finally:
        pg.drop_database(url)
    print(
        f"scenario gpu-node-loss: {routed} routed replicas, load {rate:g} req/s sim for {duration:g} s sim at speed {speed:g}, through Envoy"
    )
    print(f"  requests {report.sent}, goodput {report.goodput}, late {report.late}, shed {report.shed}")
    print(
        f"  wall {wall:.1f}s, CPU {cpu:.2f}s -> {cpu / wall:.2f} cores busy, {1000 * cpu / max(1, report.sent):.2f} ms CPU/request"
    )
    print(
        f"  Envoy: CPU {envoy_cpu:.2f}s -> {envoy_cpu / wall:.2f} cores busy, "
        f"{1000 * envoy_cpu / max(1, report.sent):.2f} ms CPU/request"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=30.0)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=60.0)
    args = parser.parse_args()
    asyncio.run(main(args.rate, args.speed, args.duration))
