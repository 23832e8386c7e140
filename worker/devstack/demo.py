"""``fleetmend demo``: stage one incident on the embedded stack and show fleetmend handling it.

The run starts the same stack as ``fleetmend dev`` (Temporal + Web UI, Postgres,
the sim, the webhook, the worker) in a fresh state directory, loads the
scenario's fleet, puts user load on it, causes the fault and lets the real
alert path open the incident: Prometheus scrapes the sim, Alertmanager posts to
the webhook (when both are installed; otherwise an Alertmanager-format payload
is posted directly, and the demo says so). A live view shows the procedure's
phases and decisions as they happen and the users' figures ticking. The run
ends with a summary table, an optional JSON report and a verdict: the
workflow's own verification plus the world's action log checked against the
ledger (no duplicate action, no orphaned pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from temporalio.client import Client, WorkflowHandle, WorkflowQueryFailedError
from temporalio.service import RPCError

from activities.envoy_gateway import EnvoyGateway
from activities.gateway import Gateway
from fleet.arrivals import PRE_LOSS_GAP_S, PRE_LOSS_WINDOW_S
from fleet.gateway import JournalEntry, Outcome
from fleet.incident import PoolRef, incident_workflow_id, scale_down_workflow_id
from fleet.recovery import TERMINAL_PHASES, Phase, ProcedureStatus, ServingObjectives
from fleet.shedding import ShedLevel, account_shedding
from fleet.vocabulary import LWS_GROUP_INDEX_LABEL, LWS_NAME_LABEL, LWS_WORKER_INDEX_LABEL, REVISION_LABEL
from gateway.store import GatewayStore
from ledger.store import make_engine
from sim.control import FaultRequest
from sim.serving.agents import jira_record
from worker.config import KEPT_STACK_FILE, Settings, kept_stack_env
from worker.devstack.rig import FAST_TIMINGS, compressed_scenario
from worker.devstack.scenarios import GROUP_CAPACITY_RPS, DemoScenario, PodPlace, Verdict, lost_group_pods
from worker.devstack.sim_process import scenario_file
from worker.devstack.stack import ALL_PARTS, DevStack, display_database_url
from worker.processes import StackError
from worker.webhook.app import ALERTMANAGER_PATH
from worker.webhook.examples import example_payload
from worker.webhook.pipeline import RunningPipeline, alert_pipeline, pipeline_binaries

# The procedure's waits for a demo: the compressed world's (shared with the tests), with an approval
# --keep-running leaves time to give by hand (`fleetmend approve`).
DEMO_TIMINGS = FAST_TIMINGS.model_copy(update={"approval_timeout_s": 600})
NODE_GRACE_S = 5.0
# A replica's start-up (image pull + weight load + distributed init) and its prefix-cache warm-up, compressed:
# long enough that the ramp-back re-measures a cold replacement several times (every ramp_interval_s).
STARTUP_S = 4.0
WARM_UP_S = 8.0
FLEET_UP_TIMEOUT_S = 60.0
ALERT_TIMEOUT_S = 45.0
PROCEDURE_TIMEOUT_S = 150.0
LOAD_DURATION_S = 240.0
WORKER_CLIENT_MARK = "fleetmend-worker"  # how the worker's requests are named in the world's log


class DemoError(Exception):
    """The demo could not stage its incident (not a verdict on fleetmend): one actionable line."""


@dataclass
class DemoRun:
    """What the live view and the report read: the procedure, the users' load, the alert path."""

    scenario: DemoScenario
    ui_url: str
    t0: float = 0.0
    workflow_id: str | None = None
    status: ProcedureStatus | None = None
    load: dict[str, Any] = field(default_factory=dict)
    alert_path: str = "none"
    notices: list[str] = field(default_factory=list)
    cut_streams: tuple[int, int] | None = None  # (by the fault, elsewhere) from the gateway journal
    # The request figures as the gateway counted them (Envoy's access-log service): see gateway_figures.
    gateway_requests: dict[str, int] = field(default_factory=dict)
    pods_before: dict[str, PodPlace] = field(default_factory=dict)  # the namespace just before the fault
    lost_pods: set[str] = field(default_factory=set)  # every pod of every replica group the fault took

    def workflow_url(self) -> str | None:
        if self.workflow_id is None:
            return None
        from urllib.parse import quote

        return f"{self.ui_url.rstrip('/')}/namespaces/default/workflows/{quote(self.workflow_id, safe='')}"


def demo_settings(base: Settings, scenario: DemoScenario) -> Settings:
    """Settings for a demo run: a fresh state dir, the compressed scenario, short procedure timings."""
    state = base.state_dir / "demo"
    kept = kept_stack_env(base.state_dir)
    if kept is not None:  # never wipe the state (ledger, history) of a demo that still runs
        raise DemoError(
            f"a demo is already running under {state} ({kept[0]}): stop it (Ctrl-C in its terminal) first, "
            "or set FLEETMEND_STATE_DIR to another directory"
        )
    shutil.rmtree(state, ignore_errors=True)  # a new world per run: no history from earlier runs
    state.mkdir(parents=True)
    if scenario.compressed:
        # Kubernetes notices a dead kubelet after the node-monitor grace period (50 s by default);
        # compressed like the rest of the scenario, so the alert path takes seconds.
        sim = compressed_scenario(
            scenario.sim_scenario,
            startup_s=STARTUP_S,
            warm_up_s=scenario.warm_up_s or WARM_UP_S,
            node_monitor_grace_s=NODE_GRACE_S,
        )
    else:
        from sim.scenario import SCENARIO_DIR, load_scenario

        sim = load_scenario(SCENARIO_DIR / f"{scenario.sim_scenario}.yaml")
    sim_file = scenario_file(sim, state)
    # The demo's Envoy and control plane take free ports unless told otherwise: two demos (or a
    # demo beside `fleetmend dev`) never fight over 8080 / 9901 / 18000.
    ports = {
        name: 0
        for name in ("gateway_listen_port", "gateway_admin_port", "xds_port")
        if name not in base.model_fields_set
    }
    return base.model_copy(
        update={
            "state_dir": state,
            "sim_scenario": sim_file,
            "recovery_timings": DEMO_TIMINGS,
            "serving_objectives": ServingObjectives(group_capacity_rps=GROUP_CAPACITY_RPS),
            **ports,
        }
    )


