"""A week of incidents on one pool: ten consecutive losses of mixed kinds, with a worker ``kill -9`` in
one, a Temporal restart in another, a Postgres restart in a third, a refused effect in a fourth and a
scale-down waiting on a fifth. Every incident must end recovered and verified (or wait visibly for an
operator, who is then answered); the world's action log must hold every action each incident needed,
once; the ledger must reconcile clean.

Everything here is real and restartable: a Temporal dev server with its own SQLite file, an embedded
Postgres of its own, ``fleetmend worker`` processes, the simulated cluster over HTTP.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import create_engine, text
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle

from fleet.incident import LossReport, PoolRef
from fleet.recovery import OperatorAction, Phase, ProcedureStatus
from fleet.scale_down import ScaleDownInput
from fleet.vocabulary import PROCEDURE_OPERATION_PREFIX, QUARANTINE_LABEL, QUARANTINE_TAINT_KEY, FaultKind
from ledger.migrate import upgrade_head
from ledger.scratch import PgServer, start_embedded_server
from tests.support import (
    FAST,
    decisions,
    execute_update,
    finish,
    incident_config,
    reconcile_with_world,
    start_worker_process,
    status_of,
    stop_processes,
    wait_for_child,
    wait_for_phase,
)
from worker.devstack.rig import FleetRig, compressed_scenario, fleet_rig
from worker.devstack.temporal_dev import TemporalDevServer, find_temporal_cli
from worker.payloads import data_converter
from worker.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

POOL = PoolRef(namespace="inference", service="llama-405b")
GROUPS = 3
# More attempts than FAST (Temporal and Postgres restart under the recoveries), the same 10 s call timeout: a
# killed worker's activity is retried after it. The ramp measures every second, not every two: ten ramps
# are a third of the week otherwise, and the soak tests the days' twists, not the ramp's pace.
TIMINGS = FAST.model_copy(
    update={"retry": FAST.retry.model_copy(update={"attempts": 20}), "ramp_interval_s": 1}
)


def soak_scenario() -> Any:
    """Three 2-pod groups (a LeaderWorkerSet) on eight nodes in four NVLink domains: room for a replacement."""
    scenario = compressed_scenario("rank-lost", startup_s=3.0, warm_up_s=3.0)
    nodes = scenario.nodes[0].model_copy(
        update={
            "count": 8,
            "node_labels": {i: {"fleetmend.io/nvlink-domain": f"nvl-{i // 2}"} for i in range(8)},
        }
    )
    # A 5 s grace period (vLLM's shutdown timeout inside it): the LeaderWorkerSet re-creates a group only once
    # its pods are gone, and ten incidents need not each wait out a longer one.
    model = scenario.models[0].model_copy(
        update={"gpus_per_pod": 4, "termination_grace_s": 5, "shutdown_timeout_s": 4.0}
    )
    workload = scenario.workloads[0].model_copy(update={"replicas": GROUPS})
    # Kubernetes' node-monitor grace compressed like the rest (40 s -> 5 s): a lost node turns NotReady sooner.
    timings = scenario.timings.model_copy(update={"node_monitor_grace_s": 5.0, "scheduler_retry_s": 2.0})
    return scenario.model_copy(
        update={"nodes": [nodes], "models": [model], "workloads": [workload], "timings": timings}
    )


@dataclass
class Stack:
    """What the soak restarts: Temporal (its own SQLite file), Postgres, the worker process."""

    temporal: TemporalDevServer
    pg: PgServer
    ledger_url: str
    client: Client
    log: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_worker(self, rig: FleetRig) -> None:
        self.workers.append(start_worker_process(rig, self.log))

    def kill_worker(self) -> None:
        proc = self.workers[-1]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL

    async def restart_temporal(self) -> None:
        self.temporal.stop()
        await self.temporal.start()

    def restart_postgres(self) -> None:
        assert self.pg.restart is not None
        self.pg.restart()


@pytest_asyncio.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    pg = await asyncio.to_thread(start_embedded_server)
    temporal = TemporalDevServer(
        cli=find_temporal_cli(None),
        db_file=tmp_path / "temporal.db",
        log_file=tmp_path / "temporal.log",
        port=free_port(),
        headless=True,
    )
    try:
        url = pg.create_database("soak")
        await asyncio.to_thread(upgrade_head, url)
        await temporal.start()
        client = await Client.connect(temporal.address, data_converter=data_converter)
        stack = Stack(temporal, pg, url, client, tmp_path / "worker.log")
        yield stack
        stop_processes(*stack.workers)
    finally:
        temporal.stop()
        await asyncio.to_thread(pg.stop)


# ---------------------------------------------------------------- the world, as an operator sees it


async def _node_of(rig: FleetRig, pod: str) -> str:
    obj = await asyncio.to_thread(rig.core.read_namespaced_pod, pod, POOL.namespace)
    assert obj.spec is not None and obj.spec.node_name
    return str(obj.spec.node_name)


async def _operator_returns(rig: FleetRig, node: str, fault: FaultKind) -> None:
    """The machine is repaired: the node comes back and an operator lifts fleetmend's quarantine."""
    r = await rig.http.post(f"/sim/v1/nodes/{node}/restore")
    r.raise_for_status()
    if fault is FaultKind.GPU_XID:
        await rig.inject(fault, node, clear=True)  # the GPU was replaced
    core = rig.core
    obj = await asyncio.to_thread(core.read_node, node)
    taints = [t.to_dict() for t in ((obj.spec and obj.spec.taints) or []) if t.key != QUARANTINE_TAINT_KEY]
    body = {
        "spec": {"unschedulable": False, "taints": taints},
        "metadata": {"labels": {QUARANTINE_LABEL: None}},
    }
    await asyncio.to_thread(core.patch_node, node, body)


