"""Worker Versioning and continue-as-new of the long-lived incident, against a real dev server.

* a recovery in flight survives a worker roll: it finishes on the version it started on (v1's
  code), while its incident continues-as-new onto the new current version (v2) with its state;
* an incident driven past the server's continue-as-new suggestion hands over its whole state —
  fingerprints, entities, children, a failed recovery still awaiting ``resolve`` — and stays one
  incident (one workflow id) to the webhook and the operator.

``ReplicaLossRecovery`` is a stand-in (``tests.deploy.stub_recovery``) that holds still until told
to finish: what is under test is FleetIncident and the worker's versioning, not the procedure.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from temporalio.api.workflowservice.v1 import SetWorkerDeploymentCurrentVersionRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError
from temporalio.worker import Worker

from fleet.incident import REPORT_LOSS_SIGNAL, LossReport, PoolRef, incident_workflow_id
from fleet.recovery import IncidentInput, OperatorAction, Phase, ProcedureStatus, RecoveryTimings
from tests.deploy.stub_recovery import Finish, StubRecoveryV1, StubRecoveryV2, stub_notify
from worker.config import Settings, load_settings
from worker.devstack.temporal_dev import TemporalDevServer
from worker.priorities import RECOVERY
from worker.processes import free_port
from worker.worker import (
    MAX_CONCURRENT_ACTIVITIES,
    build_worker,
    current_version,
    deployment_version,
    promote_first_version,
)
from workflows.incident import FleetIncident

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Small enough that a few dozen alerts push the incident past it; large enough for one recovery.
SUGGEST_CONTINUE_AS_NEW_AT = 60


@pytest_asyncio.fixture(scope="module")
async def short_history_client(
    temporal_cli: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Client]:
    """A dev server of this module's own that suggests continue-as-new after a short history."""
    logs = tmp_path_factory.mktemp("temporal-short-history")
    server = TemporalDevServer(
        cli=temporal_cli,
        db_file=None,
        log_file=logs / "temporal.log",
        port=free_port(),
        headless=True,
        extra_args=[
            "--dynamic-config-value",
            f"limit.historyCount.suggestContinueAsNew={SUGGEST_CONTINUE_AS_NEW_AT}",
        ],
    )
    await server.start()
    try:
        from temporalio.contrib.pydantic import pydantic_data_converter

        yield await Client.connect(server.address, data_converter=pydantic_data_converter)
    finally:
        server.stop()


def settings_for(client: Client, task_queue: str, deployment: str, build_id: str) -> Settings:
    return load_settings(
        temporal_address=client.service_client.config.target_host,
        task_queue=task_queue,
        worker_metrics_port=0,
        worker_deployment_name=deployment,
        worker_build_id=build_id,
    )


@asynccontextmanager
async def worker_of(
    client: Client, settings: Settings, workflows: Sequence[type], *, versioned: bool = True
) -> AsyncIterator[Worker]:
    activities: list[Callable[..., Any]] = [stub_notify]
    with ThreadPoolExecutor(MAX_CONCURRENT_ACTIVITIES) as pool:
        worker = build_worker(
            client,
            settings,
            activity_executor=pool,
            workflows=workflows,
            activities=activities,
            versioned=versioned,
        )
        async with worker:
            yield worker


def incident_input(pool: PoolRef, cooldown_s: float) -> IncidentInput:
    return IncidentInput(pool=pool, timings=RecoveryTimings(correlation_window_s=0.05, cooldown_s=cooldown_s))


async def report(
    client: Client, task_queue: str, pool: PoolRef, cfg: IncidentInput, pod: str, fingerprint: str
) -> WorkflowHandle[Any, Any]:
    """What the webhook does: signal-with-start into the pool's one incident."""
    return await client.start_workflow(
        FleetIncident.run,
        cfg,
        id=incident_workflow_id(pool),
        task_queue=task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal=REPORT_LOSS_SIGNAL,
        start_signal_args=[LossReport(pool=pool, pod=pod, fingerprint=fingerprint, alert_name="ReplicaDown")],
    )


async def until(
    check: Callable[[], Any], what: str, *, nudge: Callable[[], Any] | None = None, tries: int = 300
) -> Any:
    """Poll ``check`` (async) until truthy; ``nudge`` (async) between polls gives a workflow a task."""
    last = None
    for _ in range(tries):
        last = await check()
        if last:
            return last
        if nudge is not None:
            await nudge()
        await asyncio.sleep(0.1)
    raise AssertionError(f"never happened: {what} (last: {last!r})")


async def child_handle(
    client: Client, incident: WorkflowHandle[Any, Any], n: int
) -> WorkflowHandle[Any, Any]:
    async def started() -> str | None:
        status = await client.get_workflow_handle(incident.id).query(FleetIncident.status)
        if len(status.children) < n:
            return None
        try:  # listed just before the child's start is recorded: wait until it exists
            await client.get_workflow_handle(status.children[n - 1]).describe()
        except RPCError:
            return None
        return status.children[n - 1]

    return client.get_workflow_handle(
        await until(started, f"recovery {n} started"), result_type=ProcedureStatus
    )


async def pinned_version(handle: WorkflowHandle[Any, Any]) -> str:
    info = (await handle.describe()).raw_description.workflow_execution_info.versioning_info
    return f"{info.deployment_version.deployment_name}.{info.deployment_version.build_id}"


