"""The suite's one support surface: what more than one test package uses. The pool, fast timings, phase
waits, load reaching the replicas, the procedure's result, the operator's CLI, a worker, the webhook served
on loopback, the simulated Jira, and the ledger reconciled against the world's own log.

The rule (checked by ``tests/test_suite_rules.py``):

* A helper used by more than one test package lives here (or, for a pytest plugin or a workflow the
  suite registers, in a top-level module of ``tests/``: ``pg.py``, ``timer_workflow.py``).
* A helper only one package uses lives in that package, in a non-test module named for what it holds:
  ``support.py`` (``tests/demo``, ``tests/kubectl``, ``tests/recovery``, ``tests/scale_down``, ``tests/sim``)
  or a module named for its one subject (``tests/fleet/fleets.py``, ``tests/ledger/world.py``,
  ``tests/deploy/manifests.py``, ``tls.py``, ``kube_calls.py``, ``tests/sim/serving_fixtures.py``).
* Nothing imports from a test module (``test_*.py``) or a ``conftest.py`` (fixtures stay there), and
  nothing imports a private name.

Conditions are waited on (a phase, a child, a result, a routed pool, load on a replica), never slept for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr
from sqlalchemy import create_engine, text
from starlette.types import ASGIApp
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.effects import JiraProject, operation_label
from fleet.incident import REPORT_LOSS_SIGNAL, LossReport, PoolRef
from fleet.recovery import (
    IncidentInput,
    Phase,
    ProcedureStatus,
    RecoveryTimings,
    RetryBudget,
    ServingObjectives,
)
from fleet.vocabulary import ROUTER_LABEL
from gateway.resources import DataPlaneSettings
from gateway.run import ControlPlaneThread, hosts_reader
from ledger.reconcile import ReconcileReport, reconcile
from worker.config import Settings, settings_environment
from worker.devstack.rbac_wiring import grant_components
from worker.devstack.rig import FAST_TIMINGS, FleetRig, compressed_scenario, fleet_rig
from worker.devstack.sim_wiring import SIM_JIRA_TOKEN
from worker.temporal_client import (
    execute_update as execute_update,  # operator answers, re-sent while not ready
)
from worker.webhook.app import ALERTMANAGER_PATH
from worker.worker import activity_threads, build_worker

REPO = Path(__file__).resolve().parents[1]
POOL = PoolRef(namespace="inference", service="llama")
RANK_POOL = PoolRef(namespace="inference", service="llama-405b")  # the rank-lost world's LWS pool
# ~400 tokens/s per replica in the compressed scenarios: about 15 requests/s of 8-32 tokens.
GROUP_CAPACITY_RPS = 15.0
# The node-monitor grace of a test that only needs a lost node to turn NotReady (not Kubernetes' 50 s).
SHORT_NODE_GRACE_S = 6.0

# The compressed world's timings (shared with the demo), with what the tests need besides: a reported pod
# that is in no group is looked for 30 s, not 120; a killed worker's activity is retried after its call
# timeout, and the budget leaves room for that.
FAST = FAST_TIMINGS.model_copy(
    update={
        "reappear_timeout_s": 30,
        "retry": RetryBudget(attempts=8, budget_s=90, call_timeout_s=10, max_interval_s=2),
    }
)

# A world with fleetmend's fast path (``rig.fast_path()``): its Lease where the shipped Role grants it,
# and timings short enough for a test.
FAST_PATH_SETTINGS: dict[str, Any] = {
    "recovery_timings": FAST,
    "serving_objectives": ServingObjectives(group_capacity_rps=GROUP_CAPACITY_RPS),
    "fastpath_lease_namespace": "fleetmend",  # where the shipped Role grants the Lease (deploy/k8s)
    # This 2-core machine runs the sim, the worker and the test in one process under 52 req/s: a
    # /health answer can take over the 1 s default, which would count as a failed check.
    "fastpath_health_timeout_s": 3.0,
    "fastpath_lease_duration_s": 3.0,
    "fastpath_renew_deadline_s": 2.0,
    "fastpath_retry_period_s": 0.5,
    "fastpath_watch_timeout_s": 5,
}


def component_kubeconfig(admin_kubeconfig: Path, component: str) -> Path:
    """A fleetmend component's own kubeconfig for a simulated cluster: its ServiceAccount under
    deploy/k8s's RBAC (``worker.devstack.rbac_wiring``), as in production; granted once per cluster."""
    path = admin_kubeconfig.parent / f"kubeconfig-{component}"
    return path if path.is_file() else grant_components(admin_kubeconfig)[component]