# ============================================================================ the kept stack

# What a command in another shell needs to reach the demo's stack (worker.config.adopt_kept_stack reads them).
STACK_ENV_SETTINGS = (
    "state_dir",
    "temporal_address",
    "temporal_namespace",
    "task_queue",
    "temporal_ui_url",
    "database_url",
    "webhook_host",
    "webhook_port",
    "kubeconfig",
    "gateway",
    "gateway_admin_urls",
    "sim_url",
    "action_log_url",
)


def stack_env_lines(settings: Settings) -> list[str]:
    """``export FLEETMEND_X='value'`` for every setting a client command needs (paths absolute)."""
    lines = []
    for name in STACK_ENV_SETTINGS:
        value = getattr(settings, name)
        if value is None:
            continue
        if name == "database_url":
            value = settings.database_url_value()
        elif isinstance(value, Path):
            value = value.resolve()
        elif isinstance(value, list):  # pydantic-settings reads list settings as JSON
            value = json.dumps([str(v.resolve() if isinstance(v, Path) else v) for v in value])
        lines.append(f"export FLEETMEND_{name.upper()}={shlex.quote(str(value))}")
    return lines


def write_stack_env(settings: Settings) -> Path:
    """Write ``<state dir>/stack.env`` (0600, shell-sourceable, with this process's pid); return its path."""
    path = settings.state_dir.resolve() / KEPT_STACK_FILE
    text = "\n".join(
        [
            "# The running `fleetmend demo` stack. fleetmend commands find it by themselves while the demo runs;",
            f"# a shell elsewhere: . {shlex.quote(str(path))}",
            f"# pid={os.getpid()}",
            *stack_env_lines(settings),
        ]
    )
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text + "\n")
    tmp.replace(path)
    return path


@contextlib.asynccontextmanager
async def stack_env(settings: Settings) -> AsyncIterator[Path]:
    """The stack's ``stack.env`` for as long as the demo runs (removed when it stops)."""
    path = write_stack_env(settings)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def keep_running_hint(env_file: Path) -> str:
    lines = [
        "--keep-running: the stack stays up; Ctrl-C stops everything.",
        "In another shell here, fleetmend commands find it by themselves: `fleetmend status`, "
        "`fleetmend ledger list`, `fleetmend alert --example node-not-ready > a.json && fleetmend alert -f a.json`.",
        f"Anywhere else: `. {shlex.quote(str(env_file))}`, or",
    ]
    for line in env_file.read_text().splitlines():
        if line.startswith("export "):
            if line.startswith("export FLEETMEND_DATABASE_URL="):
                name, _, value = line.partition("=")
                line = f"{name}={shlex.quote(display_database_url(shlex.split(value)[0]))}"
            lines.append(f"  {line}")
    return "\n".join(lines)


# ============================================================================ the world


class World:
    """The sim's HTTP API and Kubernetes API, as the demo uses them."""

    def __init__(self, http: httpx.AsyncClient, kubeconfig: Path, gateway: Gateway) -> None:
        from kubernetes import client as kc
        from kubernetes import config as kconfig

        self.http = http
        api = kconfig.new_client_from_config(config_file=str(kubeconfig))
        self.core = kc.CoreV1Api(api)
        self.coordination = kc.CoordinationV1Api(api)
        self.gateway = gateway

    async def led_since(self, namespace: str, lease: str) -> float | None:
        """When the Lease's holder acquired it (unix seconds), or None while nobody holds it (no
        holder, or one that has not renewed within the lease's duration)."""
        from kubernetes.client.exceptions import ApiException

        try:
            spec = (await asyncio.to_thread(self.coordination.read_namespaced_lease, lease, namespace)).spec
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        if spec is None or not spec.holder_identity or spec.acquire_time is None or spec.renew_time is None:
            return None
        if time.time() - spec.renew_time.timestamp() > float(spec.lease_duration_seconds or 15):
            return None
        return float(spec.acquire_time.timestamp())

    async def routed(self, pool: PoolRef) -> list[str]:
        """The pods Envoy would send the pool's next request to."""
        return [e.pod for e in (await asyncio.to_thread(self.gateway.routing_set, pool)).endpoints]

    async def pods(self, namespace: str) -> list[Any]:
        result = await asyncio.to_thread(self.core.list_namespaced_pod, namespace)
        return list(result.items)

    async def start_load(self, body: dict[str, Any]) -> str:
        r = await self.http.post("/sim/v1/load", json=body)
        r.raise_for_status()
        return str(r.json()["id"])

    async def load_report(self, run_id: str) -> dict[str, Any]:
        r = await self.http.get(f"/sim/v1/load/{run_id}")
        r.raise_for_status()
        return dict(r.json())

    async def load_grade(self, run_id: str) -> dict[str, Any]:
        """The users' requests graded by the world (``sim.serving.grade``): those whose deadlines have
        passed, replayed against the capacity the world really had."""
        r = await self.http.get(f"/sim/v1/load/{run_id}/grade", params={"settled": "true"})
        r.raise_for_status()
        return dict(r.json())

    async def pod_places(self, namespace: str) -> dict[str, PodPlace]:
        """Every pod of the namespace with its node, replica group and uid (taken just before the fault).

        The group is what fleetmend's observation calls it (``activities.observe``): a LeaderWorkerSet
        group is ``<lws name>-<group index>``, any other pod is a group of its own.
        """
        places: dict[str, PodPlace] = {}
        for pod in await self.pods(namespace):
            labels = pod.metadata.labels or {}
            name = pod.metadata.name
            group = (
                f"{labels[LWS_NAME_LABEL]}-{labels.get(LWS_GROUP_INDEX_LABEL, '0')}"
                if LWS_NAME_LABEL in labels
                else name
            )
            places[name] = PodPlace(name=name, uid=pod.metadata.uid, node=pod.spec.node_name, group=group)
        return places

    async def replaced_since(self, namespace: str, before: dict[str, PodPlace]) -> dict[str, float]:
        """Pod names that now belong to a new pod (a LeaderWorkerSet recreates a group under the same
        names): name -> the moment from which a stream on that name is the new pod's.

        creationTimestamp has second precision, so the moment is the second after it: the old pod's
        streams all started before the new pod existed, and the new pod serves its first token only
        after its start-up (seconds: image, weights, distributed init)."""
        replaced: dict[str, float] = {}
        for pod in await self.pods(namespace):
            old = before.get(pod.metadata.name)
            if old is not None and pod.metadata.uid != old.uid and pod.metadata.creation_timestamp:
                replaced[old.name] = pod.metadata.creation_timestamp.timestamp() + 1.0
        return replaced

    async def journal(self, pool: PoolRef) -> list[JournalEntry]:
        """Every request of the pool as Envoy reported it (its access-log service)."""
        return await asyncio.to_thread(self.gateway.request_outcomes, pool)

    async def gateway_figures(self, pool: PoolRef) -> dict[str, int]:
        """The report's request figures as the gateway counted them (``gateway_figures``)."""
        return gateway_figures(await self.journal(pool))

    async def inject(self, fault: FaultRequest) -> None:
        r = await self.http.post("/sim/v1/faults", json=fault.model_dump(mode="json"))
        r.raise_for_status()

    async def fleetmend_actions(self) -> list[dict[str, Any]]:
        r = await self.http.get("/sim/v1/actions")
        r.raise_for_status()
        return [a for a in r.json() if WORKER_CLIENT_MARK in (a.get("client") or "")]


