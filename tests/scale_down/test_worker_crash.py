"""A worker killed with SIGKILL in the middle of a drain, and another one started: the drain resumes where
it was, the scale-down completes, and the world saw every action exactly once (its own action log against
the ledger). The workers are real ``fleetmend worker`` processes (``python -m worker.cli.app worker``)."""

from __future__ import annotations

import asyncio
import collections
import signal
import time
import uuid
from pathlib import Path

from temporalio.client import Client

from fleet.recovery import Phase
from tests.scale_down.support import scale_down_input, start_scale_down, vllm_default_scenario
from tests.support import (
    POOL,
    decisions,
    finish,
    load_reaches,
    reconcile_with_world,
    routed,
    start_worker_process,
    status_of,
    stop_processes,
    wait_for_phase,
)
from worker.devstack.rig import fleet_rig

REPO = Path(__file__).resolve().parents[2]


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
        log = tmp_path / "workers.log"
        first = start_worker_process(rig, log)
        second = None
        try:
            # Generations of 300-500 tokens (7.5-12.5 s each) keep the victims busy for several seconds.
            await rig.start_load(
                rate=8, duration_s=60, seed=11, tiers={"standard": 1.0}, output_tokens=[300, 500]
            )
            await load_reaches(rig, in_flight=True)
            handle = await start_scale_down(
                temporal_client, rig, scale_down_input(poll_interval_s=0.5), f"sd-{uuid.uuid4().hex[:8]}"
            )
            busy = await wait_for_phase(handle, Phase.DRAINING, 60)
            deadline = time.monotonic() + 10
            while not busy.figures.get("victims_in_flight") and time.monotonic() < deadline:
                await asyncio.sleep(0.2)  # until the drain has counted the victims' requests
                busy = await status_of(handle)
            assert busy.figures["victims_in_flight"] > 0, busy.figures
            first.send_signal(signal.SIGKILL)
            first.wait(10)

            second = start_worker_process(rig, log)
            status = await finish(handle, 120)
            text = decisions(status)
            assert status.phase == Phase.DONE, text + "\n" + log.read_text()[-3000:]
            assert status.verification is not None and status.verification.passed, text
            assert "drained" in text
            victims = status.figures["victims"]
            assert await rig.cut_streams(POOL, victims) == 0
            await routed(rig, lambda pods: len(pods) == 6, "6 replicas")

            # 0 duplicate actions: the world's own log against the ledger, and by hand.
            report = await reconcile_with_world(rig, ledger_url)
            assert report.duplicates == [] and report.orphans == [], report
            mine = [a for a in await rig.actions() if "fleetmend-worker" in a["client"]]
            counts = collections.Counter((a["verb"], a["path"], a["body_digest"]) for a in mine)
            assert max(counts.values()) == 1, [k for k, n in counts.items() if n > 1]
            per_victim_status = [a for a in mine if a["path"].endswith("/status")]
            assert len(per_victim_status) == len(victims)
        finally:
            stop_processes(first, second)
