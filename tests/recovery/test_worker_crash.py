"""A worker killed with SIGKILL in the middle of a recovery: the workflow resumes on a new worker and
finishes, and the world saw every action exactly once (the ledger vs the simulator's action log)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import pytest
from temporalio.client import Client

from fleet.recovery import Phase
from fleet.vocabulary import FaultKind
from tests.support import (
    decisions,
    finish,
    incident_config,
    node_report,
    reconcile_with_world,
    start_worker_process,
    stop_processes,
    wait_for_child,
    wait_for_phase,
)
from worker.devstack.rig import compressed_scenario, fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


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
        first = start_worker_process(rig, log)
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
            second = start_worker_process(rig, log)
            status = await finish(child)
            assert status.phase == Phase.DONE, decisions(status)
            assert status.verification is not None and status.verification.passed
            report = await reconcile_with_world(rig, ledger_url)
            assert report.duplicates == [] and report.orphans == [] and report.unresolved == [], report
        finally:
            stop_processes(first, second)
