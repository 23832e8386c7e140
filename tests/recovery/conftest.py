"""Recovery tests share the pool's incident id with every other test of the session: each starts and
ends with no workflow running, so a signal-with-start always reaches a run this test's worker serves."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode


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
