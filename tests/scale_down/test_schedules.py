"""Scheduled scale-downs through the ``fleetmend schedule`` CLI against a real Temporal dev server: a
schedule fires (trigger), runs PlannedScaleDown, shows in ``schedule list``; while a replica-loss incident
is open on the pool the scheduled run yields, then goes on once the incident closed."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from temporalio.client import Client
from typer.testing import CliRunner

from fleet.incident import LossReport, incident_workflow_id
from fleet.recovery import IncidentInput, Phase, RecoveryTimings
from tests.scale_down.support import vllm_default_scenario
from tests.support import POOL, decisions, finish, routed, status_of, wait_for_phase
from worker.cli.app import app
from worker.devstack.rig import FleetRig, fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


async def _cli(env: dict[str, str], *args: str) -> Any:
    result = await asyncio.to_thread(CliRunner().invoke, app, ["schedule", *args], env=env)
    return result


async def _listed_when(
    env: dict[str, str], check: Callable[[list[dict[str, Any]]], bool], what: str, timeout_s: float = 30
) -> list[dict[str, Any]]:
    """``schedule list --json`` once it shows ``what``: the list is Temporal's visibility store, which
    catches up with a pause, an unpause or a deletion a moment after the call returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows: list[dict[str, Any]] = json.loads((await _cli(env, "list", "--json")).output)
        if check(rows):
            return rows
        assert time.monotonic() < deadline, f"the schedule list never showed {what}: {rows}"
        await asyncio.sleep(0.2)


def _env(client: Client, task_queue: str) -> dict[str, str]:
    return {
        "FLEETMEND_TEMPORAL_ADDRESS": client.service_client.config.target_host,
        "FLEETMEND_TEMPORAL_NAMESPACE": client.namespace,
        "FLEETMEND_TASK_QUEUE": task_queue,
        "COLUMNS": "200",
    }


async def _open_incident(rig: FleetRig, cooldown_s: float) -> str:
    """A real FleetIncident on the pool: the reported pod is not lost, so it stays open only for its cool-down."""
    timings = RecoveryTimings(
        correlation_window_s=1, poll_interval_s=0.3, cooldown_s=cooldown_s, reappear_timeout_s=1
    )
    report = LossReport(
        pool=POOL, fingerprint="fp-maybe", alert_name="FleetmendEndpointUnroutable", pod="llama-x"
    )
    handle = await rig.report_loss(report, IncidentInput(pool=POOL, timings=timings))
    return handle.id


async def test_cli_schedule_fires_runs_lists_and_yields_to_an_open_incident(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    env = _env(temporal_client, task_queue)
    sid = f"scale-down/{POOL.namespace}/{POOL.service}/nightly-{uuid.uuid4().hex[:6]}"

    # Bad input: a clear message, nothing created.
    bad = await _cli(env, "create", "--pool", "inference", "--to", "6", "--cron", "0 3 * * *")
    assert bad.exit_code == 2 and "NAMESPACE/SERVICE" in bad.output, bad.output

    async with fleet_rig(
        temporal_client, scenario=vllm_default_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        created = await _cli(
            env,
            "create",
            "--pool",
            POOL.key,
            "--to",
            "6",
            "--cron",
            "0 3 * * *",
            "--timezone",
            "Europe/Berlin",
            "--jitter",
            "5m",
            "--drain-deadline",
            "30s",
            "--group-capacity-tokens",
            "2400",
            "--id",
            sid,
        )
        assert created.exit_code == 0, created.output
        again = await _cli(env, "create", "--pool", POOL.key, "--to", "6", "--cron", "0 3 * * *", "--id", sid)
        assert again.exit_code == 2 and "already exists" in again.output, again.output

        listed = await _listed_when(env, lambda rows: any(v["id"] == sid for v in rows), "the new schedule")
        mine = next(v for v in listed if v["id"] == sid)
        assert mine["pool"] == POOL.key and mine["to"] == 6 and mine["timezone"] == "Europe/Berlin"
        assert mine["drain_deadline_s"] == 30 and mine["jitter_s"] == 300 and not mine["paused"]
        assert mine["next_runs"] and mine["cron"] == ["0 3 * * *"], mine

        incident_id = await _open_incident(rig, cooldown_s=6)
        assert incident_id == incident_workflow_id(POOL)
        fired = await _cli(env, "trigger", sid)
        assert fired.exit_code == 0, fired.output

        deadline = time.monotonic() + 20
        run_ids: list[str] = []
        while not run_ids and time.monotonic() < deadline:
            described = json.loads((await _cli(env, "describe", sid, "--json")).output)
            run_ids = described["recent_runs"] or described["running"]
            await asyncio.sleep(0.3)
        assert run_ids, "the schedule did not start a run"
        run = temporal_client.get_workflow_handle(run_ids[-1])
        yielding = await wait_for_phase(run, Phase.YIELDING, 20)
        assert yielding.figures["yielded_to"] == incident_id
        assert incident_id in decisions(yielding)

        status = await finish(run, 90)
        text = decisions(status)
        assert status.phase == Phase.DONE, text
        assert "incident over" in text and status.figures["requested_by"] == f"schedule {sid}"
        await routed(rig, lambda pods: len(pods) == 6, "6 replicas")
        assert (await temporal_client.get_workflow_handle(incident_id).describe()).status is not None

        await _listed_when(
            env,
            lambda rows: any(v["id"] == sid and run.id in v["recent_runs"] for v in rows),
            "the fired run",
        )

        no_note = await _cli(env, "pause", sid, "--note", " ")
        assert no_note.exit_code == 2 and "--note" in no_note.output
        assert (await _cli(env, "pause", sid, "--note", "freeze week")).exit_code == 0
        described = json.loads((await _cli(env, "describe", sid, "--json")).output)
        assert described["paused"] and described["note"] == "freeze week"
        assert (await _cli(env, "unpause", sid, "--note", "freeze over")).exit_code == 0
        await _listed_when(
            env, lambda rows: any(v["id"] == sid and not v["paused"] for v in rows), "the unpause"
        )
        table = await _cli(env, "list")
        assert sid[:8] in table.output and "active" in table.output and "0 3 * * *" in table.output, (
            table.output
        )
        assert (await _cli(env, "delete", sid)).exit_code == 0
        await _listed_when(env, lambda rows: sid not in [v["id"] for v in rows], "the deletion")
        missing = await _cli(env, "describe", sid)
        assert missing.exit_code == 2 and "no schedule" in missing.output
        await status_of(run)
