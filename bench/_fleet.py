"""A fleet of a given size to measure: ``fleetmend sim`` on ``fleet-512`` scaled to N nodes, with a real
Envoy (configured by fleetmend's gateway control plane) health-checking every routed engine.

Shared by the benches that measure cost at fleet scale (``bench/sim_idle.py``; fleetmend's own cost
in ``bench/fleet_scale.py``)::

    with fleet_behind_envoy(512, Path("/tmp/fleet")) as fleet:
        fleet.sim.proc.pid, fleet.gateway.admin_url, fleet.healthy_hosts()
        cpu = process_cpu(fleet.sim.proc.pid, 30.0)

The sim runs in its own process (``worker.devstack.sim_process``), so its CPU and memory are its own;
the gateway control plane runs on a thread of the caller, Envoy as a child process. The ledger database
the control plane keeps its policy in comes from ``ledger.scratch`` (a throwaway Postgres).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.resources import UPSTREAM_HEADER, DataPlaneSettings
from ledger.migrate import upgrade_head
from ledger.scratch import PgServer, acquire_server
from sim.scenario import Scenario, scaled_scenario
from worker.devstack.gateway import LocalGateway
from worker.devstack.sim_process import SimProcess, scenario_file, start_sim_process

FLEET_SCENARIO = "fleet-512"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def routed_endpoints(scenario: Scenario) -> int:
    """Engines a gateway routes to in ``scenario``: serving replicas (an LWS group's leader), not spares."""
    return sum(w.replicas for w in scenario.workloads)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (``/proc/<pid>/stat``: utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def process_cpu_percent(pid: int, seconds: float) -> float:
    """CPU % of one core ``pid`` used over the next ``seconds`` of wall time."""
    before, started = process_cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return 100.0 * (process_cpu_seconds(pid) - before) / (time.monotonic() - started)


@dataclass
class Fleet:
    """A running fleet: the sim process, the gateway (control plane + Envoy) and the scenario it serves."""

    nodes: int
    scenario: Scenario
    sim: SimProcess
    gateway: LocalGateway
    database_url: str

    @property
    def sim_pid(self) -> int:
        return self.sim.proc.pid

    def health_checked_hosts(self) -> tuple[int, int]:
        """(hosts Envoy health-checks, of which healthy), from Envoy's admin ``/clusters``."""
        text = httpx.get(self.gateway.admin_url + "/clusters", timeout=10.0).text
        hosts = healthy = 0
        for line in text.splitlines():
            if "::health_flags::" in line and not line.startswith("fleetmend_xds::"):
                hosts += 1
                healthy += line.rsplit("::", 1)[1].strip() == "healthy"
        return hosts, healthy

    def wait_health_checked(self, timeout_s: float = 180.0) -> int:
        """Wait until Envoy health-checks every routed engine and finds it healthy; returns how many."""
        want = routed_endpoints(self.scenario)
        deadline = time.monotonic() + timeout_s
        hosts = healthy = 0
        while time.monotonic() < deadline:
            hosts, healthy = self.health_checked_hosts()
            if healthy >= want:
                return healthy
            time.sleep(1.0)
        raise TimeoutError(f"Envoy health-checks {hosts} hosts, {healthy} healthy, of {want} routed engines")


@contextlib.contextmanager
def fleet_behind_envoy(
    nodes: int,
    home: Path,
    *,
    pg: PgServer | None = None,
    data_plane: DataPlaneSettings | None = None,
    speed: float = 1.0,
) -> Iterator[Fleet]:
    """``fleet-512`` at ``nodes`` nodes served by ``fleetmend sim`` behind Envoy, every routed engine
    health-checked; stops all of it (and drops its database) on exit. ``pg``: a Postgres server to make
    the ledger database on (default: one acquired and stopped here)."""
    own_pg = pg is None
    server = pg if pg is not None else acquire_server()
    scenario = scaled_scenario(FLEET_SCENARIO, nodes)
    url = server.create_database("fleet")
    sim: SimProcess | None = None
    gateway: LocalGateway | None = None
    try:
        upgrade_head(url)
        path = scenario_file(scenario, home / "scenario")
        sim = asyncio.run(start_sim_process(path, home / "sim", speed=speed, timeout_s=300.0))
        gateway = LocalGateway(
            kubeconfig=sim.kubeconfig,
            database_url=url,
            workdir=home / "gateway",
            data_plane=data_plane or DataPlaneSettings(),
        ).start()
        reply = httpx.put(
            f"{sim.base_url}/sim/v1/gateway",
            json={"url": gateway.url, "upstream_header": UPSTREAM_HEADER},
            timeout=30.0,
        )
        reply.raise_for_status()
        fleet = Fleet(nodes, scenario, sim, gateway, url)
        fleet.wait_health_checked()
        yield fleet
    finally:
        if gateway is not None:
            gateway.stop()
        if sim is not None:
            sim.stop()
        with contextlib.suppress(Exception):
            server.drop_database(url)
        if own_pg:
            server.stop()