async def test_a_recovery_in_flight_finishes_on_its_version_and_the_incident_moves_to_the_new_one(
    temporal_client: Client,
) -> None:
    client = temporal_client
    task_queue = f"roll-{uuid.uuid4().hex[:8]}"
    deployment = f"fleetmend-roll-{uuid.uuid4().hex[:6]}"
    v1 = settings_for(client, task_queue, deployment, "v1")
    v2 = settings_for(client, task_queue, deployment, "v2")
    pool = PoolRef(namespace="inference", service=f"roll-{uuid.uuid4().hex[:6]}")
    cfg = incident_input(pool, cooldown_s=3600)

    async with worker_of(client, v1, [FleetIncident, StubRecoveryV1]):
        assert await promote_first_version(
            client, v1
        )  # a fresh install: the first version makes itself current
        assert await current_version(client, v1) == f"{deployment}.v1"
        incident = await report(client, task_queue, pool, cfg, "llama-0", "fp-a")
        first_run = (await incident.describe()).run_id
        recovery_1 = await child_handle(client, incident, 1)
        assert await pinned_version(recovery_1) == f"{deployment}.v1"
        # Started by the incident, the recovery gets recovery priority from the worker's interceptor.
        described = await recovery_1.describe()
        assert described.raw_description.workflow_execution_info.priority.priority_key == RECOVERY

        # The roll: v2 comes up beside v1, the operator makes it current.
        async with worker_of(client, v2, [FleetIncident, StubRecoveryV2]):
            assert not await promote_first_version(client, v2)  # a later version never promotes itself
            await until(lambda: _set_current(client, v2), "v2 accepted as current version")
            assert await current_version(client, v2) == f"{deployment}.v2"

            await recovery_1.signal("finish", Finish())
            done: ProcedureStatus = await recovery_1.result()
            assert done.figures["code"] == "v1"  # the pinned recovery finished on v1's code
            assert await pinned_version(recovery_1) == f"{deployment}.v1"

            latest = client.get_workflow_handle(incident.id)

            async def on_v2() -> bool:
                described = await latest.describe()
                return described.run_id != first_run and await pinned_version(latest) == f"{deployment}.v2"

            # A repeat alert (absorbed) gives the incident a workflow task in which it sees the new target.
            await until(
                on_v2,
                "incident continued on v2",
                nudge=lambda: report(client, task_queue, pool, cfg, "llama-0", "fp-a"),
            )
            status = await latest.query(FleetIncident.status)
            assert status.figures["runs"] == 2
            assert status.children == [recovery_1.id]  # carried: the next recovery is number 2
            assert status.figures["entities"] == ["pod:llama-0"]

            # A new loss after the roll: its recovery runs v2's code.
            await report(client, task_queue, pool, cfg, "llama-1", "fp-b")
            recovery_2 = await child_handle(client, incident, 2)
            assert recovery_2.id.endswith("/recovery-2")
            assert await pinned_version(recovery_2) == f"{deployment}.v2"
            await recovery_2.signal("finish", Finish())
            assert (await recovery_2.result()).figures["code"] == "v2"
            await latest.terminate("test done")


async def _set_current(client: Client, settings: Settings) -> bool:
    version = deployment_version(settings)
    try:
        await client.workflow_service.set_worker_deployment_current_version(
            SetWorkerDeploymentCurrentVersionRequest(
                namespace=client.namespace,
                deployment_name=version.deployment_name,
                build_id=version.build_id,
                identity="test operator",
            )
        )
    except Exception:
        return False  # the server has not seen v2's pollers yet
    return True


async def test_a_long_incident_continues_as_new_and_carries_its_state(short_history_client: Client) -> None:
    client = short_history_client
    task_queue = f"can-{uuid.uuid4().hex[:8]}"
    settings = settings_for(client, task_queue, "unused", "unused")
    pool = PoolRef(namespace="inference", service="llama")
    cfg = incident_input(pool, cooldown_s=0.2)

    async with worker_of(client, settings, [FleetIncident, StubRecoveryV1], versioned=False):
        incident = await report(client, task_queue, pool, cfg, "llama-0", "fp-0")
        first_run = (await incident.describe()).run_id
        recovery_1 = await child_handle(client, incident, 1)
        await recovery_1.signal("finish", Finish(phase=Phase.FAILED))
        latest = client.get_workflow_handle(incident.id)

        async def awaiting() -> bool:
            return (await latest.query(FleetIncident.status)).phase == Phase.AWAITING_OPERATOR

        await until(awaiting, "the failed recovery keeps the incident open for an operator")

        # An alert storm about the same pod: every delivery is a history event, none a new loss.
        for i in range(SUGGEST_CONTINUE_AS_NEW_AT):
            await report(client, task_queue, pool, cfg, "llama-0", f"fp-{i % 25}")

        async def continued() -> bool:
            return (await latest.describe()).run_id != first_run

        await until(continued, "continue-as-new past the suggested history length")
        status = await latest.query(FleetIncident.status)
        assert status.figures["runs"] >= 2
        # Every delivery of the storm was a repeat of the one loss, and is counted across the hand-over.
        assert status.figures["alerts_absorbed"] == SUGGEST_CONTINUE_AS_NEW_AT
        assert status.figures["entities"] == ["pod:llama-0"]
        assert status.children == [recovery_1.id]
        history = [
            e async for e in client.get_workflow_handle(incident.id, run_id=first_run).fetch_history_events()
        ]
        assert len(history) < SUGGEST_CONTINUE_AS_NEW_AT * 2  # the old run stopped growing

        # The failed recovery still waits for the operator in the new run: resolve is accepted there.
        await until(awaiting, "still awaiting the operator after continue-as-new")
        resolved = await latest.execute_update(
            FleetIncident.resolve, OperatorAction(operator="sre", reason="node replaced by hand")
        )
        assert resolved.awaiting is None
        final = await client.get_workflow_handle(incident.id, result_type=ProcedureStatus).result()
        assert final.phase == Phase.DONE and final.children == [recovery_1.id]