def gateway_figures(entries: list[JournalEntry]) -> dict[str, int]:
    """Requests as the gateway saw them: one per request id however many attempts it took; its
    outcome is its last attempt's. Envoy does not know a request's deadline, so ``late`` is the
    users' count (the load generator's clock), added by the report."""
    last: dict[str, JournalEntry] = {}
    attempts: dict[str, int] = {}
    for e in sorted(entries, key=lambda e: (e.ended_at, e.attempt)):
        last[e.request_id] = e
        attempts[e.request_id] = max(attempts.get(e.request_id, 0), e.attempt)
    counts = {o: 0 for o in Outcome}
    for e in last.values():
        counts[e.outcome] += 1
    return {
        "total": len(last),
        "completed": counts[Outcome.COMPLETED] + counts[Outcome.LATE],
        "shed": counts[Outcome.SHED],
        "rejected": counts[Outcome.REJECTED],
        "terminal_errors": counts[Outcome.TERMINAL_ERROR],
        "retried": sum(1 for n in attempts.values() if n > 1),
    }


def count_cuts(
    entries: list[JournalEntry], lost_pods: set[str], replaced_since: dict[str, float]
) -> tuple[int, int]:
    """Streams that ended after their first token without finishing:
    (cut on a replica group the fault took - each ended with an explicit terminal error -,
    cut anywhere else - what fleetmend's own actions must never do).

    ``lost_pods`` holds every pod of every lost group (the journal names a multi-pod group by its
    leader, and a dead worker rank cuts the leader's streams); a stream on a lost pod's name that
    started once a new pod took that name is the new pod's, so it counts as cut elsewhere."""
    by_fault = elsewhere = 0
    for e in entries:
        if not (e.truncated and (e.tokens_streamed > 0 or e.bytes_sent > 0)):
            continue
        replica = e.replica or ""
        if replica in lost_pods and e.started_at < replaced_since.get(replica, float("inf")):
            by_fault += 1
        else:
            elsewhere += 1
    return by_fault, elsewhere


# Healthy serving (and scrapes) before the fault; and the worker's fast path must have counted the
# users' arrivals for long enough that a loss it reports carries the rate from before the loss
# (``fleet.arrivals.arrivals_before``: a window of up to PRE_LOSS_WINDOW_S ending PRE_LOSS_GAP_S
# before the loss's first sign). A production fleet is always under load and its fast path always
# counting; the demo starts both a moment before the fault, so it waits until the whole window holds
# the users' load (not the idle seconds before it) and the fast path has led through it.
HEALTHY_BEFORE_FAULT_S = 3.0
COUNTED_BEFORE_FAULT_S = PRE_LOSS_WINDOW_S + PRE_LOSS_GAP_S + 0.5


async def healthy_serving_counted(
    world: World, settings: Settings, load_started: float, healthy_s: float = HEALTHY_BEFORE_FAULT_S
) -> None:
    """Until the users have been served ``healthy_s`` more seconds and, with the fast path on, for
    ``COUNTED_BEFORE_FAULT_S`` since ``load_started`` (unix seconds) with the fast path's leader
    holding its Lease all along."""
    serving_from = time.time()

    async def ready() -> bool:
        now = time.time()
        if now - serving_from < healthy_s:
            return False
        if not settings.fastpath_enabled:
            return True
        since = await world.led_since(settings.fastpath_lease_namespace, settings.fastpath_lease_name)
        counting_from = None if since is None else max(since, load_started)
        return counting_from is not None and now - counting_from >= COUNTED_BEFORE_FAULT_S

    await _until(
        "the fast path to lead and count the pool's arrivals", ready, FLEET_UP_TIMEOUT_S, interval_s=0.2
    )


