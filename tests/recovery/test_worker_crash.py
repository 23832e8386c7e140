"""A worker killed with SIGKILL in the middle of a recovery: the workflow resumes on a new worker and
finishes, and the world saw every action exactly once (the ledger vs the simulator's action log)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.client import Client

from fleet.recovery import Phase
from fleet.vocabulary import FaultKind
from tests.recovery.helpers import (
    decisions,
    finish,
    incident_config,
    node_report,
    reconcile_with_world,
    wait_for_child,
    wait_for_phase,
)
from worker.devstack.rig import FleetRig, compressed_scenario, fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _worker_env(rig: FleetRig) -> dict[str, str]:
    env = dict(os.environ)
    for name, value in rig.settings.model_dump().items():
        if value is None or isinstance(value, dict):
            continue
        raw = value.get_secret_value() if hasattr(value, "get_secret_value") else value
        env[f"FLEETMEND_{name.upper()}"] = str(raw) if not isinstance(raw, bool) else str(raw).lower()
    env["FLEETMEND_WORKER_METRICS_PORT"] = "0"
    return env


def _start_worker(rig: FleetRig, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "worker"],
        env=_worker_env(rig),
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parents[2],
    )


async def test_worker_killed_mid_recovery_resumes_without_duplicate_actions(
    temporal_client: Client, task_queue: str, ledger_url: str, tmp_path: Path
) -> None:
    async with fleet_rig(
        temporal_client,
        scenario=compressed_scenario("gpu-node-loss"),
        database_url=ledger_url,
        task_queue=task_queue,
        run_worker=False,
    ) as rig:
        log = tmp_path / "worker.log"
        first = _start_worker(rig, log)
        second: subprocess.Popen[bytes] | None = None
        try:
            await asyncio.sleep(8)
            await rig.start_load(rate=40, duration_s=120, seed=9)
            await asyncio.sleep(2)
            await rig.inject(FaultKind.NODE_LOST, "gpu-node-0")
            incident = await rig.report_loss(node_report("gpu-node-0"), incident_config())
            child = await wait_for_child(temporal_client, incident, timeout_s=60)
            await wait_for_phase(child, Phase.RAMPING, timeout_s=90)
            first.send_signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL
            second = _start_worker(rig, log)
            status = await finish(child)
            assert status.phase == Phase.DONE, decisions(status)
            assert status.verification is not None and status.verification.passed
            report = await reconcile_with_world(rig, ledger_url)
            assert report.duplicates == [] and report.orphans == [] and report.unresolved == [], report
        finally:
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    proc.wait(10)