def incident_config(
    pool: PoolRef = POOL, *, dry_run: bool = False, timings: RecoveryTimings = FAST, **objectives: Any
) -> IncidentInput:
    return IncidentInput(
        pool=pool,
        dry_run=dry_run,
        timings=timings,
        objectives=ServingObjectives(group_capacity_rps=GROUP_CAPACITY_RPS, **objectives),
    )


def node_report(node: str, fingerprint: str = "fp-node", pool: PoolRef = POOL, **kw: Any) -> LossReport:
    return LossReport(pool=pool, fingerprint=fingerprint, alert_name="KubeNodeNotReady", node=node, **kw)


def pod_report(
    pod: str, fingerprint: str, alert: str = "FleetmendEndpointUnroutable", pool: PoolRef = POOL, **kw: Any
) -> LossReport:
    return LossReport(pool=pool, fingerprint=fingerprint, alert_name=alert, pod=pod, **kw)


T = TypeVar("T")


async def until(
    read: Callable[[], Awaitable[T]],
    holds: Callable[[T], bool],
    failure: Callable[[T | None], str],
    *,
    timeout_s: float,
    interval_s: float = 0.2,
    unavailable: tuple[type[BaseException], ...] = (),
) -> T:
    """``read()`` until ``holds`` of what it read, and that reading; after ``timeout_s`` an
    AssertionError saying ``failure(last reading)``. ``unavailable``: errors that mean "ask again"
    (no worker to answer a query right now, in the crash tests). Every wait of the suite's helpers."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while True:
        try:
            last = await read()
        except unavailable:
            pass
        else:
            if holds(last):
                return last
        if time.monotonic() > deadline:
            raise AssertionError(failure(last))
        await asyncio.sleep(interval_s)


async def status_of(handle: WorkflowHandle[Any, Any]) -> ProcedureStatus:
    return await handle.query("status", result_type=ProcedureStatus)


async def wait_for_child(
    client: Client, incident: WorkflowHandle[Any, Any], timeout_s: float = 30, *, after: int = 0
) -> WorkflowHandle[Any, Any]:
    """The incident's newest recovery once it exists (``after``: how many children it had before)."""

    async def newest() -> WorkflowHandle[Any, Any] | None:
        children = (await status_of(incident)).children
        if len(children) <= after:
            return None
        handle = client.get_workflow_handle(children[-1])
        await handle.describe()  # the incident names its child just before starting it
        return handle

    found = await until(
        newest,
        lambda h: h is not None,
        lambda _: f"no recovery started within {timeout_s} s",
        timeout_s=timeout_s,
        unavailable=(RPCError,),
    )
    assert found is not None
    return found


async def wait_for_phase(
    handle: WorkflowHandle[Any, Any], phase: Phase | Collection[Phase], timeout_s: float = 60
) -> ProcedureStatus:
    """The procedure's status once it is in ``phase`` (or in any of several: a short phase a poll
    may miss on a loaded machine is best awaited together with the ones that follow it)."""
    wanted = {phase} if isinstance(phase, Phase) else set(phase)

    def failure(status: ProcedureStatus | None) -> str:
        now = status.phase.value if status else "unknown"
        return (
            f"phase {' or '.join(sorted(p.value for p in wanted))} not reached within {timeout_s} s "
            f"(now {now})\n{decisions(status) if status else ''}"
        )

    return await until(
        lambda: status_of(handle),
        lambda status: status.phase in wanted,
        failure,
        timeout_s=timeout_s,
        unavailable=(RPCError,),
    )


