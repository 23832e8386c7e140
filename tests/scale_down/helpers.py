"""Driving planned scale-downs against the simulated fleet, and what an SRE checks afterwards."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kubernetes import client as kc
from kubernetes import config as kconfig
from sqlalchemy import create_engine
from temporalio.client import Client, WorkflowHandle

from fleet.incident import PoolRef
from fleet.recovery import Phase, ProcedureStatus
from fleet.scale_down import ScaleDownInput
from ledger.reconcile import ReconcileReport, reconcile, world_actions_from_sim
from sim.scenario import SCENARIO_DIR, Scenario, load_scenario
from tests.recovery.helpers import fleetmend_actions
from worker.devstack.rig import FleetRig

POOL = PoolRef(namespace="inference", service="llama")
# The scale-down scenario's replicas decode 2400 tokens/s each (its warm rate); the sim runs at speed 1.
GROUP_CAPACITY_TOKENS = 2400.0
# Streaming load: requests of 100-300 tokens at 40 tokens/s per sequence stream for 2.5-7.5 s.
STREAMING = {"tiers": {"standard": 1.0}, "output_tokens": [100, 300]}


def vllm_default_scenario(**model: Any) -> Scenario:
    """The 8-replica scale-down pool with vLLM's default ``--shutdown-timeout=0`` (deleting a pod cuts)."""
    scenario = load_scenario(SCENARIO_DIR / "scale-down.yaml")
    m = scenario.models[0].model_copy(update={"shutdown_timeout_s": 0.0, **model})
    return scenario.model_copy(update={"models": [m]})


def scale_down_input(**overrides: Any) -> ScaleDownInput:
    values: dict[str, Any] = {
        "pool": POOL,
        "target_groups": 6,
        "drain_deadline_s": 60.0,
        "poll_interval_s": 0.3,
        "incident_poll_s": 1.0,
        "group_capacity_tokens_per_s": GROUP_CAPACITY_TOKENS,
    }
    values.update(overrides)
    return ScaleDownInput(**values)


async def start_scale_down(
    client: Client, rig: FleetRig, inp: ScaleDownInput, workflow_id: str
) -> WorkflowHandle[Any, Any]:
    return await client.start_workflow(
        "PlannedScaleDown", inp, id=workflow_id, task_queue=rig.settings.task_queue
    )


async def status_of(handle: WorkflowHandle[Any, Any]) -> ProcedureStatus:
    return await handle.query("status", result_type=ProcedureStatus)


async def wait_for_phase(
    handle: WorkflowHandle[Any, Any], phase: Phase, timeout_s: float = 60
) -> ProcedureStatus:
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        try:
            status = await status_of(handle)
        except Exception:  # no worker right now (the crash test): ask again
            await asyncio.sleep(0.3)
            continue
        if status.phase == phase:
            return status
        await asyncio.sleep(0.2)
    raise AssertionError(f"phase {phase.value} not reached within {timeout_s} s (status {status})")


async def finish(handle: WorkflowHandle[Any, Any], timeout_s: float = 90) -> ProcedureStatus:
    """The scale-down's final status, failing the test with its decisions if it did not complete."""
    try:
        result = await asyncio.wait_for(handle.result(), timeout_s)
        return result if isinstance(result, ProcedureStatus) else ProcedureStatus.model_validate(result)
    except Exception as exc:
        status = await status_of(handle)
        raise AssertionError(f"scale-down did not complete: {exc!r}\n{decisions(status)}") from exc


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


def core_api(rig: FleetRig) -> kc.CoreV1Api:
    cfg = kc.Configuration()
    kconfig.load_kube_config(config_file=str(rig.sim.kubeconfig), client_configuration=cfg)
    return kc.CoreV1Api(kc.ApiClient(cfg))


async def reconcile_with_world(rig: FleetRig, ledger_url: str) -> ReconcileReport:
    actions = await fleetmend_actions(rig)
    world = rig.base_url.split("://", 1)[1]
    engine = create_engine(ledger_url)
    try:
        return reconcile(engine, world=world, actions=world_actions_from_sim(world, actions))
    finally:
        engine.dispose()


async def cut_streams_on(rig: FleetRig, pods: list[str]) -> int:
    """Streams the gateway journaled as cut (terminal error after the first token) on ``pods``."""
    cut = 0
    for pod in pods:
        r = await rig.http.get(
            "/router/v1/journal",
            params={"pool": POOL.key, "replica": pod, "outcome": "terminal_error", "limit": 10000},
        )
        r.raise_for_status()
        cut += sum(1 for e in r.json()["entries"] if e["truncated"])
    return cut