async def _closed(client: Client, workflow_id: str, timeout_s: float = 60) -> None:
    for _ in range(int(timeout_s / 0.3)):
        try:
            desc = await client.get_workflow_handle(workflow_id).describe()
            if desc.status != WorkflowExecutionStatus.RUNNING:
                return
        except Exception:  # Temporal restarting
            pass
        await asyncio.sleep(0.3)
    raise AssertionError(f"{workflow_id} still open after {timeout_s} s")


def _rows(url: str, scope: str) -> list[tuple[str, str]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT op_id, state FROM ledger_effects WHERE op_id LIKE :p"),
                {"p": f"{PROCEDURE_OPERATION_PREFIX}{scope}@%"},
            ).all()
        return [(r[0], r[1]) for r in rows]
    finally:
        engine.dispose()


# ---------------------------------------------------------------- the week


@dataclass
class Day:
    fault: FaultKind
    twist: str = ""  # kill-worker / restart-temporal / restart-postgres / refuse / scale-down


WEEK = [
    Day(FaultKind.NODE_LOST),
    Day(FaultKind.RANK_LOST, "kill-worker"),
    Day(FaultKind.POD_OOMKILLED, "restart-temporal"),
    Day(FaultKind.GPU_XID, "restart-postgres"),
    Day(FaultKind.NODE_LOST, "refuse"),
    Day(FaultKind.RANK_LOST, "scale-down"),
    Day(FaultKind.POD_OOMKILLED),
    Day(FaultKind.GPU_XID),
    Day(FaultKind.NODE_LOST),
    Day(FaultKind.RANK_LOST),
]


async def _inject(rig: FleetRig, day: Day, n: int) -> tuple[LossReport, str | None]:
    """Break one group the way ``day`` says; returns the alert an operator's pipeline would send."""
    leader = (await rig.pool_ready(POOL, timeout_s=120))[n % GROUPS]
    fp = f"soak-{n}-{day.fault.value}"
    if day.fault in (FaultKind.NODE_LOST, FaultKind.GPU_XID):
        node = await _node_of(rig, leader)
        params = {"code": 79} if day.fault is FaultKind.GPU_XID else {}
        await rig.inject(day.fault, node, **params)
        hint = "gpu-xid:79" if day.fault is FaultKind.GPU_XID else None
        alert = "FleetmendGpuXid" if hint else "KubeNodeNotReady"
        return LossReport(pool=POOL, fingerprint=fp, alert_name=alert, node=node, fault_hint=hint), node
    pod = f"{leader}-1" if day.fault is FaultKind.RANK_LOST else leader
    await rig.inject(day.fault, f"{POOL.namespace}/{pod}")
    alert = "FleetmendRankLost" if day.fault is FaultKind.RANK_LOST else "KubePodCrashLooping"
    return LossReport(pool=POOL, fingerprint=fp, alert_name=alert, pod=pod), None


async def _on_call(child: WorkflowHandle[Any, Any]) -> None:
    """The on-call SRE: approves the force-delete a recovery asks for (pods held by a dead node)."""
    while True:
        try:
            status = await status_of(child)
            if status.phase == Phase.AWAITING_OPERATOR and status.refusal is None and status.awaiting:
                if status.awaiting.startswith("approve force-delete"):
                    await execute_update(
                        child, "approve", OperatorAction(operator="on-call", reason="node is dead")
                    )
        except Exception:  # Temporal or the worker restarting, or the approval raced the next phase
            pass
        await asyncio.sleep(0.5)


