"""A worker killed with SIGKILL in the middle of a drain, and another one started: the drain resumes where
it was, the scale-down completes, and the world saw every action exactly once (its own action log against
the ledger). The workers are real ``fleetmend worker`` processes (``python -m worker.cli.app worker``)."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client

from fleet.recovery import Phase
from tests.scale_down.helpers import cut_streams_on, scale_down_input, start_scale_down, vllm_default_scenario
from tests.support import POOL, decisions, finish, reconcile_with_world, status_of, wait_for_phase
from worker.config import Settings
from worker.devstack.rig import fleet_rig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
REPO = Path(__file__).resolve().parents[2]


def _worker_env(settings: Settings, database_url: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in (
        "temporal_address",
        "temporal_namespace",
        "task_queue",
        "kubeconfig",
        "router_admin_url",
        "metrics_url_template",
        "health_url_template",
        "node_telemetry_url_template",
        "qualification_url_template",
        "notifier_url",
        "action_log_url",
    ):
        env[f"FLEETMEND_{name.upper()}"] = str(getattr(settings, name))
    env["FLEETMEND_DATABASE_URL"] = database_url
    env["FLEETMEND_WORKER_METRICS_PORT"] = "0"
    return env


def _start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "worker", "--log-level", "WARNING"],
        cwd=REPO,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


async def test_worker_killed_mid_drain_resumes_with_no_duplicate_action(
    temporal_client: Client, task_queue: str, ledger_url: str, tmp_path: Path
) -> None:
    async with fleet_rig(
        temporal_client,
        scenario=vllm_default_scenario(),
        database_url=ledger_url,
        task_queue=task_queue,
        run_worker=False,
    ) as rig:
        env = _worker_env(rig.settings, ledger_url)
        log = tmp_path / "workers.log"
        first = _start_worker(env, log)
        second = None
        try:
            # Generations of 300-500 tokens (7.5-12.5 s each) keep the victims busy for several seconds.
            await rig.start_load(
                rate=8, duration_s=60, seed=11, tiers={"standard": 1.0}, output_tokens=[300, 500]
            )
            await asyncio.sleep(4)
            handle = await start_scale_down(
                temporal_client, rig, scale_down_input(poll_interval_s=0.5), f"sd-{uuid.uuid4().hex[:8]}"
            )
            await wait_for_phase(handle, Phase.DRAINING, 60)
            await asyncio.sleep(1.0)
            busy = await status_of(handle)
            assert busy.figures["victims_in_flight"] > 0, busy.figures
            first.send_signal(signal.SIGKILL)
            first.wait(10)

            second = _start_worker(env, log)
            status = await finish(handle, 120)
            text = decisions(status)
            assert status.phase == Phase.DONE, text + "\n" + log.read_text()[-3000:]
            assert status.verification is not None and status.verification.passed, text
            assert "drained" in text
            victims = status.figures["victims"]
            assert await cut_streams_on(rig, victims) == 0
            assert len(await rig.routing_set(POOL)) == 6

            # 0 duplicate actions: the world's own log against the ledger, and by hand.
            report = await reconcile_with_world(rig, ledger_url)
            assert report.duplicates == [] and report.orphans == [], report
            mine = [a for a in await rig.actions() if "fleetmend-worker" in a["client"]]
            counts = collections.Counter((a["verb"], a["path"], a["body_digest"]) for a in mine)
            assert max(counts.values()) == 1, [k for k, n in counts.items() if n > 1]
            per_victim_status = [a for a in mine if a["path"].endswith("/status")]
            assert len(per_victim_status) == len(victims)
        finally:
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