async def _until(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(interval_s)
    raise DemoError(f"timed out after {timeout_s:.0f} s waiting for {what}")


async def choose_pod(world: World, scenario: DemoScenario, chooser: str) -> str:
    """The pod a pod-level fault or alert is about (``pod:serving|rank|r2``)."""
    ns = scenario.pool.namespace
    if chooser == "pod:serving":
        return sorted(await world.routed(scenario.pool))[0]

    async def matching() -> str | None:
        pods = await world.pods(ns)
        labels = [(p.metadata.name, p.metadata.labels or {}) for p in pods]
        if chooser == "pod:rank":
            names = sorted(n for n, lab in labels if lab.get(LWS_WORKER_INDEX_LABEL) == "1")
        else:  # pod:r2 -- the first pod of the new revision (the sim's rollout)
            names = sorted(n for n, lab in labels if lab.get(REVISION_LABEL) == "r2")
        return names[0] if names else None

    return str(await _until(f"a pod for {chooser}", matching, 40))


async def orphan_pods(world: World, namespace: str) -> list[str]:
    """Pods no controller owns any more (a relabel that broke a selector orphans its pod)."""
    return sorted(p.metadata.name for p in await world.pods(namespace) if not p.metadata.owner_references)


# ============================================================================ the alert path


async def _incident_opened(client: Client, workflow_id: str) -> bool:
    try:
        await client.get_workflow_handle(workflow_id).describe()
    except RPCError:
        return False
    return True


async def post_alert(settings: Settings, payload: dict[str, Any]) -> None:
    """What Alertmanager would do: POST the notification with the bearer token."""
    token = settings.webhook_token.get_secret_value() if settings.webhook_token else ""
    url = f"http://{settings.webhook_host}:{settings.webhook_port}{ALERTMANAGER_PATH}"
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(url, json=payload, headers={"Authorization": f"Bearer {token}"})
    if r.status_code >= 300:
        raise DemoError(f"the webhook refused the alert: HTTP {r.status_code} {r.text[:200]}")


@contextlib.asynccontextmanager
async def maybe_pipeline(stack: DevStack, run: DemoRun) -> AsyncIterator[RunningPipeline | None]:
    binaries = pipeline_binaries()
    alert = run.scenario.alert
    if alert is None:
        yield None
        return
    if binaries is None or not alert.rule_fires:
        run.notices.append(
            "Prometheus/Alertmanager not installed (`make system-deps`): the alert is posted directly "
            "in Alertmanager's format"
            if binaries is None
            else f"no shipped Prometheus rule fires for this symptom: the {alert.example!r} alert is "
            "posted directly in Alertmanager's format"
        )
        yield None
        return
    s = stack.settings
    token = s.webhook_token.get_secret_value() if s.webhook_token else ""
    metrics = f"{s.worker_metrics_host}:{s.worker_metrics_port}" if s.worker_metrics_port else None
    async with alert_pipeline(
        s.state_dir / "alerting",
        binaries=binaries,
        sim_address=s.sim_url.removeprefix("http://").rstrip("/"),
        webhook_address=f"{s.webhook_host}:{s.webhook_port}",
        webhook_token=token,
        worker_metrics_address=metrics,
    ) as pipeline:
        yield pipeline


async def deliver_alert(
    stack: DevStack, run: DemoRun, pipeline: RunningPipeline | None, pod: str | None
) -> None:
    """Wait for Alertmanager to open the incident; post the alert directly when there is no pipeline."""
    alert = run.scenario.alert
    assert alert is not None
    incident_id = incident_workflow_id(run.scenario.pool)
    labels = {k: v.format(pod=pod or "") for k, v in alert.labels.items()}
    if pipeline is not None:
        run.alert_path = "prometheus -> alertmanager -> webhook"
        try:
            await _until(
                "Alertmanager to open the incident",
                lambda: _incident_opened(stack.client, incident_id),
                ALERT_TIMEOUT_S,
                0.5,
            )
            return
        except DemoError:
            run.notices.append(
                f"no alert reached the webhook through Alertmanager within {ALERT_TIMEOUT_S:.0f} s "
                f"(logs: {', '.join(str(p) for p in pipeline.logs)}); posting it directly"
            )
    run.alert_path = "direct Alertmanager-format post -> webhook"
    await post_alert(stack.settings, example_payload(alert.example, overrides=labels))
    await _until("the webhook to open the incident", lambda: _incident_opened(stack.client, incident_id), 20)


async def procedure_handle(client: Client, run: DemoRun) -> WorkflowHandle[Any, Any]:
    """The replica-loss recovery the incident started (its first child)."""
    incident = client.get_workflow_handle(incident_workflow_id(run.scenario.pool))

    async def first_child() -> str | None:
        status = await incident.query("status", result_type=ProcedureStatus)
        return status.children[0] if status.children else None

    child = await _until("the incident to start a recovery", first_child, 30)
    return client.get_workflow_handle(child)


async def start_scale_down(stack: DevStack, run: DemoRun) -> WorkflowHandle[Any, Any]:
    """A planned scale-down as ``fleetmend schedule trigger`` starts it: 8 -> 6, streaming load on."""
    from fleet.scale_down import ScaleDownInput

    inp = ScaleDownInput(
        pool=run.scenario.pool,
        target_groups=run.scenario.serving_groups - 2,
        drain_deadline_s=60.0,
        poll_interval_s=0.3,
        incident_poll_s=1.0,
        group_capacity_tokens_per_s=2400.0,  # the scale-down scenario's warm decode rate
        requested_by="fleetmend demo",
    )
    run.alert_path = "planned (no alert): started like `fleetmend schedule trigger`"
    return await stack.client.start_workflow(
        "PlannedScaleDown",
        inp,
        id=scale_down_workflow_id(run.scenario.pool),
        task_queue=stack.settings.task_queue,
        static_summary=f"Demo: planned scale-down of {run.scenario.pool.key} to {inp.target_groups}",
    )


# ============================================================================ the view


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return "-" if value is None else str(value)


def timeline(run: DemoRun) -> Table:
    table = Table(title=f"fleetmend demo: {run.scenario.name}", title_justify="left", expand=True)
    table.add_column("t (s)", justify="right", no_wrap=True)
    table.add_column("phase", style="bold cyan", no_wrap=True)
    table.add_column("took", justify="right", no_wrap=True)
    table.add_column("decisions (why)", overflow="fold")
    status = run.status
    if status is None:
        table.add_row("", "waiting", "", "the alert is on its way ...")
        return table
    for span in status.phases:
        took = f"{span.end - span.start:.1f}s" if span.end is not None else "…"
        said = [d.summary for d in status.decisions if d.phase == span.name and span.start <= d.at + 1e-6]
        said = [d for d in said if d] or [""]
        table.add_row(f"{span.start - run.t0:+.1f}", span.name.value, took, "\n".join(said[-4:]))
    return table


def load_line(run: DemoRun) -> Text:
    r = run.load
    if not r:
        return Text("users: load starting ...")
    return Text.assemble(
        ("users  ", "bold"),
        f"sent {r.get('sent', 0)}  ",
        ("goodput ", "green"),
        f"{r.get('goodput', 0)}  ",
        ("late ", "yellow"),
        f"{r.get('late', 0)}  ",
        ("shed ", "magenta"),
        f"{r.get('shed', 0)}  ",
        ("errors ", "red"),
        f"{r.get('terminal_errors', 0)} (truncated {r.get('truncated_streams', 0)})  ",
        f"retried {r.get('retried', 0)}",
    )


def live_view(run: DemoRun) -> Group:
    parts: list[Any] = [timeline(run), load_line(run)]
    url = run.workflow_url()
    if url:
        parts.append(Text(f"Temporal UI: {url}", style="cyan"))
    if run.status is not None and run.status.awaiting:
        parts.append(Text(f"awaiting operator: {run.status.awaiting}", style="bold yellow"))
    for notice in run.notices:
        parts.append(Text(f"note: {notice}", style="yellow"))
    return Group(*parts)


async def follow(
    handle: WorkflowHandle[Any, Any], world: World, load_id: str, run: DemoRun, console: Console
) -> ProcedureStatus:
    """Refresh the live view until the procedure ends (or stops for an operator, when expected)."""
    deadline = time.monotonic() + PROCEDURE_TIMEOUT_S
    with Live(live_view(run), console=console, refresh_per_second=4, transient=False) as live:
        while True:
            # A query can fail while the worker is between tasks; the next refresh asks again.
            with contextlib.suppress(RPCError, WorkflowQueryFailedError):
                run.status = await handle.query("status", result_type=ProcedureStatus)
            with contextlib.suppress(httpx.HTTPError):
                run.load = await world.load_report(load_id)
            live.update(live_view(run))
            status = run.status
            if status is not None and (
                status.phase in TERMINAL_PHASES or (run.scenario.stops_awaiting_operator and status.awaiting)
            ):
                return status
            if time.monotonic() > deadline:
                if status is None:
                    raise DemoError(f"the procedure never answered its status query ({handle.id})")
                run.notices.append(f"the procedure did not finish within {PROCEDURE_TIMEOUT_S:.0f} s")
                live.update(live_view(run))
                return status
            await asyncio.sleep(0.5)


# ============================================================================ the report


async def fleetmend_metrics(settings: Settings) -> dict[str, float]:
    """fleetmend's own samples from the worker's Prometheus endpoint (``worker.fleet_metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    if not settings.worker_metrics_port:
        return {}
    url = f"http://{settings.worker_metrics_host}:{settings.worker_metrics_port}/metrics"
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(url)).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("fleetmend_") or sample.name.endswith("_bucket"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "service")
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def reconcile_with_world(database_url: str, settings: Settings) -> Any:
    """The ledger against the world's records: the API server's audit log, the sim's action log."""
    from sqlalchemy import create_engine

    from activities.audit import world_record
    from ledger.reconcile import reconcile

    worlds, actions = world_record(settings, None, WORKER_CLIENT_MARK)
    engine = create_engine(database_url)
    try:
        return reconcile(engine, world=worlds, actions=actions)
    finally:
        engine.dispose()


def build_report(
    run: DemoRun,
    status: ProcedureStatus,
    verdict: Verdict,
    *,
    duplicates: int,
    orphans: list[str],
    divergent: int,
    unledgered: int,
    mutations: int,
    elapsed_s: float,
) -> dict[str, Any]:
    f = status.figures
    load = run.load
    in_flight = f.get("in_flight") or {}
    return {
        "scenario": run.scenario.name,
        "verdict": "passed" if verdict.passed else "failed",
        "verdict_reason": verdict.reason,
        "passed_when": run.scenario.passed_when,
        "workflow_id": status.workflow,
        "temporal_ui": run.workflow_url(),
        "alert_path": run.alert_path,
        # Who opened the incident: the worker's fast path (the alert, later, absorbed) or the alert.
        "opened_by": (
            "fast path (watch + /health); the alert absorbed"
            if any(d.summary.startswith("reported by the fast path") for d in status.decisions)
            else "alert path"
        ),
        "final_phase": status.phase.value,
        "awaiting": status.awaiting,
        "phases": [
            {
                "name": p.name.value,
                "start": round(p.start - run.t0, 2),
                "end": None if p.end is None else round(p.end - run.t0, 2),
            }
            for p in status.phases
        ],
        # Fault -> the lost endpoints out of routing (Kubernetes' grace + the alert path + fleetmend),
        # then the part that is fleetmend's: first signal -> derouted.
        "deroute_seconds": _deroute_after_fault(run, status),
        "alert_seconds": round(status.phases[0].start - run.t0, 2) if status.phases else None,
        "fleetmend_deroute_seconds": f.get("deroute_seconds"),
        # The request figures are the gateway's (Envoy's access log); "late" is the users' clock, and
        # "users" is what the load generator itself counted, for comparison.
        "requests": {
            **(
                {
                    k: run.gateway_requests[k]
                    for k in ("total", "completed", "retried", "terminal_errors", "shed")
                }
                if run.gateway_requests
                else {
                    "total": load.get("sent", 0),
                    "completed": load.get("goodput", 0) + load.get("late", 0),
                    "retried": load.get("retried", 0),
                    "terminal_errors": load.get("terminal_errors", 0),
                    "shed": load.get("shed", 0),
                }
            ),
            "late": load.get("late", 0),
            # Cut by fleetmend's own actions (or anything but the fault): must be 0.
            "truncated": run.cut_streams[1] if run.cut_streams else load.get("truncated_streams", 0),
            # Cut mid-stream by the fault itself: each ended with an explicit terminal stream error.
            "cut_by_fault": run.cut_streams[0] if run.cut_streams else None,
        },
        "requests_counted_by": "gateway" if run.gateway_requests else "users",
        "users": {
            k: load.get(k, 0)
            for k in (
                "sent",
                "goodput",
                "late",
                "shed",
                "shed_with_retry_after",
                "rejected",
                "terminal_errors",
            )
        },
        "lost_replicas_requests": in_flight or None,
        "lost_pods": sorted(run.lost_pods),  # the world's view: every pod of every group the fault took
        "effects": {
            "applied": f.get("effects_applied", 0),
            "deduplicated": f.get("effects_deduplicated", 0),
            "divergent": divergent,
        },
        "duplicate_actions": duplicates,
        "orphan_pods": len(orphans),
        "orphan_pod_names": orphans,
        "unledgered_actions": unledgered,
        "mutating_requests": mutations,
        "lead_time_announced_seconds": f.get("lead_time_announced_seconds"),
        "shed_tiers": f.get("shed_tiers"),
        "shedding": _shedding_account(run, f, load),
        "shedding_lifted": f.get("shedding_lifted"),
        "promoted": f.get("promoted"),
        "fault_class": f.get("fault_class"),
        "ramp_weights": f.get("ramp_weights"),
        # Every ramp step's weights as applied (the last is ``ramp_weights``): a cold replacement's
        # weight below 1.0 while it warms, its measured rate against the established replicas'.
        "ramp_steps": [
            {"t": round(d.at - run.t0, 2), "weights": d.figures["weights"]}
            for d in status.decisions
            if d.phase == Phase.RAMPING and "weights" in d.figures
        ],
        "verification": status.verification.model_dump(mode="json") if status.verification else None,
        "decisions": [
            {"t": round(d.at - run.t0, 2), "phase": d.phase.value, "summary": d.summary}
            for d in status.decisions
        ],
        "notices": run.notices,
        "duration_seconds": round(elapsed_s, 1),
    }


def _shedding_account(run: DemoRun, figures: dict[str, Any], load: dict[str, Any]) -> dict[str, Any] | None:
    """Users refused vs the capacity gap the incident recorded (shares of all arrivals), at the users' rate.
    No over-shed here: graded against fleetmend's own estimate it read 0 for any over-estimate; the
    report's ``shedding_graded_by_the_world`` is the grade."""
    levels = [ShedLevel.model_validate(lv) for lv in figures.get("shed_levels") or []]
    if not levels:
        return None
    account = account_shedding(
        levels,
        arrivals=int(run.gateway_requests.get("total", load.get("sent", 0))),
        shed=int(run.gateway_requests.get("shed", load.get("shed", 0))),
        arrival_rps=float(run.scenario.load_rate),
        until=time.time(),
    )
    return {
        "refused": f"{account.refused_share:.1%}",
        "gap": f"{account.gap_share:.1%}",
        "levels": " ".join(f"{lv.at - run.t0:+.1f}s:{lv.refused:.1%}" for lv in levels),
    }


def _deroute_after_fault(run: DemoRun, status: ProcedureStatus) -> float | None:
    ends = [p.end for p in status.phases if p.name == Phase.DEROUTING and p.end is not None]
    return round(max(ends) - run.t0, 2) if ends else None


SUMMARY_KEYS = (
    "scenario",
    "verdict",
    "verdict_reason",
    "alert_path",
    "opened_by",
    "alert_seconds",
    "deroute_seconds",
    "fleetmend_deroute_seconds",
    "requests",
    "gateway",
    "effects",
    "duplicate_actions",
    "orphan_pods",
    "lead_time_announced_seconds",
    "shed_tiers",
    "shedding",
    "shedding_graded_by_the_world",
    "promoted",
    "fault_class",
    "ramp_weights",
    "final_phase",
    "duration_seconds",
)


async def gateway_report(world: World, pool: PoolRef) -> dict[str, Any]:
    """The weights the gateway runs now, read back from it (Envoy's admin ``/clusters``)."""
    weights: dict[str, float] = {}
    with contextlib.suppress(Exception):  # a report without the gateway's figures says so, it does not fail
        weights = {
            e.pod: e.weight for e in (await asyncio.to_thread(world.gateway.routing_set, pool)).endpoints
        }
    return {"weights_now": weights or None}


# fleetmend's deroute (first signal -> out of routing) takes 0.3-0.7 s on a machine that keeps the
# demo's pace. On a CI machine running three other test processes on 2 cores it once took 10 s, the
# survivors' queues were full by the protect step, and the refusals it then made over-shed 2 %.
PACE_S = 3.0


def kept_pace(report: dict[str, Any]) -> bool:
    """Did the machine keep the demo's pace? (fleetmend's deroute within ``PACE_S``.) A run that did
    not still carries the world's grade; its over-shed limit is not judged, and the report says why."""
    deroute = report.get("fleetmend_deroute_seconds")
    return deroute is None or float(deroute) <= PACE_S


async def grade_by_the_world(
    world: World, load_id: str, report: dict[str, Any], over_shed_limit: float | None
) -> None:
    """Put the world's grade of the users' requests so far in the report (``shedding_graded_by_the_world``)
    and fail the run when it did better than the world's optimum (that bound, or the world, would be
    wrong), or, where the scenario sets a limit, refused more than the world's capacity called for."""
    try:
        graded = await world.load_grade(load_id)
    except httpx.HTTPError as err:  # too early for any arrival to be settled: say so, do not fail
        report["shedding_graded_by_the_world"] = {"error": str(err)}
        return
    report["shedding_graded_by_the_world"] = graded
    reason = None
    if graded["bound_beaten"]:
        reason = (
            f"the users got {graded['goodput']} requests within deadline, above the world's optimum "
            f"{graded['optimum']}: the replay or the world is wrong"
        )
    elif over_shed_limit is not None and not kept_pace(report):
        # Reported, not judged: see kept_pace.
        graded["over_shed_not_judged"] = (
            f"fleetmend took {report.get('fleetmend_deroute_seconds')} s to take the dead endpoints out of "
            f"routing (more than {PACE_S:g} s): the machine did not keep the demo's pace"
        )
    elif over_shed_limit is not None and graded["over_shed_share"] > over_shed_limit:
        reason = (
            f"{graded['over_shed']} refused request(s) ({graded['over_shed_share']:.1%} of arrivals) were ones "
            f"the world's capacity could have served (limit {over_shed_limit:.0%})"
        )
    if reason and report.get("verdict") == "passed":
        report["verdict"], report["verdict_reason"] = "failed", reason


async def inference_effects(world: World, load_id: str) -> dict[str, int]:
    """The agents' tool calls as their callers saw them (the load report), and the duplicates in the
    external system's own log: the simulated Jira's issues, one per tool call, counted by summary. The
    users' load still runs: Jira is read first, then the callers' record, so every issue Jira holds was
    opened by a call the record has started (its answer may still be on its way)."""
    jira = await jira_record(world.http, str(world.http.base_url))
    seen = dict((await world.load_report(load_id)).get("inference_effects") or {})
    return {
        "proposed": int(seen.get("proposed", 0)),
        "performed": int(seen.get("performed", 0)),
        "deduplicated": int(seen.get("deduplicated", 0)),
        "external_duplicates": jira["duplicates"],
        "external_issues": jira["issues"],
        "retried_after_a_tool_call": int(seen.get("retried_after_a_tool_call", 0)),
        "client_retries": int(seen.get("retried_requests", 0)),
    }


def summary_table(report: dict[str, Any]) -> Table:
    table = Table(title="fleetmend demo summary", title_justify="left", show_header=False)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("", overflow="fold")
    for key in SUMMARY_KEYS:
        value = report.get(key)
        style = ""
        if key == "verdict":
            style = "bold green" if value == "passed" else "bold red"
        table.add_row(key, Text(_fmt(value), style=style))
    phases = " -> ".join(
        f"{p['name']} {(p['end'] or p['start']) - p['start']:.1f}s" for p in report.get("phases", [])
    )
    table.add_row("phases", phases or "-")
    table.add_row("temporal_ui", report.get("temporal_ui") or "-")
    return table


def final_verdict(
    scenario: DemoScenario, status: ProcedureStatus, *, duplicates: int, orphans: list[str], mutations: int
) -> Verdict:
    """The workflow's own verdict, then what the world says: no duplicate, no orphan, no stray mutation."""
    verdict = scenario.verdict(status)
    if not verdict.passed:
        return verdict
    if duplicates:
        return Verdict(False, f"{duplicates} action(s) reached the world more than once")
    if orphans:
        return Verdict(False, f"orphaned pod(s): {', '.join(orphans)}")
    if not scenario.mutates and mutations:
        return Verdict(False, f"fleetmend made {mutations} mutating request(s) where none was allowed")
    return verdict


# ============================================================================ the run


async def run_demo(
    settings: Settings,
    scenario: DemoScenario,
    *,
    console: Console,
    keep_running: bool = False,
    stop: asyncio.Event | None = None,
    report_path: Path | None = None,
) -> dict[str, Any]:
    """Stage ``scenario`` on a fresh embedded stack and return the report (see ``build_report``)."""
    started = time.monotonic()
    settings = demo_settings(settings, scenario)
    console.print(f"[bold]fleetmend demo[/] {scenario.name}: {scenario.summary}")
    console.print(f"starting the embedded stack under {settings.state_dir} ...")
    async with DevStack(settings, parts=ALL_PARTS) as stack, stack_env(stack.settings) as env_file:
        s = stack.settings
        run = DemoRun(scenario=scenario, ui_url=s.temporal_ui_url)
        console.print(f"Temporal UI: [cyan]{s.temporal_ui_url}[/]   sim: {s.sim_url}")
        assert s.kubeconfig is not None
        # The demo and the operator look at the cluster as its admin; fleetmend acts as its ServiceAccounts.
        admin_kubeconfig = stack.admin_kubeconfig or s.kubeconfig
        async with httpx.AsyncClient(base_url=s.sim_url, timeout=10) as http:
            adapter: Gateway = EnvoyGateway(
                GatewayStore(make_engine(s.database_url_value() or "", pool_size=2, pre_ping=True))
            )
            world = World(http, admin_kubeconfig, adapter)
            pool = scenario.pool

            async def fleet_up() -> bool:
                return len(await world.routed(pool)) >= scenario.serving_groups

            console.print(f"waiting for {scenario.serving_groups} replicas of {pool.key} to serve ...")
            await _until(
                f"{scenario.serving_groups} routed replicas of {pool.key}", fleet_up, FLEET_UP_TIMEOUT_S
            )
            load_body: dict[str, Any] = {"rate": scenario.load_rate, "duration_s": LOAD_DURATION_S, "seed": 3}
            load_body.update(scenario.load)
            if scenario.agents is not None:  # agents' tool calls through this stack's effect API
                token = s.effects_token.get_secret_value() if s.effects_token else None
                load_body["agents"] = {
                    **scenario.agents,
                    "through": "ledger",
                    "effects_url": f"http://{s.webhook_host}:{s.webhook_port}/v1/effects",
                    "effects_token": token,
                    "jira_url": s.sim_url,
                }
            load_started = time.time()
            load_id = await world.start_load(load_body)
            share = float(load_body["rate"]) / (scenario.serving_groups * GROUP_CAPACITY_RPS)
            console.print(
                f"users: {load_body['rate']} requests/s on {pool.key} (~{share:.0%} of its capacity)"
            )
            async with maybe_pipeline(stack, run) as pipeline:
                if pipeline is not None:
                    console.print(
                        f"alerting: Prometheus {pipeline.prometheus_url}, "
                        f"Alertmanager {pipeline.alertmanager_url}"
                    )
                await healthy_serving_counted(world, s, load_started)
                handle = await _cause(stack, world, run, pipeline, console)
                status = await follow(handle, world, load_id, run, console)
                console.print()  # the live view's last frame ends without a newline
            if status.phase in TERMINAL_PHASES:  # let the run return, so the worker counts it
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(handle.result(), 15)
            metrics = await fleetmend_metrics(s)
            actions = await world.fleetmend_actions()
            # The fast path's leader-election Lease (the worker's own bookkeeping) is no action on the fleet.
            mutations = sum(
                1
                for a in actions
                if a.get("verb", "").upper() != "GET"
                and "/apis/coordination.k8s.io/" not in a.get("path", "")
            )
            assert s.database_url_value() is not None
            rec = await asyncio.to_thread(reconcile_with_world, s.database_url_value() or "", s)
            orphans = await orphan_pods(world, pool.namespace)
            verdict = final_verdict(
                scenario, status, duplicates=len(rec.duplicates), orphans=orphans, mutations=mutations
            )
            with contextlib.suppress(httpx.HTTPError):
                replaced = await world.replaced_since(pool.namespace, run.pods_before)
                entries = await world.journal(pool)
                run.cut_streams = count_cuts(entries, run.lost_pods, replaced)
                run.gateway_requests = gateway_figures(entries)
            report = build_report(
                run,
                status,
                verdict,
                duplicates=len(rec.duplicates),
                orphans=orphans,
                divergent=len(rec.divergent),
                unledgered=len(rec.orphans),
                mutations=mutations,
                elapsed_s=time.monotonic() - started,
            )
            report["worker_metrics"] = metrics
            report["gateway"] = await gateway_report(world, pool)
            await grade_by_the_world(world, load_id, report, scenario.over_shed_limit)
            if scenario.agents is not None:
                report["inference_effects"] = await inference_effects(world, load_id)
                if report["inference_effects"]["external_duplicates"]:
                    report["verdict"] = "failed"
                    report["verdict_reason"] = (
                        f"Jira's own log shows {report['inference_effects']['external_duplicates']} ticket(s) "
                        "opened more than once"
                    )
            if isinstance(adapter, EnvoyGateway):
                adapter.store.engine.dispose()
            console.print(summary_table(report))
            if report_path is not None:  # written before --keep-running blocks, so it can be read meanwhile
                write_report(report, report_path)
                console.print(f"report written to {report_path}")
            if keep_running:
                console.print(keep_running_hint(env_file), soft_wrap=True, highlight=False)
                console.print(
                    f"Watch the incident with kubectl:\n  export KUBECONFIG={Path(admin_kubeconfig).resolve()}",
                    soft_wrap=True,
                    markup=False,
                )
                await (stop or asyncio.Event()).wait()
    return report


async def _cause(
    stack: DevStack, world: World, run: DemoRun, pipeline: RunningPipeline | None, console: Console
) -> WorkflowHandle[Any, Any]:
    """Cause the scenario's fault and get the procedure that answers it."""
    scenario = run.scenario
    run.t0 = time.time()
    if scenario.kind == "scale-down":
        handle = await start_scale_down(stack, run)
        run.workflow_id = handle.id
        return handle
    pod: str | None = None
    fault = scenario.fault
    if fault.target.startswith("pod:"):
        pod = await choose_pod(world, scenario, fault.target)
    run.pods_before = await world.pod_places(scenario.pool.namespace)
    run.lost_pods = lost_group_pods(fault, run.pods_before, pod)
    if fault.kind is not None:
        target = f"{scenario.pool.namespace}/{pod}" if pod else fault.target
        await world.inject(FaultRequest(kind=fault.kind, target=target, params=fault.params))
        run.t0 = time.time()
        console.print(f"[bold red]fault:[/] {fault.kind.value} on {target}")
    else:
        console.print(f"[bold red]fault:[/] {scenario.summary} (first failing pod {pod})")
    await deliver_alert(stack, run, pipeline, pod)
    console.print(f"alert delivered via {run.alert_path}")
    handle = await procedure_handle(stack.client, run)
    run.workflow_id = handle.id
    return handle


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


__all__ = ["DemoError", "StackError", "demo_settings", "run_demo", "summary_table", "write_report"]
