"""The gateway control plane's idle cost on a large world: every pool rebuilt on every refresh
(as it was) against rebuilt on change, per pool (as it is), printed side by side.

As it was: every ``--refresh-s`` (0.1 s, as ``fleetmend dev`` ran it) the plane walked every Service,
EndpointSlice and Pod, read every policy row and compared the whole input. As it is: a watch event
or a policy write (Postgres NOTIFY) wakes it, it recomputes and renders only the pools touched, and
checks the policies' highest revision with one query every 2 s in case a notification went unheard.

The world: the shipped ``gpu-node-loss`` scenario grown to ``--nodes`` GPU nodes and ``--pools``
Deployments (5 routed TP=4 replicas + 1 warm spare each), served by ``fleetmend sim`` in its own
process. This process runs the control plane (its ADS server, its three Kubernetes watches of the
sim's API and its Postgres store) and nothing else; no Envoy is connected, so what is measured is
the refresh loop itself. Each plane runs alone for ``--seconds`` while nothing happens in the
world; then one pool's rebuild is timed (a pod derouted: the full rebuild renders every pool, the
per-pool one that pool and the snapshot's O(pools) assembly).

Printed and written to ``docs/gateway-refresh.json``: CPU % of one core of this process (and of the
Postgres server answering the refreshes), refreshes/s, snapshots built and pools rendered while idle,
and the cost of one pool's change.

Run:  .venv/bin/python -m bench.gateway_refresh [--nodes 512] [--pools 128] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from gateway.resources import DataPlaneSettings, RoutedHost
from gateway.run import hosts_reader, run_forever
from gateway.server import ControlPlane, Snapshot, assemble, build_snapshot, render_pool
from gateway.store import GatewayStore
from gateway.world import RoutingWatch, hosts_from
from ledger.migrate import upgrade_head
from ledger.scratch import acquire_server
from ledger.store import make_engine
from worker.devstack.rig import compressed_scenario
from worker.devstack.sim_process import start_sim_process

OUT = Path(__file__).resolve().parent.parent / "docs" / "gateway-refresh.json"
REPLICAS = 5
REFRESH_S = 0.1  # the refresh interval of the control plane in `fleetmend dev` (ControlPlaneThread)


class FullRebuildPlane(ControlPlane):
    """The control plane as it was: every ``refresh_s`` it walks every Service, EndpointSlice and
    Pod for the hosts, reads every policy row, and compares the whole input before deciding."""

    def __init__(
        self, read: Callable[[], dict[str, tuple[RoutedHost, ...]]], store: GatewayStore, refresh_s: float
    ) -> None:
        super().__init__(read, store, refresh_s=refresh_s)
        self._inputs: object = None

    async def refresh(self, *, check_policies: bool = True) -> Snapshot:
        self.refreshes += 1
        hosts, policies = await asyncio.gather(
            asyncio.to_thread(self._read_hosts), asyncio.to_thread(self.store.all)
        )
        inputs = (tuple(sorted(hosts.items())), tuple(sorted((p.pool, p.revision) for p in policies)))
        if self.snapshot is not None and inputs == self._inputs:
            return self.snapshot
        self._inputs = inputs
        fresh = build_snapshot(hosts, policies, self.data_plane)
        self.snapshots_built += 1
        self.pools_rendered += len(fresh.pools)
        async with self._changed:
            self.snapshot = fresh
            self._changed.notify_all()
        return fresh

    async def run_refresh(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.refresh()
            await asyncio.sleep(self.refresh_s)


def world(nodes: int, pools: int) -> Any:
    """``gpu-node-loss`` with ``nodes`` nodes and ``pools`` copies of its pool, quick to start."""
    base = compressed_scenario("gpu-node-loss", startup_s=2.0, warm_up_s=2.0, rollout_at_s=None)
    group = base.nodes[0].model_copy(update={"count": nodes, "node_labels": {}})
    template = base.workloads[0]
    workloads = [
        template.model_copy(
            update={
                "name": f"llama-{i:03d}",
                "replicas": REPLICAS,
                "service": template.service,
                "rollout": None,
            }
        )
        for i in range(pools)
    ]
    return base.model_copy(
        update={"name": f"gateway-refresh-{nodes}", "nodes": [group], "workloads": workloads, "faults": []}
    )


def _cpu(proc: psutil.Process, children: bool = False) -> float:
    procs = [proc, *(proc.children(recursive=True) if children else [])]
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def measure_idle(plane: ControlPlane, pg: psutil.Process | None, seconds: float) -> dict[str, Any]:
    """Run ``plane`` (ADS server + refresh loop) on a thread for ``seconds`` of a quiet world."""
    stop_box: list[asyncio.Event] = []
    ready = threading.Event()
    loop_box: list[asyncio.AbstractEventLoop] = []

    def main() -> None:
        loop = asyncio.new_event_loop()
        loop_box.append(loop)
        stop = asyncio.Event()
        stop_box.append(stop)
        loop.run_until_complete(run_forever(plane, "127.0.0.1", 0, lambda _port: ready.set(), stop))
        loop.close()

    thread = threading.Thread(target=main, name="bench-xds", daemon=True)
    thread.start()
    assert ready.wait(60), "the control plane did not start"
    time.sleep(2.0)  # let the first refreshes and the first snapshot pass before measuring
    me = psutil.Process()
    before = (time.monotonic(), _cpu(me), _cpu(pg, True) if pg else 0.0, plane.refreshes)
    built, rendered = plane.snapshots_built, plane.pools_rendered
    time.sleep(seconds)
    after = (time.monotonic(), _cpu(me), _cpu(pg, True) if pg else 0.0, plane.refreshes)
    loop_box[0].call_soon_threadsafe(stop_box[0].set)
    thread.join(15)
    wall = after[0] - before[0]
    return {
        "cpu_percent": round(100 * (after[1] - before[1]) / wall, 2),
        "postgres_cpu_percent": round(100 * (after[2] - before[2]) / wall, 2),
        "refreshes_per_s": round((after[3] - before[3]) / wall, 2),
        "snapshots_built_idle": plane.snapshots_built - built,
        "pools_rendered_idle": plane.pools_rendered - rendered,
        "seconds": round(wall, 1),
    }


def one_pool_change(watch: RoutingWatch, store: GatewayStore, reps: int = 10) -> dict[str, float]:
    """Milliseconds to rebuild after one pool lost a host: all pools rendered, or that one pool."""
    dp = DataPlaneSettings()
    hosts = dict(watch())
    policies = store.all()
    by_pool = {p.pool: p for p in policies}
    pool = sorted(hosts)[0]
    changed = dict(hosts)
    changed[pool] = hosts[pool][1:]
    builds = {name: render_pool(name, routed, by_pool.get(name), dp) for name, routed in hosts.items()}

    def full() -> None:
        build_snapshot(changed, policies, dp)

    def per_pool() -> None:
        fresh = dict(builds)
        fresh[pool] = render_pool(pool, changed[pool], by_pool.get(pool), dp)
        assemble(fresh)

    def hosts_full() -> None:
        hosts_from(*(list(i.cache.values()) for i in watch.informers))

    def hosts_read() -> None:
        watch()

    out = {}
    for name, fn in (("rebuild_full_ms", full), ("rebuild_one_pool_ms", per_pool),
                     ("hosts_full_walk_ms", hosts_full), ("hosts_read_unchanged_ms", hosts_read)):  # fmt: skip
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = round(1000 * (time.perf_counter() - start) / reps, 3)
    return out


async def _wait_routed(watch: RoutingWatch, want: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    routed = 0
    while time.monotonic() < deadline:
        routed = sum(len(h) for h in watch().values())
        if routed >= want:
            return routed
        await asyncio.sleep(0.5)
    raise SystemExit(f"only {routed} of {want} engines routed after {timeout_s:g} s")


def run(nodes: int, pools: int, seconds: float, refresh_s: float) -> dict[str, Any]:
    pg_server = acquire_server()
    tmp = Path(tempfile.mkdtemp(prefix="fleetmend-gw-refresh-"))
    sim = None
    try:
        url = pg_server.create_database("gwrefresh")
        upgrade_head(url)
        store = GatewayStore(make_engine(url, pool_size=2, max_overflow=2))
        scenario_path = tmp / "scenario.yaml"
        import yaml

        scenario_path.write_text(
            yaml.safe_dump(world(nodes, pools).model_dump(mode="json", exclude_none=True))
        )
        sim = asyncio.run(start_sim_process(scenario_path, tmp / "sim", timeout_s=90))
        watch = hosts_reader(sim.kubeconfig, None)
        try:
            started = time.monotonic()
            routed = asyncio.run(_wait_routed(watch, pools * REPLICAS, 90))
            print(
                f"world: {nodes} nodes, {pools} pools, {routed} routed engines ({time.monotonic() - started:.0f} s)"
            )
            pg = _postgres_process(url)
            caches = [i.cache for i in watch.informers]
            old = FullRebuildPlane(lambda: hosts_from(*(list(c.values()) for c in caches)), store, refresh_s)
            before = measure_idle(old, pg, seconds)
            new = ControlPlane(watch, store, refresh_s=refresh_s)
            after = measure_idle(new, pg, seconds)
            change = one_pool_change(watch, store)
        finally:
            watch.stop()
        return {
            "nodes": nodes,
            "pools": pools,
            "routed_engines": routed,
            "refresh_s": refresh_s,
            "policy_check_s": new.policy_check_s,
            "full_rebuild_every_refresh": before,
            "per_pool_rebuild_on_change": after,
            "one_pool_change": change,
        }
    finally:
        if sim is not None:
            sim.stop()
        pg_server.stop()


def _postgres_process(url: str) -> psutil.Process | None:
    """The Postgres server's postmaster (its backends are its children), when it runs on this
    machine: found by its Unix socket directory, or by its TCP port."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    socket_dir = parsed.query.get("host")
    socket_dir = socket_dir if isinstance(socket_dir, str) else parsed.host
    if socket_dir and socket_dir.startswith("/"):
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if cmdline and cmdline[0].endswith("/postgres") and socket_dir.rstrip("/") in cmdline:
                return proc
        return None
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == parsed.port and conn.pid:
            return psutil.Process(conn.pid)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=512)
    parser.add_argument("--pools", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=20.0, help="idle window per plane")
    parser.add_argument("--refresh-s", type=float, default=REFRESH_S, help="the planes' refresh interval")
    args = parser.parse_args()
    result = run(args.nodes, args.pools, args.seconds, args.refresh_s)
    b, a, c = (
        result["full_rebuild_every_refresh"],
        result["per_pool_rebuild_on_change"],
        result["one_pool_change"],
    )
    rows = [
        ("control plane CPU, % of a core", b["cpu_percent"], a["cpu_percent"]),
        ("Postgres CPU, % of a core", b["postgres_cpu_percent"], a["postgres_cpu_percent"]),
        ("refreshes/s", b["refreshes_per_s"], a["refreshes_per_s"]),
        ("snapshots built while idle", b["snapshots_built_idle"], a["snapshots_built_idle"]),
        ("hosts read, ms (nothing changed)", c["hosts_full_walk_ms"], c["hosts_read_unchanged_ms"]),
        ("rebuild after one pool changed, ms", c["rebuild_full_ms"], c["rebuild_one_pool_ms"]),
    ]
    print(f"\n{'idle, ' + str(result['nodes']) + ' nodes / ' + str(result['pools']) + ' pools':<40}"
          f"{'full rebuild':>14}{'per pool':>12}")  # fmt: skip
    for name, old, new in rows:
        print(f"{name:<40}{old:>14}{new:>12}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten: {OUT}")


if __name__ == "__main__":
    main()
