"""Worker Versioning and continue-as-new of the long-lived incident, against a real dev server.

* a real recovery in flight (simulated fleet, real Envoy, the ledger) survives a worker roll: its
  worker is replaced mid-recovery, it finishes on the version it started on with every effect
  once, while its incident continues-as-new onto the new current version (v2) with its state;
* an incident driven past the server's continue-as-new suggestion hands over its whole state —
  fingerprints, entities, children, a failed recovery still awaiting ``resolve`` — and stays one
  incident (one workflow id) to the webhook and the operator. There ``ReplicaLossRecovery`` is a
  stand-in (``tests.deploy.stub_recovery``) that ends *failed* when told: what is under test is
  how FleetIncident carries a failed recovery across continue-as-new, not the procedure.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import SetWorkerDeploymentCurrentVersionRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError
from temporalio.worker import Worker

from fleet.incident import REPORT_LOSS_SIGNAL, LossReport, PoolRef, incident_workflow_id
from fleet.recovery import IncidentInput, OperatorAction, Phase, ProcedureStatus, RecoveryTimings
from fleet.vocabulary import FaultKind
from tests.deploy.stub_recovery import Finish, StubRecovery, stub_notify
from tests.support import (
    FAST,
    POOL,
    decisions,
    execute_update,
    finish,
    fleetmend_actions,
    incident_config,
    load_reaches,
    pod_report,
    reconcile_with_world,
    wait_for_child,
    wait_for_phase,
)
from worker.config import Settings, load_settings
from worker.devstack.rig import FleetRig, compressed_scenario, fleet_rig
from worker.devstack.temporal_dev import TemporalDevServer
from worker.priorities import RECOVERY
from worker.processes import free_port
from worker.worker import (
    activity_threads,
    build_worker,
    current_version,
    deployment_version,
    promote_first_version,
)
from workflows.incident import FleetIncident

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# The incident stays open after its recovery (the test ends it): what it carries is checked meanwhile.
HELD_OPEN = incident_config(timings=FAST.model_copy(update={"cooldown_s": 3600.0}))

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
        from worker.payloads import data_converter

        yield await Client.connect(server.address, data_converter=data_converter)
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
    with activity_threads(settings) as pool:
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


@asynccontextmanager
async def real_worker(client: Client, settings: Settings) -> AsyncIterator[Worker]:
    """A worker of this version with every workflow and activity (a ``fleetmend worker`` process's)."""
    with activity_threads(settings) as pool:
        async with build_worker(client, settings, activity_executor=pool, versioned=True) as worker:
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


def open_timers(kinds: Sequence[EventType.ValueType]) -> int:
    """The workflow's timers still pending in a history: started, less fired and cancelled."""
    return (
        kinds.count(EventType.EVENT_TYPE_TIMER_STARTED)
        - kinds.count(EventType.EVENT_TYPE_TIMER_FIRED)
        - kinds.count(EventType.EVENT_TYPE_TIMER_CANCELED)
    )


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


async def test_a_real_recovery_survives_a_worker_roll_on_its_version_and_the_incident_moves_to_the_new_one(
    temporal_client: Client, ledger_url: str
) -> None:
    """A real recovery (the router-label-selected world: it stops at step 2 for an operator's approval of a
    force-delete) is in flight when v2 is rolled out and v1's worker is replaced; it finishes on v1 with
    every effect once, and its incident moves to v2."""
    client = temporal_client
    task_queue = f"roll-{uuid.uuid4().hex[:8]}"
    deployment = f"fleetmend-roll-{uuid.uuid4().hex[:6]}"
    async with fleet_rig(
        client,
        scenario=compressed_scenario("router-label-selected"),
        database_url=ledger_url,
        task_queue=task_queue,
        run_worker=False,
        worker_deployment_name=deployment,
        worker_build_id="v1",
    ) as rig:
        v1 = rig.settings
        v2 = v1.model_copy(update={"worker_build_id": "v2"})
        async with real_worker(client, v1):
            assert await promote_first_version(client, v1)  # a fresh install: the first version is current
            assert await current_version(client, v1) == f"{deployment}.v1"
            await until(lambda: _routed(rig, 2), "the pool serves before the loss", tries=600)
            pod = (await rig.routing_set(POOL))[0]
            await rig.start_load(rate=30, duration_s=90, seed=6)
            await load_reaches(rig)
            await rig.inject(FaultKind.WEDGED_ENGINE, f"inference/{pod}")
            # Requests pile up on it: without any in flight the engine only looks slow, not wedged.
            await load_reaches(rig, pods=[pod], in_flight=True)
            incident = await rig.report_loss(pod_report(pod, "fp-wedged"), HELD_OPEN)
            first_run = (await incident.describe()).run_id
            recovery = await wait_for_child(client, incident)
            waiting = await wait_for_phase(recovery, Phase.AWAITING_OPERATOR)
            assert waiting.awaiting and "force-delete" in waiting.awaiting
            assert await pinned_version(recovery) == f"{deployment}.v1"
            # Started by the incident, the recovery gets recovery priority from the worker's interceptor.
            described = await recovery.describe()
            assert described.raw_description.workflow_execution_info.priority.priority_key == RECOVERY

        # The roll: v2 comes up and the operator makes it current; v1's old worker is gone (above) and a
        # replacement of v1 (its version still has a pinned recovery to drain) comes up beside v2. The
        # incident moves to v2 only once its recovery is over (it continues-as-new between recoveries).
        async with real_worker(client, v2), real_worker(client, v1):
            assert not await promote_first_version(client, v2)  # a later version never promotes itself
            await until(lambda: _set_current(client, v2), "v2 accepted as current version")
            assert await current_version(client, v2) == f"{deployment}.v2"

            # The operator answers the recovery that started before the roll: it finishes on v1.
            await execute_update(
                recovery, "approve", OperatorAction(operator="alice", reason="pod wedged, delete it")
            )
            status = await finish(recovery)
            assert status.phase == Phase.DONE, decisions(status)
            assert await pinned_version(recovery) == f"{deployment}.v1"
            deletes = [
                a
                for a in await fleetmend_actions(rig)
                if a["verb"] == "DELETE" and a["path"].endswith(f"/pods/{pod}")
            ]
            assert len(deletes) == 1, decisions(status)
            # Every effect of the recovery is in the ledger once and in the world's log once.
            report = await reconcile_with_world(rig, ledger_url)
            assert report.duplicates == [] and report.orphans == [], report
            assert status.figures.get("effects_applied", 0) >= 2, status.figures  # the delete and the shed
            latest = client.get_workflow_handle(incident.id)

            async def on_v2() -> bool:
                described = await latest.describe()
                return described.run_id != first_run and await pinned_version(latest) == f"{deployment}.v2"

            # The recovery over, a repeat alert (absorbed) gives the incident a workflow task in which it sees the new target.
            await until(
                on_v2,
                "incident continued on v2",
                nudge=lambda: rig.report_loss(pod_report(pod, "fp-wedged"), HELD_OPEN),
            )
            incident_status = await latest.query(FleetIncident.status)
            assert incident_status.children == [recovery.id]  # carried across the hand-over
            assert incident_status.figures["runs"] == 2

            await latest.terminate("test done")


async def _routed(rig: FleetRig, groups: int) -> bool:
    return len(await rig.routing_set(POOL)) >= groups


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

    async with worker_of(client, settings, [FleetIncident, StubRecovery], versioned=False):
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
        resolved = await execute_update(
            latest, FleetIncident.resolve, OperatorAction(operator="sre", reason="node replaced by hand")
        )
        assert resolved.awaiting is None
        final = await client.get_workflow_handle(incident.id, result_type=ProcedureStatus).result()
        assert final.phase == Phase.DONE and final.children == [recovery_1.id]


async def test_reports_of_losses_its_recovery_handled_are_absorbed_not_recovered_a_second_time(
    short_history_client: Client,
) -> None:
    """The fast path keeps naming a dead node's terminating pods while the recovery runs: once it has
    handled them, those reports are absorbed; a report of another pod still gets a recovery of its own."""
    client = short_history_client
    task_queue = f"absorb-{uuid.uuid4().hex[:8]}"
    settings = settings_for(client, task_queue, "unused", "unused")
    pool = PoolRef(namespace="inference", service="llama-absorb")
    cfg = incident_input(pool, cooldown_s=0.2)

    async with worker_of(client, settings, [FleetIncident, StubRecovery], versioned=False):
        incident = await report(client, task_queue, pool, cfg, "llama-0", "fp-0")
        recovery_1 = await child_handle(client, incident, 1)

        async def window_over() -> bool:
            """The incident waits on its recovery alone: the child started, no timer open (the correlation
            window's fired, or none was needed), and its last task completed. Later reports wait."""
            events = [e async for e in client.get_workflow_handle(incident.id).fetch_history_events()]
            kinds = [e.event_type for e in events]
            return (
                EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED in kinds
                and open_timers(kinds) == 0
                and kinds[-1] == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
            )

        await until(window_over, "the correlation window to end")
        await report(client, task_queue, pool, cfg, "llama-1", "fp-1")  # found lost by recovery 1
        await report(client, task_queue, pool, cfg, "llama-9", "fp-9")  # a loss recovery 1 never saw
        await recovery_1.signal("finish", Finish(lost=["llama-0", "llama-1"]))
        recovery_2 = await child_handle(client, incident, 2)
        await recovery_2.signal("finish", Finish(lost=["llama-9"]))
        final = await client.get_workflow_handle(incident.id, result_type=ProcedureStatus).result()

    text_ = "\n".join(d.summary for d in final.decisions)
    assert final.children == [recovery_1.id, recovery_2.id], text_  # not a third for llama-1
    second = await client.get_workflow_handle(recovery_2.id, result_type=ProcedureStatus).result()
    assert second.figures["first_report"] == "llama-9" and second.figures["reports"] == 1
    assert f"1 report(s) that came in while {recovery_1.id} ran name losses it handled: absorbed" in text_
    assert final.figures["alerts_absorbed"] == 1


async def test_a_loss_report_from_a_newer_release_opens_the_recovery_its_fields_are_dropped(
    short_history_client: Client,
) -> None:
    """A rolling upgrade: the newer release's fast path signals a report carrying fields this release does
    not know (at the top and inside a nested model) into an incident this release runs. The incident reads
    it without them and opens the recovery (worker.payloads); a report with a wrong value is still refused."""
    client = short_history_client
    task_queue = f"newer-{uuid.uuid4().hex[:8]}"
    settings = settings_for(client, task_queue, "unused", "unused")
    pool = PoolRef(namespace="inference", service="llama-newer")
    newer = LossReport(pool=pool, pod="llama-0", fingerprint="fp-new", alert_name="ReplicaDown").model_dump(
        mode="json"
    )
    newer["confidence"] = 0.97  # a field of a release after this one
    newer["pool"]["cluster"] = "east-1"  # and one inside a nested model
    async with worker_of(client, settings, [FleetIncident, StubRecovery], versioned=False):
        incident = await client.start_workflow(
            FleetIncident.run,
            incident_input(pool, cooldown_s=0.2),
            id=incident_workflow_id(pool),
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal=REPORT_LOSS_SIGNAL,
            start_signal_args=[newer],
        )
        recovery = await child_handle(client, incident, 1)
        await recovery.signal("finish", Finish(lost=["llama-0"]))
        final = await client.get_workflow_handle(incident.id, result_type=ProcedureStatus).result()
    assert final.phase == Phase.DONE and final.children == [recovery.id]
    first = await client.get_workflow_handle(recovery.id, result_type=ProcedureStatus).result()
    assert first.figures["first_report"] == "llama-0"


async def test_a_report_that_arrives_as_the_cool_down_ends_opens_a_recovery_it_is_never_dropped(
    short_history_client: Client,
) -> None:
    """The incident closes when its cool-down passes with no new report. A report that reaches the
    server in the same moment (here: the cool-down's timer fired while no worker ran, then the report
    came; the next worker sees both in one workflow task) is a new loss: it opens a recovery, and the
    incident does not close with it unread."""
    client = short_history_client
    task_queue = f"cool-{uuid.uuid4().hex[:8]}"
    settings = settings_for(client, task_queue, "unused", "unused")
    pool = PoolRef(namespace="inference", service="llama-cool")
    cfg = incident_input(pool, cooldown_s=4.0)

    async def events() -> list[EventType.ValueType]:
        return [e.event_type async for e in client.get_workflow_handle(incident.id).fetch_history_events()]

    async with worker_of(client, settings, [FleetIncident, StubRecovery], versioned=False):
        incident = await report(client, task_queue, pool, cfg, "llama-0", "fp-0")
        recovery_1 = await child_handle(client, incident, 1)
        await recovery_1.signal("finish", Finish(lost=["llama-0"]))

        async def cooling_down() -> bool:
            kinds = await events()
            return (
                EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED in kinds
                and kinds[-1] == EventType.EVENT_TYPE_TIMER_STARTED
                and open_timers(kinds) == 1
            )

        await until(cooling_down, "the incident waits out its cool-down after recovery 1")
    # No worker: the cool-down's timer fires on the server, and then the next report arrives.

    async def fired() -> bool:
        kinds = await events()
        return kinds[-2:] == [EventType.EVENT_TYPE_TIMER_FIRED, EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED]

    await until(fired, "the cool-down's timer fired")
    await report(client, task_queue, pool, cfg, "llama-9", "fp-9")
    async with worker_of(client, settings, [FleetIncident, StubRecovery], versioned=False):
        recovery_2 = await child_handle(client, incident, 2)
        await recovery_2.signal("finish", Finish(lost=["llama-9"]))
        final = await client.get_workflow_handle(incident.id, result_type=ProcedureStatus).result()
    assert final.children == [recovery_1.id, recovery_2.id]
    second = await client.get_workflow_handle(recovery_2.id, result_type=ProcedureStatus).result()
    assert second.figures["first_report"] == "llama-9"
