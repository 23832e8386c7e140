"""fleetmend at a real fleet's size: its idle cost from 64 to 512 GPU nodes, and what one node, one rack and
a burst of 200 nodes lost cost and take.

    .venv/bin/python -m bench.fleet_scale [--sizes 64,128,256,512] [--faults node,rack,burst]
        [--fault-sizes 512] [--workers 1] [--idle-s 30] [--quick] [--out docs/fleet-scale.json]

Every part runs as a process of its own, as in production, so each one's CPU is its own:

* the simulator (``fleetmend sim``) serving ``fleet-512`` scaled to N nodes (racks of 16 nodes, a pool
  mix of TP=1/2/4/8 Deployments and multi-node LeaderWorkerSets, warm spares; start-up compressed to
  seconds as in ``fleetmend demo``), every routed engine health-checked by
* a real Envoy, configured by ``fleetmend gateway serve`` (the control plane, a process);
* ``--workers`` ``fleetmend worker`` processes (workflows, activities and the fast path, which one of
  them leads on a Lease) and ``fleetmend webhook``, on a Temporal dev server and an embedded Postgres
  (``ledger.scratch``).

**Idle cost**: CPU % of one core (``/proc/<pid>/stat`` over ``--idle-s`` seconds of wall time) and RSS of
each process once Envoy finds every routed engine healthy, at each size; the slope is a least-squares
line through fleetmend's processes' total (CPU % per 100 nodes).

**Faults** (each on a fresh world at each of ``--fault-sizes``; fault injection is the simulator's
``POST /sim/v1/faults``, kind ``node-lost``):

* ``node``: one GPU node; ``rack``: the 16 nodes of one rack at once (several pools); ``burst``: 200 nodes
  (at fewer than 512 nodes, 200 x N / 512) spread evenly over 60 s; ``mass``: the burst's nodes all at
  once. The burst's faults arrive at most a few per second, so its cordons per second can only follow
  them; ``mass`` is how fast fleetmend fences when the losses come faster than it cordons (its peak
  is the fencing capacity). Kubelets report every 2 s, so even at once the nodes turn NotReady spread
  over about 2 s.
* fault -> out of Envoy's rotation: the first time Envoy's admin ``/clusters`` (polled every 0.2 s) no
  longer calls a lost node's engine healthy, or no longer lists it — the world's record, not fleetmend's;
* fault -> incident opened: the pool's ``FleetIncident`` start time in Temporal minus the earliest fault
  on a node that held one of the pool's routed engines;
* nodes cordoned per second: fleetmend's ``PATCH`` of a Node's ``spec.unschedulable`` in the simulated
  API server's audit log (mean over the cordoning span, and the peak in any 1 s);
* incidents opened (and any duplicated: more than one run of a pool's incident), recoveries completed,
  waiting on an operator (with the reason), still running or failed, and the time until the last ends;
* Temporal actions from the workflows' histories, counted as Temporal Cloud bills them
  (https://docs.temporal.io/cloud/actions): workflow started (a child counts twice: its start and its
  execution), signal (a Signal-With-Start once), timer started, search-attribute upsert, activity
  started or retried (each attempt), update accepted, local activities once per workflow task. Queries
  are billed too but are not in a history (and the bench's own status queries are not fleetmend's), so
  they are left out. Per incident, per lost node, and the incidents per second a Temporal Cloud
  namespace carries at 500 actions/s (the figure the issue names) and at 400 (the default its limits
  page gives today, https://docs.temporal.io/cloud/limits#throughput);
* ledger rows (every table of the ledger database) and Kubernetes API requests per second by verb
  (fleetmend's ServiceAccounts in the audit log) from the fault until the last recovery ended;
* with ``--workers 2``: the activities each worker ran (the ``identity`` of each
  ``ActivityTaskStarted`` event).

With the node fault, a world of the 4-node demo (``gpu-node-loss``, same compression) loses one node
first, and each size's rotation p99 is printed beside the demo's (``rotation_versus_demo``; skip it with
``--no-demo-baseline``).

``--quick``: 64 nodes, one node and one rack, a 10 s idle window, and shorter replacement, verification
and ramp-back caps (a smoke run of about three minutes; write it elsewhere with ``--out``). The
figures are written under the key ``workers=N`` of ``--out``, so runs with 1 and 2 workers sit side by
side. Shares this machine's CPUs with everything else running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus

from fleet.incident import PoolRef, incident_workflow_id
from fleet.recovery import Phase, ProcedureStatus, RecoveryTimings, ServingObjectives
from fleet.vocabulary import FaultKind
from gateway.bootstrap import BootstrapSettings
from gateway.resources import UPSTREAM_HEADER
from ledger.migrate import upgrade_head
from ledger.scratch import PgServer, acquire_server
from sim.control import FaultRequest
from sim.scenario import SCENARIO_DIR, Scenario, scaled_scenario
from worker.config import CONCURRENCY_SETTINGS, Settings, load_settings, settings_environment
from worker.devstack.envoy import EnvoyProcess
from worker.devstack.rbac_wiring import component_settings, grant_components
from worker.devstack.rig import FAST_TIMINGS, compressed_scenario
from worker.devstack.sim_process import SimProcess, scenario_file, start_sim_process
from worker.devstack.sim_wiring import settings_for_running_sim
from worker.devstack.temporal_dev import throwaway_dev_server
from worker.processes import free_port, spawn, terminate

REPO = Path(__file__).resolve().parents[1]
SIZES = (64, 128, 256, 512)
FAULTS = ("node", "rack", "burst", "mass")
RACK_LABEL = "topology.kubernetes.io/rack"
BURST_NODES, BURST_S = 200, 60.0
FLEET_NODES = 512  # the size the burst's 200 nodes are named for
# The 4-node demo (`fleetmend demo`'s scenario): its one-node loss runs first in any run with the node fault,
# so the fleet's rotation figure is compared with it on the same machine in the same run.
DEMO, DEMO_NODES = "gpu-node-loss", 4
ROTATION_POLL_S = 0.2
SETTLE_TIMEOUT_S = 300.0  # after the last fault: every recovery ends or waits on an operator by then
INCIDENT_WAIT_S = 60.0  # after the last fault: a pool without an incident by then has none
NODE_GRACE_S = 5.0  # Kubernetes' node-monitor grace, compressed as in `fleetmend demo`
STARTUP_S, WARM_UP_S = 4.0, 8.0  # an engine's start-up and warm-up, compressed as in `fleetmend demo`
CLOUD_APS = (
    500,
    400,
)  # actions/s of a Temporal Cloud namespace: the figure, the limits page's default
TIMINGS = FAST_TIMINGS
# --quick: a recovery that cannot place its replacements, or whose warm floor is not back, says so
# sooner, and the ramp-back (no load to measure) ends sooner.
QUICK_TIMINGS = FAST_TIMINGS.model_copy(
    update={"replacement_timeout_s": 20, "verify_timeout_s": 15, "ramp_max_s": 8}
)
OBJECTIVES = ServingObjectives(group_capacity_rps=15.0)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Workflow types whose run is a recovery (the procedure a pool's incident starts per loss).
RECOVERY_TYPES = {"ReplicaLossRecovery"}
WAITING_PHASES = {Phase.AWAITING_OPERATOR, Phase.AWAITING_REPAIR}

console = Console(width=160)


# ============================================================================ the world


def fleet_scenario(nodes: int, home: Path) -> Scenario:
    """``fleet-512`` at ``nodes`` nodes (or, at ``DEMO_NODES``, the 4-node demo's own ``gpu-node-loss``),
    with engine start-up and warm-up compressed to seconds."""
    path = (
        SCENARIO_DIR / f"{DEMO}.yaml"
        if nodes == DEMO_NODES
        else scenario_file(scaled_scenario("fleet-512", nodes), home)
    )
    return compressed_scenario(
        path, startup_s=STARTUP_S, warm_up_s=WARM_UP_S, rollout_at_s=None, node_monitor_grace_s=NODE_GRACE_S
    )


@dataclass
class Proc:
    """A process whose cost is measured: fleetmend's own, or the world's (the sim, Envoy)."""

    name: str
    pid: int
    fleetmend: bool


@dataclass
class Endpoint:
    """A routed engine: where Envoy sends the pool's requests, and the node it runs on."""

    pool: PoolRef
    pod: str
    node: str
    address: str  # ip:port, as Envoy names the host


@dataclass
class World:
    nodes: int
    scenario: Scenario
    client: Client
    settings: Settings
    sim: SimProcess
    envoy: EnvoyProcess
    database_url: str
    procs: list[Proc]
    workers: list[str]  # identities
    started_at: float = field(default_factory=time.time)

    def worker_name(self, identity: str) -> str:
        """``worker-N`` for a Temporal worker identity (``pid@host``, the SDK's default)."""
        pid = identity.split("@", 1)[0]
        return next((p.name for p in self.procs if str(p.pid) == pid), identity)

    @property
    def routed(self) -> int:
        return sum(w.replicas for w in self.scenario.workloads)

    def racks(self) -> dict[str, list[str]]:
        """Rack label -> its nodes, from the API server."""
        core = kube_core(self.sim.kubeconfig)
        racks: dict[str, list[str]] = defaultdict(list)
        for node in core.list_node().items:
            rack = (node.metadata.labels or {}).get(RACK_LABEL)
            if rack:
                racks[rack].append(node.metadata.name)
        return {k: sorted(v) for k, v in sorted(racks.items())}

    def endpoints(self) -> list[Endpoint]:
        """Every ready endpoint of every pool, from the EndpointSlices (what Envoy routes to)."""
        from kubernetes import client as kclient

        api = kclient.DiscoveryV1Api(kube_core(self.sim.kubeconfig).api_client)
        found = []
        slices: list[Any] = api.list_endpoint_slice_for_all_namespaces().items
        for s in slices:
            service = (s.metadata.labels or {}).get("kubernetes.io/service-name")
            port = next((p.port for p in s.ports or [] if p.port), None)
            if not service or port is None:
                continue
            for e in s.endpoints or []:
                if e.conditions is not None and e.conditions.ready and e.target_ref is not None:
                    found.append(
                        Endpoint(
                            pool=PoolRef(namespace=s.metadata.namespace, service=service),
                            pod=str(e.target_ref.name),
                            node=e.node_name or "",
                            address=f"{e.addresses[0]}:{port}",
                        )
                    )
        return found

    def envoy_hosts(self) -> dict[str, bool]:
        """Envoy's admin ``/clusters``: every pool host it has, and whether it calls it healthy."""
        text = httpx.get(self.envoy.admin_url + "/clusters", timeout=10.0).text
        hosts: dict[str, bool] = {}
        for line in text.splitlines():
            if "::health_flags::" not in line or line.startswith("fleetmend_xds::"):
                continue
            _, address, _, flags = line.split("::", 3)
            hosts[address] = hosts.get(address, False) or flags.strip() == "healthy"
        return hosts

    async def wait_healthy(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        healthy = 0
        while time.monotonic() < deadline:
            healthy = sum(await asyncio.to_thread(lambda: list(self.envoy_hosts().values())))
            if healthy >= self.routed:
                return healthy
            await asyncio.sleep(1.0)
        raise TimeoutError(f"Envoy finds {healthy} of {self.routed} routed engines healthy")

    async def inject(self, http: httpx.AsyncClient, node: str) -> float:
        at = time.time()
        fault = FaultRequest(kind=FaultKind.NODE_LOST, target=node, params={})
        (await http.post("/sim/v1/faults", json=fault.model_dump(mode="json"))).raise_for_status()
        return at


def kube_core(kubeconfig: Path) -> Any:
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    cfg = kclient.Configuration()
    kconfig.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    return kclient.CoreV1Api(kclient.ApiClient(cfg))


def process_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of a fleetmend process wired like ``settings`` (``worker.config.settings_environment``)."""
    return {**os.environ, **settings_environment(settings), **extra}


def wait_port(port: int, proc: Any, what: str, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout_s:g} s: {log.read_text()[-2000:]}")


async def wait_log(log: Path, needle: str, proc: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text()[-2000:]}")
        if log.is_file() and needle in log.read_text(errors="replace"):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{what} did not say {needle!r} within {timeout_s:g} s")


async def wait_leader(kubeconfig: Path, settings: Settings, timeout_s: float = 60.0) -> str:
    """The fast path's leader, once one holds the Lease."""
    from kubernetes import client as kclient

    api = kclient.CoordinationV1Api(kube_core(kubeconfig).api_client)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(kclient.ApiException):
            lease: Any = await asyncio.to_thread(
                api.read_namespaced_lease, settings.fastpath_lease_name, settings.fastpath_lease_namespace
            )
            if lease.spec.holder_identity:
                return str(lease.spec.holder_identity)
        await asyncio.sleep(0.5)
    raise TimeoutError("no worker's fast path took the Lease")


@contextlib.asynccontextmanager
async def running_world(
    nodes: int,
    workers: int,
    pg: PgServer,
    home: Path,
    timings: RecoveryTimings = TIMINGS,
    **settings_extra: Any,
) -> AsyncIterator[World]:
    """A fresh world of ``nodes`` nodes (its own Temporal, ledger database, sim, gateway, workers),
    yielded once Envoy finds every routed engine healthy and a worker's fast path leads.
    ``settings_extra``: more fleetmend settings for every process (e.g. ``removal_breaker``)."""
    home.mkdir(parents=True, exist_ok=True)
    scenario = fleet_scenario(nodes, home / "scenario")
    children: list[Any] = []
    sim: SimProcess | None = None
    envoy: EnvoyProcess | None = None
    url = pg.create_database("fleetscale")
    try:
        async with await throwaway_dev_server() as env:
            await asyncio.to_thread(upgrade_head, url)
            sim = await start_sim_process(
                scenario_file(scenario, home / "scenario"), home / "sim", timeout_s=300.0
            )
            kubeconfigs = await asyncio.to_thread(grant_components, Path(sim.kubeconfig), None)
            procs = [Proc("sim", sim.proc.pid, fleetmend=False)]
            settings = load_settings(
                temporal_address=env.client.service_client.config.target_host,
                temporal_namespace=env.client.namespace,
                task_queue=f"fleet-scale-{secrets.token_hex(3)}",
                database_url=url,
                worker_metrics_port=0,
                **{
                    **settings_for_running_sim(sim),
                    "gateway": "envoy",
                    "gateway_admin_urls": [],
                    **component_settings(kubeconfigs),
                    "fastpath_enabled": True,
                    "recovery_timings": timings,
                    "serving_objectives": OBJECTIVES,
                    **settings_extra,
                },
            )
            # The gateway control plane, as `fleetmend gateway serve` runs in a cluster.
            xds_port = free_port()
            log = home / "gateway.log"
            plane = spawn(
                [sys.executable, "-m", "worker.cli", "gateway", "serve"],
                log_file=log,
                env=process_env(
                    settings,
                    FLEETMEND_KUBECONFIG=str(kubeconfigs["gateway"]),
                    FLEETMEND_XDS_HOST="127.0.0.1",
                    FLEETMEND_XDS_PORT=str(xds_port),
                ),
            )
            children.append(plane)
            procs.append(Proc("gateway control plane", plane.pid, fleetmend=True))
            await asyncio.to_thread(wait_port, xds_port, plane, "the gateway control plane", log)
            envoy = EnvoyProcess(
                BootstrapSettings(
                    node_id=f"envoy-{secrets.token_hex(3)}",
                    listen_address="127.0.0.1",
                    listen_port=free_port(),
                    admin_port=free_port(),
                    xds_host="127.0.0.1",
                    xds_port=xds_port,
                    access_log_path=str(home / "envoy-access.log"),
                ),
                home / "envoy",
            )
            (home / "envoy").mkdir(exist_ok=True)
            await asyncio.to_thread(envoy.start, 60.0)
            assert envoy.proc is not None
            procs.append(Proc("envoy", envoy.proc.pid, fleetmend=False))
            async with httpx.AsyncClient(base_url=sim.base_url, timeout=30.0) as http:
                reply = await http.put(
                    "/sim/v1/gateway", json={"url": envoy.url, "upstream_header": UPSTREAM_HEADER}
                )
                reply.raise_for_status()
            identities = []
            for i in range(workers):
                identity = f"worker-{i + 1}"
                log = home / f"{identity}.log"
                proc = spawn(
                    [sys.executable, "-m", "worker.cli", "worker"],
                    log_file=log,
                    env=process_env(settings, FLEETMEND_FASTPATH_IDENTITY=identity),
                )
                children.append(proc)
                procs.append(Proc(identity, proc.pid, fleetmend=True))
                identities.append(identity)
                await wait_log(log, "worker polling", proc, identity)
            hook_port = free_port()
            log = home / "webhook.log"
            hook = spawn(
                [sys.executable, "-m", "worker.cli", "webhook", "--port", str(hook_port)],
                log_file=log,
                env=process_env(
                    settings,
                    FLEETMEND_KUBECONFIG=str(kubeconfigs["webhook"]),
                    FLEETMEND_WEBHOOK_HOST="127.0.0.1",
                    FLEETMEND_WEBHOOK_PORT=str(hook_port),
                    FLEETMEND_WEBHOOK_TOKEN=secrets.token_hex(16),
                ),
            )
            children.append(hook)
            procs.append(Proc("webhook", hook.pid, fleetmend=True))
            await asyncio.to_thread(wait_port, hook_port, hook, "the webhook", log)
            world = World(nodes, scenario, env.client, settings, sim, envoy, url, procs, identities)
            await world.wait_healthy(timeout_s=120.0 + nodes / 2)
            await wait_leader(Path(sim.kubeconfig), settings)
            world.started_at = time.time()
            yield world
    finally:
        for child in reversed(children):
            await asyncio.to_thread(terminate, child, timeout_s=15.0)
        if envoy is not None:
            await asyncio.to_thread(envoy.stop)
        if sim is not None:
            await asyncio.to_thread(sim.stop)
        with contextlib.suppress(Exception):
            pg.drop_database(url)


# ============================================================================ idle cost


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def idle_cost(world: World, seconds: float) -> dict[str, Any]:
    """Each process's CPU % of one core over ``seconds`` of an idle fleet, and its RSS."""
    await asyncio.sleep(3.0)  # the start-up's last writes (ramp-up of the informers, first Envoy reads)
    before = {p.pid: cpu_seconds(p.pid) for p in world.procs}
    t0, wall0 = time.monotonic(), time.time()
    await asyncio.sleep(seconds)
    elapsed = time.monotonic() - t0
    rows = {
        p.name: {
            "cpu_pct": round(100.0 * (cpu_seconds(p.pid) - before[p.pid]) / elapsed, 2),
            "rss_mib": round(rss_mib(p.pid), 1),
            "fleetmend": p.fleetmend,
        }
        for p in world.procs
    }
    ours = [r for r in rows.values() if r["fleetmend"]]
    return {
        "nodes": world.nodes,
        "pools": len(world.scenario.workloads),
        "routed_engines": world.routed,
        "window_s": round(elapsed, 1),
        "processes": rows,
        "fleetmend_cpu_pct": round(sum(r["cpu_pct"] for r in ours), 2),
        "fleetmend_rss_mib": round(sum(r["rss_mib"] for r in ours), 1),
        "sim_cpu_pct": rows["sim"]["cpu_pct"],
        "envoy_cpu_pct": rows["envoy"]["cpu_pct"],
        "kube_api_rps_by_verb": api_rates(world, wall0, wall0 + elapsed),
    }


def slope_per_100(points: Iterable[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x, per 100 x."""
    pts = list(points)
    if len(pts) < 2:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return round(100.0 * sum((x - mx) * (y - my) for x, y in pts) / den, 3) if den else None


# ============================================================================ the world's records


def audit_events(world: World) -> list[dict[str, Any]]:
    path = Path(world.sim.audit_log)
    if not path.is_file():
        return []
    events = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if "fleetmend:" in line:  # fleetmend's ServiceAccounts (system:serviceaccount:fleetmend:...)
                events.append(json.loads(line))
    return events


def event_time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()


def api_rates(world: World, start: float, end: float) -> dict[str, float]:
    """fleetmend's Kubernetes API requests per second by verb in [start, end] (the audit log)."""
    counts = Counter(e["verb"] for e in audit_events(world) if start <= event_time(e) <= end)
    span = max(end - start, 1e-6)
    return {verb: round(n / span, 2) for verb, n in sorted(counts.items())}


def cordons(world: World, start: float) -> list[tuple[float, str]]:
    """(time, node) of the first cordon of each node fleetmend's worker cordoned after ``start`` (a
    quarantine patch sets ``spec.unschedulable`` again: the node was fenced at the first)."""
    return first_cordons(audit_events(world), start)


def first_cordons(events: Iterable[dict[str, Any]], start: float) -> list[tuple[float, str]]:
    found: dict[str, float] = {}
    for e in events:
        ref = e.get("objectRef") or {}
        if (
            e.get("verb") == "patch"
            and ref.get("resource") == "nodes"
            and sets_unschedulable(e.get("requestObject"))
            and (e.get("responseStatus") or {}).get("code", 200) < 300
            and event_time(e) >= start
        ):
            name = str(ref.get("name"))
            found[name] = min(found.get(name, math.inf), event_time(e))
    return sorted((t, name) for name, t in found.items())


def sets_unschedulable(patch: Any) -> bool:
    """Whether a Node patch (merge / strategic merge, or JSON patch) sets ``spec.unschedulable``."""
    if isinstance(patch, dict):
        return ((patch.get("spec") or {}).get("unschedulable")) is True
    if isinstance(patch, list):
        return any(
            isinstance(op, dict) and op.get("path") == "/spec/unschedulable" and op.get("value") is True
            for op in patch
        )
    return False


def peak_rate(times: list[float], k: int) -> float | None:
    """Events per second over the fastest ``k`` consecutive events: (k - 1) / their span."""
    if len(times) < k:
        return None
    span = min(times[i + k - 1] - times[i] for i in range(len(times) - k + 1))
    return round((k - 1) / max(span, 1e-3), 1)


def peak_per_second(times: list[float]) -> int:
    """The most events in any 1 s window."""
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - 1.0:
            j += 1
        best = max(best, i - j + 1)
    return best


def ledger_rows(url: str) -> dict[str, int]:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            tables = [
                r[0]
                for r in conn.execute(
                    text(
                        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' "
                        "AND table_type = 'BASE TABLE' AND table_name <> 'alembic_version'"
                    )
                )
            ]
            return {
                t: int(conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one()) for t in sorted(tables)
            }
    finally:
        engine.dispose()


def reconcile_world(world: World) -> dict[str, Any]:
    """The ledger against the world's own record (the API server's audit log, the sim's action log),
    as the recoveries' verification reads it: counts, and the first findings in full."""
    from sqlalchemy import create_engine

    from activities.audit import world_record
    from ledger.reconcile import reconcile

    worlds, actions = world_record(world.settings)
    engine = create_engine(world.database_url)
    try:
        report = reconcile(engine, world=worlds or None, actions=actions if worlds else None)
    finally:
        engine.dispose()
    return {
        "duplicates": len(report.duplicates),
        "repeated_at_least_once": len(report.repeated),
        "orphans": len(report.orphans),
        "unresolved": len(report.unresolved) + len(report.needs_operator),
        "divergent": len(report.divergent),
        "first_duplicates": [d.model_dump(mode="json") for d in report.duplicates[:3]],
        "first_orphans": [o.model_dump(mode="json") for o in report.orphans[:3]],
    }


# ============================================================================ Temporal's record


@dataclass
class Run:
    workflow_id: str
    run_id: str
    type: str
    status: WorkflowExecutionStatus | None
    start: float
    close: float | None


async def workflow_runs(client: Client) -> list[Run]:
    runs = []
    async for wf in client.list_workflows(""):
        runs.append(
            Run(
                wf.id,
                wf.run_id,
                wf.workflow_type,
                wf.status,
                wf.start_time.timestamp(),
                wf.close_time.timestamp() if wf.close_time else None,
            )
        )
    return runs


async def history_actions(client: Client, run: Run) -> tuple[Counter[str], Counter[str]]:
    """(billable actions by kind, activities started by worker identity) from one run's history."""
    actions: Counter[str] = Counter()
    by_worker: Counter[str] = Counter()
    marker_task = None
    last_task = 0
    position = 0
    async for event in client.get_workflow_handle(run.workflow_id, run_id=run.run_id).fetch_history_events():
        position += 1
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            actions["workflow started"] += 1
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            if position == 2:  # Signal-With-Start: one action with the start
                continue
            actions["signal"] += 1
        elif kind == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            actions["signal"] += 1
        elif kind == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
            actions["child workflow start"] += 1
        elif kind == EventType.EVENT_TYPE_TIMER_STARTED:
            actions["timer started"] += 1
        elif kind == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            actions["search attributes upserted"] += 1
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
            actions["update"] += 1
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            attrs = event.activity_task_started_event_attributes
            actions["activity started or retried"] += max(1, attrs.attempt)
            by_worker[attrs.identity] += 1
        elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            last_task = event.event_id
        elif kind == EventType.EVENT_TYPE_MARKER_RECORDED and marker_task != last_task:
            marker_task = last_task
            actions["local activities (per workflow task)"] += 1
    return actions, by_worker


FENCE_TIME_KINDS = (
    "workflow task queued",
    "workflow task running",
    "activity queued",
    "activity running",
    "start to close",
)


# A task's start event (its queue wait ends) and its completion (its run ends): history attributes, label.
_QUEUED = {
    EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED: (
        "workflow_task_started_event_attributes",
        "workflow task queued",
    ),
    EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED: ("activity_task_started_event_attributes", "activity queued"),
}
_RAN = {
    EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED: (
        "workflow_task_completed_event_attributes",
        "workflow task running",
    ),
    EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED: (
        "activity_task_completed_event_attributes",
        "activity running",
    ),
}


async def where_time_went(client: Client, run: Run) -> dict[str, float]:
    """A run's seconds by where they went, from its history: workflow tasks waiting for a worker and
    being run, activities waiting for a slot and running, and start to close."""
    spent: defaultdict[str, float] = defaultdict(float)
    scheduled: dict[int, float] = {}
    started: dict[int, float] = {}
    first = last = None
    async for event in client.get_workflow_handle(run.workflow_id, run_id=run.run_id).fetch_history_events():
        at = event.event_time.ToDatetime().timestamp()
        first = at if first is None else first
        last = at
        kind = event.event_type
        if kind in (
            EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED,
            EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
        ):
            scheduled[event.event_id] = at
        elif kind in _QUEUED:
            attributes, label = _QUEUED[kind]
            spent[label] += at - scheduled.get(getattr(event, attributes).scheduled_event_id, at)
            started[event.event_id] = at
        elif kind in _RAN:
            attributes, label = _RAN[kind]
            spent[label] += at - started.get(getattr(event, attributes).started_event_id, at)
    spent["start to close"] = (last or 0.0) - (first or 0.0)
    return dict(spent)


async def status_of(client: Client, workflow_id: str) -> ProcedureStatus | None:
    with contextlib.suppress(Exception):
        raw = await client.get_workflow_handle(workflow_id).query("status")
        return raw if isinstance(raw, ProcedureStatus) else ProcedureStatus.model_validate(raw)
    return None


# ============================================================================ a fault


def fault_nodes(world: World, fault: str) -> list[str]:
    """The nodes a fault takes: one busy node; the busiest rack; or ``BURST_NODES`` (scaled) busy-first."""
    endpoints = world.endpoints()
    load = Counter(e.node for e in endpoints)
    racks = world.racks()
    if fault == "node":
        return [load.most_common(1)[0][0]]
    if fault == "rack":
        busiest = max(racks, key=lambda r: (len({e.pool for e in endpoints if e.node in racks[r]}), r))
        return racks[busiest]
    count = max(1, round(BURST_NODES * world.nodes / FLEET_NODES))  # burst, mass
    ordered = sorted((n for nodes in racks.values() for n in nodes), key=lambda n: (-load[n], n))
    return ordered[:count]


async def watch_rotation(
    world: World, addresses: dict[str, str], out_at: dict[str, float], stop: asyncio.Event
) -> None:
    """Record when Envoy first stops calling each watched host healthy (or drops it)."""
    while not stop.is_set():
        try:
            hosts = await asyncio.to_thread(world.envoy_hosts)
        except httpx.HTTPError:
            await asyncio.sleep(ROTATION_POLL_S)
            continue
        now = time.time()
        for address in addresses:
            if address not in out_at and not hosts.get(address, False):
                out_at[address] = now
        if len(out_at) == len(addresses):
            return
        await asyncio.sleep(ROTATION_POLL_S)


def quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    ordered = sorted(values)

    def q(x: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, math.ceil(x * len(ordered)) - 1))], 2)

    return {"p50": q(0.5), "p99": q(0.99), "max": round(ordered[-1], 2), "n": len(ordered)}


async def settle(world: World, pools: set[PoolRef], deadline: float, incidents_by: float) -> list[Run]:
    """Wait until every affected pool's incident is open (a pool without one by ``incidents_by`` is
    reported as such) and every recovery ended or waits on an operator (or a node on its repair);
    returns the runs then (at ``deadline`` at the latest)."""
    said = time.monotonic()
    while True:
        runs = await workflow_runs(world.client)
        opened = {r.workflow_id for r in runs if r.type == "FleetIncident"}
        missing = [p for p in pools if incident_workflow_id(p) not in opened]
        if time.monotonic() > incidents_by:
            missing = []
        open_recoveries = [r for r in runs if r.type in RECOVERY_TYPES and r.close is None]
        pending = False
        if not missing and (any(r.type in RECOVERY_TYPES for r in runs) or time.monotonic() > incidents_by):
            for r in open_recoveries:
                status = await status_of(world.client, r.workflow_id)
                if status is None or status.phase not in WAITING_PHASES:
                    pending = True
                    break
            # every incident has started its recovery (or ended)
            for r in runs:
                if r.type == "FleetIncident" and r.close is None:
                    status = await status_of(world.client, r.workflow_id)
                    if status is not None and not status.children:
                        pending = True
                        break
            if not pending:
                return runs
        if time.monotonic() > deadline:
            return runs
        if time.monotonic() > said + 20:
            said = time.monotonic()
            kinds = Counter(
                f"{r.type}:{'open' if r.close is None else r.status.name if r.status else '?'}" for r in runs
            )
            console.print(f"  waiting: {len(missing)} pools without an incident; {dict(kinds)}")
        await asyncio.sleep(2.0)


async def run_fault(world: World, fault: str) -> dict[str, Any]:
    targets = fault_nodes(world, fault)
    # Routed engines only: a warm spare is in its Service's EndpointSlice but not in Envoy's rotation.
    in_rotation = {a for a, healthy in (await asyncio.to_thread(world.envoy_hosts)).items() if healthy}
    endpoints = [e for e in world.endpoints() if e.address in in_rotation]
    watched = {e.address: e.node for e in endpoints if e.node in set(targets)}
    pools = {e.pool for e in endpoints if e.node in set(targets)}
    out_at: dict[str, float] = {}
    fault_at: dict[str, float] = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_rotation(world, watched, out_at, stop))
    spacing = BURST_S / max(1, len(targets) - 1) if fault == "burst" else 0.0
    start = time.time()
    async with httpx.AsyncClient(base_url=world.sim.base_url, timeout=30.0) as http:
        if fault == "burst":
            for i, node in enumerate(targets):
                await asyncio.sleep(max(0.0, start + i * spacing - time.time()))
                fault_at[node] = await world.inject(http, node)
        else:
            injected = await asyncio.gather(*(world.inject(http, n) for n in targets))
            fault_at.update(zip(targets, injected, strict=True))
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    runs = await settle(world, pools, deadline, time.monotonic() + INCIDENT_WAIT_S)
    stop.set()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(watcher, 5)
    end = time.time()
    first_fault = min(fault_at.values())

    rotation = [out_at[a] - fault_at[n] for a, n in watched.items() if a in out_at]
    pool_fault = {
        p: min(fault_at[e.node] for e in endpoints if e.pool == p and e.node in fault_at) for p in pools
    }
    incidents = [r for r in runs if r.type == "FleetIncident"]
    by_id = Counter(r.workflow_id for r in incidents)
    # A pool's incident: its first run opened after the pool's first fault (in a burst a pool hit again
    # after its incident closed gets a new run: re-opened, not duplicated; two runs open at once would be).
    opened_after = [
        min(r.start for r in incidents if r.workflow_id == incident_workflow_id(p) and r.start >= t - 1.0) - t
        for p, t in pool_fault.items()
        if any(r.workflow_id == incident_workflow_id(p) and r.start >= t - 1.0 for r in incidents)
    ]
    duplicated = sum(
        1
        for a in incidents
        for b in incidents
        if a.workflow_id == b.workflow_id
        and a.run_id < b.run_id
        and a.start < (b.close or math.inf)
        and b.start < (a.close or math.inf)
    )
    recoveries = [r for r in runs if r.type in RECOVERY_TYPES]
    waiting: list[dict[str, str]] = []
    completed = failed = running = 0
    for r in recoveries:
        if r.status == WorkflowExecutionStatus.COMPLETED:
            completed += 1
        elif r.status in (WorkflowExecutionStatus.FAILED, WorkflowExecutionStatus.TERMINATED,
                          WorkflowExecutionStatus.TIMED_OUT, WorkflowExecutionStatus.CANCELED):  # fmt: skip
            failed += 1
        else:
            status = await status_of(world.client, r.workflow_id)
            if status is not None and status.phase in WAITING_PHASES:
                reason = status.awaiting or (status.refusal.error if status.refusal else "")
                if not reason and status.decisions:
                    reason = status.decisions[-1].summary
                waiting.append({"workflow": r.workflow_id, "phase": status.phase.value, "reason": reason})
            else:
                running += 1
    closes = [r.close for r in recoveries if r.close is not None]
    cordoned = cordons(world, first_fault)
    cordon_times = [t for t, _ in cordoned]
    cordoned_at = {node: t for t, node in cordoned}
    fenced_after = [cordoned_at[n] - fault_at[n] for n in targets if n in cordoned_at]

    actions: Counter[str] = Counter()
    per_worker: Counter[str] = Counter()
    for r in runs:
        if r.start >= first_fault - 1.0:
            a, w = await history_actions(world.client, r)
            actions.update(a)
            per_worker.update({world.worker_name(identity): n for identity, n in w.items()})
    fences = [r for r in runs if r.type == "NodeFence" and r.start >= first_fault - 1.0]
    # Fleet events (fleet.fleet_event): which domains were named a common cause, with how many pools.
    named: list[dict[str, Any]] = []
    for r in runs:
        if r.type == "FleetEvent" and r.start >= first_fault - 1.0:
            event = await status_of(world.client, r.workflow_id)
            if event is not None and event.figures.get("common_cause"):
                named.append(
                    {
                        "event": r.workflow_id,
                        "nodes": len(event.figures.get("nodes", [])),
                        "pools": len(event.figures.get("pools", [])),
                    }
                )
    fence_time = [await where_time_went(world.client, r) for r in fences]
    total_actions = sum(actions.values())
    per_incident = total_actions / len(incidents) if incidents else None
    return {
        "fault": fault,
        "scenario": world.scenario.name,
        "nodes": world.nodes,
        "lost_nodes": len(targets),
        "pools_hit": len(pools),
        "routed_engines_lost": len(watched),
        "fault_to_out_of_rotation_s": quantiles(rotation),
        "not_out_of_rotation": len(watched) - len(rotation),
        "fault_to_incident_opened_s": quantiles(opened_after),
        "incidents_opened": len(incidents),
        "pools_with_incident": len(by_id),
        "incidents_duplicated": duplicated,
        "incidents_reopened": len(incidents) - len(by_id),
        "pools_without_incident": sorted(p.key for p in pools if incident_workflow_id(p) not in by_id),
        "recoveries": {
            "started": len(recoveries),
            "completed": completed,
            "waiting": len(waiting),
            "running": running,
            "failed": failed,
        },
        "waiting": waiting[:20],
        "last_recovery_ended_s": round(max(closes) - first_fault, 1) if closes else None,
        "node_qualifications": sum(1 for r in runs if r.type == "NodeQualification"),
        "nodes_cordoned": len(cordoned),
        "cordons_per_s": {
            "mean": round(len(cordon_times) / max(cordon_times[-1] - cordon_times[0], 1.0), 2)
            if cordon_times
            else None,
            "peak_1s": peak_per_second(cordon_times),
            # The fastest run of 10 consecutive first cordons: 9 intervals over their span (a rate that a
            # 1 s window caps at the number of nodes failing in one second).
            "peak_10": peak_rate(cordon_times, 10),
        },
        "fault_to_cordoned_s": quantiles(fenced_after),
        "lost_nodes_not_cordoned": len(targets) - len(fenced_after),
        "faults_per_s_peak_1s": peak_per_second(sorted(fault_at.values())),
        "node_fences": len(fences),
        "fleet_events": {
            "runs": sum(1 for r in runs if r.type == "FleetEvent" and r.start >= first_fault - 1.0),
            "common_causes": sorted(named, key=lambda e: e["event"])[:40],
        },
        # Where a fence's time went (seconds, p50 / p99 over the fences), from their histories.
        "fence_seconds": {k: quantiles([t.get(k, 0.0) for t in fence_time]) for k in FENCE_TIME_KINDS},
        "temporal_actions": {
            "total": total_actions,
            "by_kind": dict(sorted(actions.items())),
            "per_incident": round(per_incident, 1) if per_incident else None,
            "per_lost_node": round(total_actions / len(targets), 1),
            "incidents_per_s_at": {
                f"{aps}_aps": round(aps / per_incident, 1) if per_incident else None for aps in CLOUD_APS
            },
        },
        "activities_by_worker": dict(sorted(per_worker.items())),
        "ledger_rows": await asyncio.to_thread(ledger_rows, world.database_url),
        "reconcile": await asyncio.to_thread(reconcile_world, world),
        "kube_api_rps_by_verb": api_rates(world, first_fault, end),
        "window_s": round(end - first_fault, 1),
    }


