"""The operator's commands against a real recovery: ``fleetmend status``, ``pause``/``resume``/``approve``/``abort``.

A wedged engine in a pool whose router label is also a controller selector:
the recovery cannot deroute by relabelling and waits for an operator to
approve a force-delete (the ``router-label-selected`` scenario). The CLI runs
as a subprocess against the session's Temporal dev server while a real worker
serves the procedure; every rejected Update is one error line and exit 2.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid
from typing import Any

import pytest
from temporalio.client import Client

from fleet.incident import LossReport, PoolRef
from fleet.recovery import Phase, ProcedureStatus
from fleet.vocabulary import FaultKind
from tests.demo.support import FLEETMEND
from tests.support import finish, incident_config, load_reaches, wait_for_child, wait_for_phase
from worker.devstack.rig import compressed_scenario, fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def cli(client: Client, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "FLEETMEND_TEMPORAL_ADDRESS": client.service_client.config.target_host,
        "FLEETMEND_TEMPORAL_NAMESPACE": client.namespace,
        "COLUMNS": "200",
    }
    # In a thread: the worker serving the procedure runs on this test's event loop.
    return await asyncio.to_thread(
        subprocess.run, [FLEETMEND, *args], env=env, capture_output=True, text=True, timeout=60
    )


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stdout, done.stderr)
    return lines[0]


async def test_status_pause_resume_approve_and_rejections(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    namespace = f"ops-{uuid.uuid4().hex[:6]}"  # incident ids are per pool: never collide with other tests
    pool = PoolRef(namespace=namespace, service="llama")
    scenario = compressed_scenario("router-label-selected").model_copy(update={"namespace": namespace})
    async with fleet_rig(
        temporal_client, scenario=scenario, database_url=ledger_url, task_queue=task_queue
    ) as rig:
        pod = (await rig.pool_ready(pool))[0]
        await rig.start_load(rate=12, duration_s=90, seed=6)  # enough to queue on the wedged engine
        await load_reaches(rig, pool)
        await rig.inject(FaultKind.WEDGED_ENGINE, f"{namespace}/{pod}")
        await load_reaches(rig, pool, pods=[pod], in_flight=True)  # requests pile up on it
        report = LossReport(
            pool=pool, fingerprint="fp-ops", alert_name="FleetmendServingEndpointUnroutable", pod=pod
        )
        incident = await rig.report_loss(report, incident_config(pool))
        child = await wait_for_child(temporal_client, incident)
        await wait_for_phase(child, Phase.AWAITING_OPERATOR)

        # status: the incident and its recovery, with the phase and what it awaits.
        done = await cli(temporal_client, "status", "--json")
        assert done.returncode == 0, done.stderr
        rows: dict[str, dict[str, Any]] = {r["workflow_id"]: r for r in json.loads(done.stdout)}
        assert rows[incident.id]["kind"] == "incident" and rows[incident.id]["children"] == [child.id]
        assert rows[child.id]["kind"] == "replica-loss"
        assert rows[child.id]["phase"] == Phase.AWAITING_OPERATOR.value
        assert "force-delete" in rows[child.id]["awaiting"]
        assert rows[child.id]["age_seconds"] >= 0
        table = await cli(temporal_client, "status")
        assert child.id in table.stdout and "awaiting" in table.stdout

        # Rejections: one clear line each, nothing changed.
        assert "an abort needs a reason" in one_error_line(await cli(temporal_client, "abort", child.id))
        missing = one_error_line(await cli(temporal_client, "approve", f"incident/{namespace}/nope"))
        assert "no running workflow" in missing and "fleetmend status" in missing
        assert "not paused" in one_error_line(await cli(temporal_client, "resume", child.id))

        # pause -> shown in status -> a second pause is rejected -> resume.
        paused = await cli(
            temporal_client, "pause", child.id, "--operator", "alice", "--reason", "look first"
        )
        assert paused.returncode == 0 and "pause accepted" in paused.stdout, paused.stderr
        status = await child.query("status", result_type=ProcedureStatus)
        assert status.paused and "paused by alice: look first" in [d.summary for d in status.decisions]
        assert "already paused" in one_error_line(await cli(temporal_client, "pause", child.id))
        resumed = await cli(temporal_client, "resume", child.id, "--operator", "alice")
        assert resumed.returncode == 0, resumed.stderr

        # approve: the force-delete goes ahead and the recovery completes.
        approved = await cli(
            temporal_client, "approve", child.id, "--operator", "alice", "--reason", "wedged, delete it"
        )
        assert approved.returncode == 0 and "approve accepted" in approved.stdout, approved.stderr
        final = await finish(child)
        assert final.phase == Phase.DONE
        # An ended procedure rejects further steering.
        ended = one_error_line(await cli(temporal_client, "pause", child.id, "--reason", "late"))
        assert "has ended" in ended or "no running workflow" in ended
