"""CPU cost of the simulated serving layer under load (it shares 2 cores with Temporal and Postgres).

Serves the shipped ``gpu-node-loss`` scenario (6 serving replicas + 1 warm spare) with
the serving layer attached and drives open-loop load through the router in-process,
then prints CPU seconds per wall second and per request.

Run:  .venv/bin/python bench/sim_serving_cost.py [--rate 30] [--speed 1] [--duration 60]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from sim.app import BoundPorts, serve
from sim.scenario import load_scenario, shipped_scenarios
from sim.serving.layer import ServingLayer
from sim.serving.loadgen import start_load
from sim.world import SimWorld


async def main(rate: float, speed: float, duration: float) -> None:
    world = SimWorld(load_scenario(shipped_scenarios()["gpu-node-loss"]), speed=speed)
    stop = asyncio.Event()
    bound: asyncio.Future[BoundPorts] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(world, "127.0.0.1", 0, ready=bound.set_result, stop=stop))
    await bound
    layer: ServingLayer = world.serving  # type: ignore[attr-defined]
    world.clock.advance(600)  # skip start-up: pull + load + warm-up
    for _ in range(200):  # up to 10 s for the pool to be routed
        routed = len(layer.router.routing_set("inference/llama").endpoints)
        if routed >= 6:
            break
        await asyncio.sleep(0.05)
    cpu0, wall0 = time.process_time(), time.monotonic()
    report = await start_load(layer, rate, duration_s=duration, seed=1).wait()
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    stop.set()
    await asyncio.wait_for(task, 15)
    print(
        f"scenario gpu-node-loss: {routed} routed replicas, load {rate:g} req/s sim for {duration:g} s sim at speed {speed:g}"
    )
    print(f"  requests {report.sent}, goodput {report.goodput}, late {report.late}, shed {report.shed}")
    print(
        f"  wall {wall:.1f}s, CPU {cpu:.2f}s -> {cpu / wall:.2f} cores busy, {1000 * cpu / max(1, report.sent):.2f} ms CPU/request"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=30.0)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=60.0)
    args = parser.parse_args()
    asyncio.run(main(args.rate, args.speed, args.duration))