# ============================================================================ output


def print_idle(rows: list[dict[str, Any]], slope: dict[str, Any]) -> None:
    table = Table(title="Idle cost (CPU % of one core, RSS MiB)")
    names = [n for n in rows[0]["processes"]] if rows else []
    table.add_column("nodes", justify="right")
    table.add_column("pools", justify="right")
    for n in names:
        table.add_column(n, justify="right")
    table.add_column("fleetmend total", justify="right")
    for r in rows:
        table.add_row(
            str(r["nodes"]),
            str(r["pools"]),
            *(f"{r['processes'][n]['cpu_pct']:.1f} % / {r['processes'][n]['rss_mib']:.0f}" for n in names),
            f"{r['fleetmend_cpu_pct']:.1f} % / {r['fleetmend_rss_mib']:.0f}",
        )
    console.print(table)
    console.print(f"slope (CPU % of a core per 100 nodes, least squares): {slope}")


def print_faults(rows: list[dict[str, Any]]) -> None:
    table = Table(title="Faults")
    for col in ("fault", "nodes", "lost", "pools", "out of rotation p50/p99/max s",
                "incident opened p50/p99/max s", "incidents (dup)", "recoveries done/wait/run/failed",
                "last ended s", "fault to cordoned p50/p99 s", "cordons/s mean / peak 1s / peak of 10",
                "faults/s peak 1s", "actions/incident", "incidents/s @500 APS"):  # fmt: skip
        table.add_column(col, justify="right")

    def three(q: dict[str, Any]) -> str:
        return "-" if q["p50"] is None else f"{q['p50']:.2f} / {q['p99']:.2f} / {q['max']:.2f}"

    for r in rows:
        rec = r["recoveries"]
        table.add_row(
            r["fault"],
            str(r["nodes"]),
            str(r["lost_nodes"]),
            str(r["pools_hit"]),
            three(r["fault_to_out_of_rotation_s"]),
            three(r["fault_to_incident_opened_s"]),
            f"{r['incidents_opened']} ({r['incidents_duplicated']})",
            f"{rec['completed']}/{rec['waiting']}/{rec['running']}/{rec['failed']}",
            str(r["last_recovery_ended_s"]),
            "-"
            if not r.get("fault_to_cordoned_s", {}).get("n")
            else f"{r['fault_to_cordoned_s']['p50']:.2f} / {r['fault_to_cordoned_s']['p99']:.2f}",
            f"{r['cordons_per_s']['mean']} / {r['cordons_per_s']['peak_1s']} / {r['cordons_per_s'].get('peak_10')}",
            str(r.get("faults_per_s_peak_1s", "-")),
            str(r["temporal_actions"]["per_incident"]),
            str(r["temporal_actions"]["incidents_per_s_at"]["500_aps"]),
        )
    console.print(table)
    for r in rows:
        if r.get("fence_seconds"):
            spent = ", ".join(f"{k} {q['p50']} / {q['p99']}" for k, q in r["fence_seconds"].items() if q["n"])
            console.print(f"{r['fault']} at {r['nodes']}: a fence's seconds (p50 / p99): {spent}")
        for e in r.get("fleet_events", {}).get("common_causes", [])[:5]:
            console.print(
                f"{r['fault']} at {r['nodes']}: {e['event']}: {e['nodes']} nodes, {e['pools']} pools"
            )
        if r["activities_by_worker"]:
            console.print(f"{r['fault']} at {r['nodes']}: activities by worker {r['activities_by_worker']}")
        for w in r["waiting"][:5]:
            console.print(f"  waiting: {w['workflow']} [{w['phase']}] {w['reason'][:140]}")


