"""Recovery tests share the pool's incident id with every other test of the session: each starts and
ends with no workflow running, so a signal-with-start always reaches a run this test's worker serves."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from tests.recovery.support import IDS


async def _terminate_running(client: Client) -> None:
    async for wf in client.list_workflows('ExecutionStatus="Running"'):
        try:
            await client.get_workflow_handle(wf.id, run_id=wf.run_id).terminate("isolating a recovery test")
        except RPCError as err:
            # Visibility lags: a run listed as running may have completed since (an incident closing
            # after its cooldown). Ended is what this fixture wants.
            if err.status != RPCStatusCode.NOT_FOUND:
                raise


@pytest_asyncio.fixture(autouse=True)
async def no_workflow_left_running(temporal_client: Client) -> AsyncIterator[None]:
    await _terminate_running(temporal_client)
    yield
    await _terminate_running(temporal_client)


@pytest_asyncio.fixture(autouse=True)
async def record_histories(temporal_client: Client, request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """With ``FLEETMEND_RECORD_HISTORIES=<dir>``, each completed ReplicaLossRecovery (and NodeQualification)
    of the test is written to ``<dir>/<test name>[-node][-n].json``: the histories
    ``tests/recovery/test_replay.py`` replays against today's workflow code (a worker upgrade replays
    open recoveries on new code). Record into a new folder under ``tests/histories`` rather than over
    an older recording, e.g.
    ``FLEETMEND_RECORD_HISTORIES=tests/histories/<when> pytest tests/recovery/test_hardware_path.py``."""
    out = os.environ.get("FLEETMEND_RECORD_HISTORIES")
    started = datetime.now(UTC)
    yield
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    for kind, suffix in (("ReplicaLossRecovery", ""), ("NodeQualification", "-node")):
        query = f'WorkflowType="{kind}" AND StartTime>="{started.isoformat()}"'
        ids: list[str] = []
        for _ in range(10 if suffix else 50):  # visibility lags the run by a moment
            ids = [wf.id async for wf in temporal_client.list_workflows(query)]
            if ids:
                break
            await asyncio.sleep(0.2)
        for n, workflow_id in enumerate(sorted(ids)):
            handle = temporal_client.get_workflow_handle(workflow_id)
            if (await handle.describe()).status != WorkflowExecutionStatus.COMPLETED:
                continue
            history = await handle.fetch_history()
            name = request.node.name.removeprefix("test_") + suffix + (f"-{n}" if n else "")
            Path(out, f"{name}.json").write_text(history.to_json())
            # A history holds no workflow id, and the node workflows' ids derive from the recovery's.
            ids = Path(out, IDS)
            known = json.loads(ids.read_text()) if ids.exists() else {}
            ids.write_text(json.dumps({**known, f"{name}.json": workflow_id}, indent=1, sort_keys=True))
