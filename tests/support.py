"""What the recovery, scale-down, soak, demo and ledger tests share: the pool, fast timings, phase waits,
the procedure's result, the operator's CLI, the simulated Jira, and the ledger reconciled against the
world's own log.

Conditions are waited on (a phase, a child, a result), never slept for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr
from sqlalchemy import create_engine, text
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from activities.effects import JiraProject, operation_label
from fleet.incident import LossReport, PoolRef
from fleet.recovery import (
    IncidentInput,
    Phase,
    ProcedureStatus,
    RecoveryTimings,
    RetryBudget,
    ServingObjectives,
)
from ledger.reconcile import ReconcileReport, reconcile
from worker.devstack.rig import FleetRig, compressed_scenario, fleet_rig
from worker.devstack.sim_wiring import SIM_JIRA_TOKEN

REPO = Path(__file__).resolve().parents[1]
POOL = PoolRef(namespace="inference", service="llama")
RANK_POOL = PoolRef(namespace="inference", service="llama-405b")  # the rank-lost world's LWS pool
# ~400 tokens/s per replica in the compressed scenarios: about 15 requests/s of 8-32 tokens.
GROUP_CAPACITY_RPS = 15.0

FAST = RecoveryTimings(
    correlation_window_s=5,
    poll_interval_s=0.5,
    deroute_timeout_s=10,
    replacement_timeout_s=60,
    ramp_interval_s=2,
    admission_interval_s=1,
    ramp_max_s=60,
    verify_timeout_s=60,
    approval_timeout_s=120,
    cooldown_s=1,
    qualification_timeout_s=20,
    reappear_timeout_s=30,
    # A killed worker's activity is retried after its call timeout: the budget leaves room for that.
    retry=RetryBudget(attempts=8, budget_s=90, call_timeout_s=10, max_interval_s=2),
)


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


async def status_of(handle: WorkflowHandle[Any, Any]) -> ProcedureStatus:
    return await handle.query("status", result_type=ProcedureStatus)


async def wait_for_child(
    client: Client, incident: WorkflowHandle[Any, Any], timeout_s: float = 30, *, after: int = 0
) -> WorkflowHandle[Any, Any]:
    """The incident's newest recovery once it exists (``after``: how many children it had before)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = await status_of(incident)
        except RPCError:
            await asyncio.sleep(0.3)  # no worker right now: ask again
            continue
        if len(status.children) > after:
            handle = client.get_workflow_handle(status.children[-1])
            try:
                await handle.describe()  # the incident names its child just before starting it
                return handle
            except RPCError:
                pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"no recovery started within {timeout_s} s")


async def wait_for_phase(
    handle: WorkflowHandle[Any, Any], phase: Phase | Collection[Phase], timeout_s: float = 60
) -> ProcedureStatus:
    """The procedure's status once it is in ``phase`` (or in any of several: a short phase a poll
    may miss on a loaded machine is best awaited together with the ones that follow it)."""
    wanted = {phase} if isinstance(phase, Phase) else set(phase)
    deadline = time.monotonic() + timeout_s
    status: ProcedureStatus | None = None
    while time.monotonic() < deadline:
        try:
            status = await status_of(handle)
        except RPCError:  # no worker right now (the crash tests): ask again
            await asyncio.sleep(0.3)
            continue
        if status.phase in wanted:
            return status
        await asyncio.sleep(0.2)
    now = status.phase.value if status else "unknown"
    raise AssertionError(
        f"phase {' or '.join(sorted(p.value for p in wanted))} not reached within {timeout_s} s (now {now})\n{decisions(status) if status else ''}"
    )


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
    env = dict(os.environ)
    for name, value in rig.settings.model_dump().items():
        if value is None or isinstance(value, dict):
            continue
        raw = value.get_secret_value() if hasattr(value, "get_secret_value") else value
        env[f"FLEETMEND_{name.upper()}"] = str(raw) if not isinstance(raw, bool) else str(raw).lower()
    env["FLEETMEND_WORKER_METRICS_PORT"] = "0"
    return env


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
        await _until_routed(rig, RANK_POOL, 2)
        yield rig


async def _until_routed(rig: FleetRig, pool: PoolRef, groups: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while groups and len(await rig.routing_set(pool)) < groups:
        if time.monotonic() > deadline:
            raise AssertionError(f"the pool did not route {groups} groups within {timeout_s:g} s")
        await asyncio.sleep(0.3)


@contextlib.asynccontextmanager
async def gpu_pool(
    client: Client, task_queue: str, ledger_url: str, *, routed: int = 5, **overrides: Any
) -> AsyncIterator[FleetRig]:
    """The compressed gpu-node-loss world (5 serving TP=4 groups + 1 warm spare on 4 nodes) with a
    worker, once ``routed`` groups are in the routing set (0: at once). ``overrides`` go to
    ``fleet_rig`` (settings, ``run_worker``, ``in_process_sim``)."""
    async with fleet_rig(
        client,
        scenario=compressed_scenario("gpu-node-loss"),
        database_url=ledger_url,
        task_queue=task_queue,
        **overrides,
    ) as rig:
        await _until_routed(rig, POOL, routed)
        yield rig


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