async def test_ten_incidents_on_one_pool_with_crashes_restarts_and_a_refusal(stack: Stack) -> None:
    async with fleet_rig(
        stack.client,
        scenario=soak_scenario(),
        database_url=stack.ledger_url,
        task_queue="soak",
        run_worker=False,
    ) as rig:
        stack.start_worker(rig)
        await rig.pool_ready(POOL, timeout_s=120)  # every group routed again
        await rig.start_load(rate=8, duration_s=1500, seed=31, model=None, pool=POOL.key)
        ended: list[tuple[str, str]] = []
        for n, day in enumerate(WEEK):
            day_started = time.monotonic()
            report, node = await _inject(rig, day, n)
            if day.twist == "refuse":
                await rig.refuse({"verbs": ["PATCH"], "path_contains": "/pods/", "error": "403"})
            incident = await rig.report_loss(report, incident_config(POOL, timings=TIMINGS))
            child = await wait_for_child(stack.client, incident, timeout_s=60)
            on_call = asyncio.create_task(_on_call(child))
            scale_down: WorkflowHandle[Any, Any] | None = None
            if day.twist == "kill-worker":
                await wait_for_phase(child, Phase.PROTECTING, timeout_s=60)
                stack.kill_worker()
                stack.start_worker(rig)
            elif day.twist == "restart-temporal":
                await wait_for_phase(child, Phase.PROTECTING, timeout_s=60)
                await stack.restart_temporal()
            elif day.twist == "restart-postgres":
                await wait_for_phase(child, Phase.PROTECTING, timeout_s=60)
                await asyncio.to_thread(stack.restart_postgres)
            elif day.twist == "refuse":
                waiting = await wait_for_phase(child, Phase.AWAITING_OPERATOR, timeout_s=60)
                assert waiting.refusal is not None and "forbidden" in waiting.refusal.error.lower(), (
                    decisions(waiting)
                )
                await rig.refuse()
                await execute_update(child, "retry", OperatorAction(operator="sre", reason="RBAC restored"))
            elif day.twist == "scale-down":
                # The weekly scale-down fires while the pool recovers: it yields, then plans (dry-run).
                scale_down = await stack.client.start_workflow(
                    "PlannedScaleDown",
                    ScaleDownInput(
                        pool=POOL,
                        target_groups=GROUPS - 1,
                        dry_run=True,
                        poll_interval_s=0.3,
                        incident_poll_s=0.5,
                        group_capacity_tokens_per_s=1000.0,  # the pool's load-test figure
                    ),
                    id=f"scale-down-soak-{n}",
                    task_queue="soak",
                )
            try:
                status = await finish(child, timeout_s=240)
            finally:
                on_call.cancel()
            assert status.phase == Phase.DONE, f"day {n} ({day}):\n{decisions(status)}"
            assert status.verification is not None and status.verification.passed, decisions(status)
            assert status.figures.get("effects_deduplicated", 0) == 0, decisions(status)
            rows = _rows(stack.ledger_url, child.id)
            states = {state for _, state in rows}
            expected = {"applied", "failed"} if day.twist == "refuse" else {"applied"}
            assert rows and states == expected, (day, rows)
            if scale_down is not None:
                sd = await finish(scale_down, timeout_s=120)
                assert sd.phase == Phase.DONE and sd.dry_run, decisions(sd)
                assert any("yielding" in d.summary for d in sd.decisions), decisions(sd)
            await _closed(stack.client, incident.id)
            if node is not None:
                await _operator_returns(rig, node, day.fault)
            await rig.pool_ready(POOL, timeout_s=120)  # every group routed again
            ended.append((child.id, status.phase.value))
            # Where each day's time went (pytest shows it with -s, and beside any failure).
            spans = ", ".join(f"{p.name.value} {(p.end or p.start) - p.start:.1f}" for p in status.phases)
            print(
                f"day {n} {day.fault.value} {day.twist or '-'}: {time.monotonic() - day_started:.1f} s ({spans})"
            )
        assert len({cid for cid, _ in ended}) == len(WEEK)
        report_ = await reconcile_with_world(rig, stack.ledger_url, check_missing=True)
        assert report_.duplicates == [] and report_.orphans == [] and report_.missing == [], report_
        assert report_.divergent == [] and report_.unresolved == [] and report_.needs_operator == [], report_
        incident_status = await status_of(stack.client.get_workflow_handle(incident.id))
        assert isinstance(incident_status, ProcedureStatus)
