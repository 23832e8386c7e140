"""What the simulator costs while nothing happens, at 64, 128, 256 and 512 nodes.

For each size, ``fleetmend sim`` serves ``fleet-512`` scaled to that many nodes (``sim.scenario.scaled_scenario``)
behind a real Envoy configured by fleetmend's gateway control plane, which health-checks every routed
engine (``GET /health`` every ``DataPlaneSettings.health_check_interval_s``). Once every engine is
healthy in Envoy, the sim process's CPU (``/proc/<pid>/stat``, user + system) is read over a window,
with its RSS and the health checks Envoy sent meanwhile (its admin stats). No load, no faults: the cost
of holding the fleet, which a bench of fleetmend itself must not mistake for its own.

Run:  .venv/bin/python -m bench.sim_idle [--sizes 64 128 256 512] [--seconds 20] [--interval 0.5]
Prints a table and writes docs/sim-idle.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench._fleet import Fleet, fleet_behind_envoy, process_cpu_seconds, process_rss_mib, routed_endpoints
from gateway.resources import DataPlaneSettings
from ledger.scratch import acquire_server

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "sim-idle.json"


def health_checks_sent(fleet: Fleet) -> int:
    """Health checks Envoy has sent so far, over every cluster (``cluster.*.health_check.attempt``)."""
    text = httpx.get(fleet.gateway.admin_url + "/stats", params={"filter": r"health_check\.attempt$"}).text
    return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.strip())


def measure(fleet: Fleet, settle_s: float, seconds: float) -> dict[str, Any]:
    time.sleep(settle_s)
    pid = fleet.sim_pid
    checks_before, cpu_before, started = health_checks_sent(fleet), process_cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    cpu = 100.0 * (process_cpu_seconds(pid) - cpu_before) / elapsed
    checks = (health_checks_sent(fleet) - checks_before) / elapsed
    _, healthy = fleet.health_checked_hosts()
    return {
        "nodes": fleet.nodes,
        "pools": len(fleet.scenario.workloads),
        "routed_engines": routed_endpoints(fleet.scenario),
        "envoy_hosts_healthy": healthy,
        "health_checks_per_s": round(checks, 1),
        "sim_cpu_percent_of_a_core": round(cpu, 2),
        "sim_rss_mib": round(process_rss_mib(pid), 1),
        "window_s": round(elapsed, 1),
    }


def main(sizes: list[int], seconds: float, interval: float, settle_s: float) -> dict[str, Any]:
    data_plane = DataPlaneSettings(health_check_interval_s=interval)
    rows: list[dict[str, Any]] = []
    pg = acquire_server()
    try:
        for nodes in sizes:
            with tempfile.TemporaryDirectory(prefix=f"fleetmend-sim-idle-{nodes}-") as home:
                started = time.monotonic()
                with fleet_behind_envoy(nodes, Path(home), pg=pg, data_plane=data_plane) as fleet:
                    up_s = time.monotonic() - started
                    row = measure(fleet, settle_s, seconds)
                    row["start_to_all_healthy_s"] = round(up_s, 1)
                    rows.append(row)
                    print(
                        f"{row['nodes']:>5} nodes {row['pools']:>4} pools {row['routed_engines']:>5} engines "
                        f"{row['health_checks_per_s']:>7.0f} checks/s  sim CPU {row['sim_cpu_percent_of_a_core']:5.1f} % "
                        f"of a core  RSS {row['sim_rss_mib']:6.0f} MiB  (up in {up_s:.0f} s)",
                        flush=True,
                    )
    finally:
        pg.stop()
    slope = None
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        slope = round(
            (last["sim_cpu_percent_of_a_core"] - first["sim_cpu_percent_of_a_core"])
            / (last["nodes"] - first["nodes"])
            * 100,
            3,
        )
        print(f"slope: {slope} % of a core per 100 nodes ({first['nodes']} -> {last['nodes']} nodes)")
    result = {
        "what": "the simulator's idle cost (fleetmend sim on fleet-512 scaled), Envoy health-checking every routed engine",
        "health_check_interval_s": interval,
        "window_s": seconds,
        "cpu_percent_per_100_nodes": slope,
        "rows": rows,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--seconds", type=float, default=20.0, help="measuring window per size")
    parser.add_argument(
        "--settle", type=float, default=3.0, help="seconds between all-healthy and the window"
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=DataPlaneSettings().health_check_interval_s,
        help="Envoy's health-check interval (default: DataPlaneSettings')",
    )
    args = parser.parse_args()
    main(args.sizes, args.seconds, args.interval, args.settle)