async def ui_details(handle: WorkflowHandle[Any, Any]) -> str:
    """What the Temporal UI shows as the workflow's current details: its built-in
    ``__temporal_workflow_metadata`` query, the one the UI itself sends."""
    from temporalio.api.sdk.v1 import WorkflowMetadata

    meta = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    return str(meta.current_details)


async def finish(handle: WorkflowHandle[Any, Any], timeout_s: float = 150) -> ProcedureStatus:
    """The procedure's final status (its result), failing the test with its decisions if it did not end."""
    try:
        result = await asyncio.wait_for(handle.result(), timeout_s)
        return result if isinstance(result, ProcedureStatus) else ProcedureStatus.model_validate(result)
    except Exception as exc:
        status = await status_of(handle)
        desc = await handle.describe()
        pending = [
            f"{a.activity_type.name} attempt {a.attempt}: {a.last_failure.message if a.HasField('last_failure') else ''}"
            for a in desc.raw_description.pending_activities
        ]
        raise AssertionError(
            f"{handle.id} did not complete: {exc!r}\n{decisions(status)}\npending: {pending}"
        ) from exc


async def node_ready(rig: FleetRig, node: str) -> str | None:
    """The node's Ready condition status ("True", "False", "Unknown") as the API server has it now."""
    obj = await asyncio.to_thread(rig.core.read_node, node)
    return next((c.status for c in obj.status.conditions or [] if c.type == "Ready"), None)


async def until_node_ready(rig: FleetRig, node: str, ready: bool, timeout_s: float = 60) -> None:
    """Until the node's Ready condition is True (``ready``) or not True (the node monitor's verdict)."""
    await until(
        lambda: node_ready(rig, node),
        lambda status: (status == "True") == ready,
        lambda status: f"{node} Ready={status} after {timeout_s} s (wanted ready={ready})",
        timeout_s=timeout_s,
    )


async def node_cordoned(rig: FleetRig, node: str) -> bool:
    return bool((await asyncio.to_thread(rig.core.read_node, node)).spec.unschedulable)


def decisions(status: ProcedureStatus) -> str:
    return "\n".join(f"  [{d.phase.value}] {d.summary}" for d in status.decisions)


def cli_env(client: Client, task_queue: str) -> dict[str, str]:
    """The environment a ``fleetmend`` command needs to reach this test's Temporal and worker."""
    return {
        "FLEETMEND_TEMPORAL_ADDRESS": client.service_client.config.target_host,
        "FLEETMEND_TEMPORAL_NAMESPACE": client.namespace,
        "FLEETMEND_TASK_QUEUE": task_queue,
        "COLUMNS": "200",
    }


async def run_cli(env: dict[str, str], *args: str) -> Any:
    """``fleetmend ARGS`` in-process (typer's runner) on a thread: the commands run their own event loop."""
    from typer.testing import CliRunner

    from worker.cli.app import app

    return await asyncio.to_thread(CliRunner().invoke, app, list(args), env=env)


async def fleetmend_actions(rig: FleetRig) -> list[dict[str, Any]]:
    """The mutating requests fleetmend's worker made, from the world's own log."""
    return [a for a in await rig.actions() if "fleetmend-worker" in a["client"]]


async def reconcile_with_world(
    rig: FleetRig, database_url: str, *, check_missing: bool = False
) -> ReconcileReport:
    """The ledger reconciled against the world's records of fleetmend's requests.

    ``check_missing``: also every ``applied`` row's action must be in the world's log (valid
    when the simulator ran for the whole window, as in one test).
    """
    from activities.audit import world_record

    # The API server's audit log for Kubernetes actions, the sim's action log for the rest.
    worlds, actions = await asyncio.to_thread(world_record, rig.settings, None, "fleetmend-worker")
    engine = create_engine(database_url)
    try:
        return reconcile(engine, world=worlds, actions=actions, check_missing=check_missing)
    finally:
        engine.dispose()