def rotation_versus_demo(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fault -> out of Envoy's rotation p99 for one node lost at each fleet size, beside the 4-node demo's."""
    demo = next((r for r in rows if r["fault"] == "node" and r["nodes"] == DEMO_NODES), None)
    if demo is None or demo["fault_to_out_of_rotation_s"]["p99"] is None:
        return []
    base = demo["fault_to_out_of_rotation_s"]["p99"]
    return [
        {
            "nodes": r["nodes"],
            "p99_s": r["fault_to_out_of_rotation_s"]["p99"],
            "demo_p99_s": base,
            "ratio": round(r["fault_to_out_of_rotation_s"]["p99"] / base, 2),
        }
        for r in rows
        if r["fault"] == "node"
        and r["nodes"] != DEMO_NODES
        and r["fault_to_out_of_rotation_s"]["p99"] is not None
    ]


def plot(doc: dict[str, Any], path: Path) -> None:
    """The cost curve: fleetmend's processes' and the sim's idle CPU by fleet size, per worker count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted(k for k in doc if k.startswith("workers=")):
        rows = sorted(doc[key].get("idle", []), key=lambda r: r["nodes"])
        if not rows:
            continue
        nodes = [r["nodes"] for r in rows]
        ax.plot(nodes, [r["fleetmend_cpu_pct"] for r in rows], marker="o", label=f"fleetmend ({key})")
        ax.plot(nodes, [r["sim_cpu_pct"] for r in rows], marker="x", linestyle="--", label=f"sim ({key})")
    ax.set_xlabel("GPU nodes (fleet-512 scaled)")
    ax.set_ylabel("idle CPU, % of one core")
    ax.set_title("Idle cost by fleet size (Envoy health-checking every engine)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================ main


async def main(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",") if s]
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise SystemExit(f"unknown fault {unknown}: choose from {', '.join(FAULTS)}")
    fault_sizes = [int(s) for s in args.fault_sizes.split(",") if s] or sizes[-1:]
    pg = await asyncio.to_thread(acquire_server)
    idle: list[dict[str, Any]] = []
    fault_rows: list[dict[str, Any]] = []
    try:
        with contextlib.ExitStack() as stack:
            tmp = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-scale-"))
            # Each world serves one idle window (its size's) and then at most one fault: a fault's
            # figures come from a fleet that lost nothing before it.
            plan: list[tuple[int, bool, str | None]] = []
            pending = [(n, f) for n in fault_sizes for f in faults]
            for nodes in sizes:
                first = next((f for n, f in pending if n == nodes), None)
                if first is not None:
                    pending.remove((nodes, first))
                plan.append((nodes, True, first))
            plan += [(n, False, f) for n, f in pending]
            if "node" in faults and args.demo_baseline:
                plan.insert(0, (DEMO_NODES, False, "node"))
            for nodes, measure_idle, fault in plan:
                console.print(f"[bold]{nodes} nodes[/]: {'idle, ' if measure_idle else ''}{fault or ''}")
                home = Path(tmp) / f"{nodes}-{fault or 'idle'}"
                async with running_world(nodes, args.workers, pg, home, args.timings) as world:
                    if measure_idle:
                        idle.append(await idle_cost(world, args.idle_s))
                        console.print(
                            f"  idle: fleetmend {idle[-1]['fleetmend_cpu_pct']:.1f} %, "
                            f"sim {idle[-1]['sim_cpu_pct']:.1f} %"
                        )
                    if fault is not None:
                        fault_rows.append(await run_fault(world, fault))
                        console.print(json.dumps(fault_rows[-1], indent=None)[:600])
    finally:
        await asyncio.to_thread(pg.stop)
    slope = {
        "fleetmend_cpu_pct_per_100_nodes": slope_per_100((r["nodes"], r["fleetmend_cpu_pct"]) for r in idle),
        "sim_cpu_pct_per_100_nodes": slope_per_100((r["nodes"], r["sim_cpu_pct"]) for r in idle),
    }
    print_idle(idle, slope)
    print_faults(fault_rows)
    versus_demo = rotation_versus_demo(fault_rows)
    for row in versus_demo:
        console.print(
            f"one node lost, fault -> out of rotation p99: {row['nodes']} nodes {row['p99_s']} s, "
            f"the 4-node demo {row['demo_p99_s']} s (x{row['ratio']})"
        )
    out = Path(args.out)
    doc: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    doc["about"] = (__doc__ or "").split("\n\n")[0]
    doc["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    concurrency = load_settings()  # the workers run with these (the bench sets none of them)
    doc["settings"] = {
        "recovery_timings": args.timings.model_dump(mode="json"),
        "node_monitor_grace_s": NODE_GRACE_S,
        "engine_startup_s": STARTUP_S,
        "engine_warm_up_s": WARM_UP_S,
        "worker_concurrency": {
            name: getattr(concurrency, name) for name in CONCURRENCY_SETTINGS if hasattr(concurrency, name)
        },
        "temporal_cloud_actions": "https://docs.temporal.io/cloud/actions",
        "temporal_cloud_aps_limit": "https://docs.temporal.io/cloud/limits#throughput",
    }
    key = f"workers={args.workers}"
    previous = doc.get(key, {})
    if not idle and previous.get("idle"):  # a run of faults only keeps the idle figures it found
        idle, slope = previous["idle"], previous.get("slope", slope)
    doc[key] = {
        "idle": idle,
        "slope": slope,
        # A run's faults replace the same fault at the same size from an earlier run, and keep the rest.
        "faults": [
            f
            for f in previous.get("faults", [])
            if (f["nodes"], f["fault"]) not in {(r["nodes"], r["fault"]) for r in fault_rows}
        ]
        + fault_rows,
        # This run's one-node loss at each size against the 4-node demo's, both from this run.
        "rotation_versus_demo": versus_demo or previous.get("rotation_versus_demo", []),
        "runs": [
            *previous.get("runs", []),
            {
                "command": " ".join(["python -m bench.fleet_scale", *sys.argv[1:]]),
                "finished_at": datetime.now().astimezone().isoformat(timespec="seconds"),
            },
        ],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {out}")
    if args.plot:
        plot(doc, Path(args.plot))
        console.print(f"wrote {args.plot}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="node counts for the idle cost")
    parser.add_argument(
        "--faults", default=",".join(FAULTS), help=f"faults to run ({', '.join(FAULTS)}; '' = none)"
    )
    parser.add_argument(
        "--fault-sizes", default="", help="node counts to run the faults at (default: the largest)"
    )
    parser.add_argument("--workers", type=int, default=1, help="fleetmend worker processes")
    parser.add_argument(
        "--no-demo-baseline",
        dest="demo_baseline",
        action="store_false",
        help="with the node fault, skip the 4-node demo's one-node loss that its figures are compared with",
    )
    parser.add_argument("--idle-s", type=float, default=30.0, help="idle window per size, seconds")
    parser.add_argument("--quick", action="store_true", help="64 nodes, one node and one rack, 10 s idle")
    parser.add_argument("--out", default=str(REPO / "docs" / "fleet-scale.json"))
    parser.add_argument("--plot", default="", help="draw the cost curve of --out's figures to this PNG")
    parser.add_argument("--workdir", default="", help="keep every process's logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    args.timings = TIMINGS
    if args.quick:
        args.sizes, args.faults, args.fault_sizes, args.idle_s = "64", "node,rack", "64", 10.0
        args.timings = QUICK_TIMINGS
    return args


async def run(args: argparse.Namespace) -> None:
    """``main``, stopped cleanly (every world's processes too) by SIGINT or SIGTERM."""
    task = asyncio.ensure_future(main(args))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


if __name__ == "__main__":
    asyncio.run(run(parse_args()))
