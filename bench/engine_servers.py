"""Cost of every engine listening on its own pod IP: memory and file descriptors per pod, tick cost,
and CPU per request over a pod socket.

Serves a world of ``--pods`` single-GPU serving pods (``--pods / 8`` nodes x 8 GPUs), first with
the engine servers off, then on, and prints the difference per pod: resident memory, open file
descriptors, and the time one ``EngineServers.sync()`` (run every serving tick) takes. Then
sends ``--requests`` streamed completions straight to pod IPs (round robin, over real sockets)
and prints CPU milliseconds per request.

Run:  .venv/bin/python bench/engine_servers.py [--pods 300] [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time
from typing import Any

import httpx

from sim.app import BoundPorts, serve
from sim.scenario import parse_scenario
from sim.serving.layer import ServingLayer
from sim.world import SimWorld

MODEL = "bench/model"


def scenario(pods: int) -> Any:
    return parse_scenario(
        {
            "name": "engine-servers-bench",
            "namespace": "bench",
            "seed": 1,
            "nodes": [{"prefix": "gpu-node", "count": max(1, -(-pods // 8)), "gpus": 8}],
            "models": [
                {
                    "name": "bench-model",
                    "served_name": MODEL,
                    "gpus_per_pod": 1,
                    "image_pull_s": 0,
                    "weight_load_s": 0,
                    "warm_up_s": 0,
                    "warm_rate_tokens_per_s": 4000,
                    "kv_capacity_tokens": 400000,
                    "max_num_seqs": 256,
                    "revisions": [
                        {"name": "r1", "image": "vllm/vllm-openai:v0.12.0", "engine_version": "0.12.0"}
                    ],
                }
            ],
            "workloads": [
                {
                    "name": "pool",
                    "model": "bench-model",
                    "kind": "Deployment",
                    "replicas": pods,
                    "service": {"port": 80},
                }
            ],
            "load": {"serve_engines": False, "engine": {"max_tokens_per_seq_s": 4000}},
        }
    )


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def wait_until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def main(pods: int, requests: int) -> None:
    world = SimWorld(scenario(pods), speed=1.0)
    stop = asyncio.Event()
    bound: asyncio.Future[BoundPorts] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(world, "127.0.0.1", 0, ready=bound.set_result, stop=stop))
    await bound
    layer: ServingLayer = world.serving  # type: ignore[attr-defined]
    engines = layer.supervisor.engines
    await wait_until(lambda: sum(e.alive for e in engines().values()) >= pods, 60, f"{pods} engines")
    await asyncio.sleep(0.5)
    c0, w0 = cpu_s(), time.monotonic()
    await asyncio.sleep(3)
    idle_off = (cpu_s() - c0) / (time.monotonic() - w0)
    rss0, fd0 = rss_kib(), open_fds()
    layer.settings.serve_engines = True
    await wait_until(lambda: len(layer.engine_servers.listening()) >= pods, 60, f"{pods} listening engines")
    await asyncio.sleep(0.5)
    rss1, fd1 = rss_kib(), open_fds()
    t0 = time.perf_counter()
    for _ in range(200):
        layer.engine_servers.sync()
    sync_ms = (time.perf_counter() - t0) / 200 * 1000
    print(
        f"{pods} engines listening on their pod IPs ({layer.engine_servers.listening()[next(iter(engines()))]} ...)"
    )
    print(
        f"  memory +{(rss1 - rss0) / 1024:.1f} MiB = {(rss1 - rss0) / pods:.1f} KiB/pod; "
        f"file descriptors +{fd1 - fd0} = {(fd1 - fd0) / pods:.2f}/pod (idle, no connection open)"
    )
    print(f"  EngineServers.sync() (every tick): {sync_ms:.3f} ms with {pods} pods")

    # Idle CPU of the serving layer with every socket open (no traffic).
    c0, w0 = cpu_s(), time.monotonic()
    await asyncio.sleep(3)
    idle_on = (cpu_s() - c0) / (time.monotonic() - w0)
    print(
        f"  idle CPU: {idle_off:.3f} cores busy without the engine servers, {idle_on:.3f} with {pods} idle sockets"
    )

    urls = [f"http://{a}" for a in layer.engine_servers.listening().values()]
    body = {"model": MODEL, "max_tokens": 16, "stream": True, "prompt_tokens": 64}
    sem = asyncio.Semaphore(32)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as client:

        async def one(i: int) -> int:
            async with sem, client.stream("POST", urls[i % len(urls)] + "/v1/completions", json=body) as r:
                return len([line async for line in r.aiter_lines() if line == "data: [DONE]"])

        c0, w0 = cpu_s(), time.monotonic()
        done = sum(await asyncio.gather(*(one(i) for i in range(requests))))
        cpu, wall = cpu_s() - c0, time.monotonic() - w0
    print(
        f"  {done}/{requests} streamed completions (16 tokens) over pod sockets, client in the same process: "
        f"{1000 * cpu / requests:.2f} ms CPU/request ({wall:.1f}s wall)"
    )
    stop.set()
    await asyncio.wait_for(task, 30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pods", type=int, default=300)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    asyncio.run(main(args.pods, args.requests))