def effect_states(database_url: str, op_id_like: str) -> list[str]:
    """The ledger states of the effects whose operation id is LIKE ``op_id_like``, in op-id order
    (a refused effect and its retry under a new operation id: ``["failed", "applied"]``)."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT state FROM ledger_effects WHERE op_id LIKE :like ORDER BY op_id"),
                {"like": op_id_like},
            ).all()
        return [r[0] for r in rows]
    finally:
        engine.dispose()


def worker_env(rig: FleetRig) -> dict[str, str]:
    """The environment of a ``fleetmend worker`` process wired like the rig's settings."""
    return {**os.environ, **settings_environment(rig.settings), "FLEETMEND_WORKER_METRICS_PORT": "0"}


def start_worker_process(
    rig: FleetRig, log: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A real ``fleetmend worker`` process (so a test can ``kill -9`` it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "worker"],
        env={**worker_env(rig), **(extra_env or {})},
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )


def stop_processes(*procs: subprocess.Popen[bytes] | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextlib.asynccontextmanager
async def rank_pool(
    client: Client, task_queue: str, ledger_url: str, **overrides: Any
) -> AsyncIterator[FleetRig]:
    """The compressed rank-lost world (two LeaderWorkerSet groups of ``RANK_POOL``) with a worker, once
    both groups are in the routing set. ``overrides`` go to ``fleet_rig``."""
    async with fleet_rig(
        client,
        scenario=compressed_scenario("rank-lost"),
        database_url=ledger_url,
        task_queue=task_queue,
        **overrides,
    ) as rig:
        await rig.pool_ready(RANK_POOL)
        yield rig


def refused_promotion(code: str) -> dict[str, Any]:
    """An admission policy (422) or RBAC (403) refusing the patch that routes to the gpu-node-loss world's
    warm spare (Deployment llama-spare): its pods *and* a body carrying the router label, nothing else."""
    return {
        "verbs": ["PATCH"],
        "path_contains": "/pods/llama-spare-",
        "body_contains": f'"{ROUTER_LABEL}"',
        "error": code,
    }


@contextlib.asynccontextmanager
async def gpu_pool(
    client: Client,
    task_queue: str,
    ledger_url: str,
    *,
    routed: int = 5,
    node_grace_s: float | None = None,
    **overrides: Any,
) -> AsyncIterator[FleetRig]:
    """The compressed gpu-node-loss world (5 serving TP=4 groups + 1 warm spare on 4 nodes) with a
    worker, once ``routed`` groups are in the routing set (0: at once). ``node_grace_s``: how long a
    lost node stays Ready (default Kubernetes' 50 s; a test about what happens once it is NotReady
    need not wait that out). ``overrides`` go to ``fleet_rig`` (settings, ``run_worker``,
    ``in_process_sim``)."""
    async with fleet_rig(
        client,
        scenario=compressed_scenario("gpu-node-loss", node_monitor_grace_s=node_grace_s),
        database_url=ledger_url,
        task_queue=task_queue,
        **overrides,
    ) as rig:
        if routed:
            await rig.pool_ready(POOL, routed)
        yield rig


async def routed(
    rig: FleetRig,
    where: Callable[[list[str]], bool],
    what: str,
    pool: PoolRef = POOL,
    *,
    timeout_s: float = 30,
) -> list[str]:
    """Envoy's routing set of ``pool`` once ``where`` holds of it (``what`` names the expectation).

    Read as a condition, never once: four worlds share the suite's two cores, and a world starved for
    a second answers its engines' /health late, so Envoy's active health checks fail every host for
    that moment and a single read can find nothing routed. A real deroute stays; this waits it out.
    """
    return await until(
        lambda: rig.routing_set(pool),
        where,
        lambda pods: f"Envoy's routing set of {pool.key} never held {what} in {timeout_s:g} s: {pods}",
        timeout_s=timeout_s,
    )


async def posted(rig: FleetRig, *words: str, timeout_s: float = 30) -> list[str]:
    """The incident channel's posts, once one of them holds every one of ``words``. A procedure enters
    its phase before its post goes out: wait for the post, never for a fixed time."""

    async def notes() -> list[str]:
        return [str(m["text"]) for m in await rig.notifications()]

    return await until(
        notes,
        lambda texts: any(all(w in t for w in words) for t in texts),
        lambda texts: f"no post saying {words} within {timeout_s:g} s: {texts}",
        timeout_s=timeout_s,
    )


async def load_reaches(
    rig: FleetRig,
    pool: PoolRef = POOL,
    pods: Collection[str] | None = None,
    *,
    requests: int = 2,
    in_flight: bool = False,
    timeout_s: float = 30,
) -> list[str]:
    """Until the users' load reaches each of ``pods`` (default: the pool's routed replicas): ``requests`` of
    it taken by each engine since the call, running or completed (``in_flight``: on the engine at once,
    running or queued, as streams a deletion would cut or a wedged engine holds), read from the engines' own
    ``/metrics``. Returns the pods.

    What a test waits for after starting load and before a fault: the procedure measures arrivals from its
    own first look on, so the load need only be flowing everywhere a loss can hit it.
    """
    from fleet.engine_metrics import parse_engine_metrics

    targets = sorted(pods) if pods is not None else await rig.routing_set(pool)

    async def taken(pod: str) -> tuple[float, float]:
        snap = parse_engine_metrics((await rig.engine_get(pool.namespace, pod, "/metrics")).text)
        return snap.running + snap.waiting, snap.request_success_total

    start = {pod: (await taken(pod))[1] for pod in targets}
    deadline = time.monotonic() + timeout_s
    short = list(targets)
    while short:
        now = {pod: await taken(pod) for pod in short}
        if in_flight:
            short = [pod for pod in short if now[pod][0] < requests]
        else:
            short = [pod for pod in short if now[pod][0] + now[pod][1] - start[pod] < requests]
        if not short:
            return targets
        if time.monotonic() > deadline:
            raise AssertionError(f"the load did not reach {short} within {timeout_s:g} s")
        await asyncio.sleep(0.2)
    return targets


# ---------------------------------------------------------------- the simulated Jira (sim.serving.jira)

JIRA_ISSUE_PATH = "/rest/api/2/issue"


def sim_jira(base_url: str) -> JiraProject:
    """The Jira project ``ticket.create`` opens issues in, on the simulator at ``base_url``."""
    return JiraProject(base_url=base_url, token=SecretStr(SIM_JIRA_TOKEN))


def jira_issues(http: httpx.Client, base_url: str = "", op_id: str | None = None) -> list[dict[str, Any]]:
    """The issues in the simulated Jira (those ``op_id`` opened, when given), as its search returns them."""
    jql = f'labels = "{operation_label(op_id)}"' if op_id else ""
    answer = http.get(
        f"{base_url}/rest/api/2/search",
        params={"jql": jql},
        headers={"Authorization": f"Bearer {SIM_JIRA_TOKEN}"},
    )
    answer.raise_for_status()
    return list(answer.json()["issues"])


def open_issue_by_hand(http: httpx.Client, base_url: str, summary: str) -> httpx.Response:
    """An issue opened outside fleetmend's ledger (an operator, or a request behind the ledger's back)."""
    fields = {"project": {"key": "OPS"}, "issuetype": {"name": "Task"}, "summary": summary}
    return http.post(
        f"{base_url}{JIRA_ISSUE_PATH}",
        json={"fields": fields},
        headers={"Authorization": f"Bearer {SIM_JIRA_TOKEN}"},
    )


# ---------------------------------------------------------------- the webhook, served on loopback (tests/webhook, tests/e2e)


@dataclass
class ServedWebhook:
    app: FastAPI
    base_url: str
    token: str
    settings: Settings

    @property
    def url(self) -> str:
        return self.base_url + ALERTMANAGER_PATH

    @property
    def auth(self) -> dict[str, str]:
        """The headers Alertmanager sends: its bearer token and the JSON content type."""
        return {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}

    def metric(self, name: str, **labels: str) -> float:
        value = self.app.state.metrics.registry.get_sample_value(name, labels or None)
        return float(value or 0.0)


@contextlib.contextmanager
def serve_webhook(app: ASGIApp, settings: Settings) -> Iterator[str]:
    """Serve ``app`` (the webhook's FastAPI app, or an ASGI wrapper of it) on a free loopback port
    in a background thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit this; without it each reply waits out a 40 ms delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_keep_alive=30)
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        for _ in range(400):
            if server.started:
                break
            if not thread.is_alive():
                raise RuntimeError("webhook server thread died during start-up")
            threading.Event().wait(0.025)
        else:
            raise RuntimeError("webhook server did not start within 10 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def webhook_settings(env: WorkflowEnvironment, task_queue: str, token: str, **overrides: Any) -> Settings:
    return Settings(
        temporal_address=env.client.service_client.config.target_host,
        temporal_namespace=env.client.namespace,
        task_queue=task_queue,
        webhook_token=SecretStr(token),
        **overrides,
    )


def pool_alert_labels(namespace: str, service: str, **extra: str) -> dict[str, str]:
    return {
        "alertname": "PoolReplicaDown",
        "namespace": namespace,
        "service": service,
        "severity": "critical",
        **extra,
    }


async def report_loss_signals(client: Client, workflow_id: str) -> list[dict[str, Any]]:
    """The ``report_loss`` payloads in the workflow's history, decoded as JSON."""
    signals = []
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            attrs = event.workflow_execution_signaled_event_attributes
            if attrs.signal_name == REPORT_LOSS_SIGNAL:
                signals.append(json.loads(attrs.input.payloads[0].data))
    return signals


async def workflow_ids(
    client: Client, query: str, *, at_least: int = 0, timeout_s: float = 10.0
) -> list[str]:
    """Workflow ids matching a visibility query, waiting up to ``timeout_s`` for ``at_least`` of them
    (visibility trails the start by a moment)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        ids = sorted([wf.id async for wf in client.list_workflows(query)])
        if len(ids) >= at_least or asyncio.get_running_loop().time() > deadline:
            return ids
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------- a worker in this process


@contextlib.asynccontextmanager
async def running_worker(
    client: Client,
    settings: Settings,
    *,
    workflows: Sequence[type] | None = None,
    activities: Sequence[Callable[..., Any]] | None = None,
) -> AsyncIterator[Worker]:
    """Run a real fleetmend worker (thread-pool activities) for the body of the ``async with``.

    Without ``workflows``/``activities`` it serves everything in ``worker.registry``.
    """
    with activity_threads(settings) as pool:
        worker = build_worker(
            client, settings, activity_executor=pool, workflows=workflows, activities=activities
        )
        async with worker:
            yield worker


async def restart_control_plane(
    rig: FleetRig, data_plane: DataPlaneSettings, *, reconnected: PoolRef | None = None, timeout_s: float = 60
) -> None:
    """Stop the rig's fleetmend control plane and start it again on the same port with ``data_plane``
    (Envoy reconnects and takes the clusters it now serves). ``reconnected``: also wait until Envoy is
    back and the routing set of that pool reads again."""
    gw = rig.gateway
    assert gw.plane is not None
    port = gw.plane.port
    await asyncio.to_thread(gw.plane.stop)
    gw.plane = await asyncio.to_thread(
        ControlPlaneThread(
            hosts_reader(gw.kubeconfig, None), gw.database_url, port=port, data_plane=data_plane
        ).start
    )
    if reconnected is None:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await rig.routing_set(reconnected):
                return
        except Exception as err:  # no Envoy connected yet
            if time.monotonic() > deadline:
                raise AssertionError(f"Envoy did not reconnect within {timeout_s:g} s: {err}") from err
        await asyncio.sleep(0.2)
