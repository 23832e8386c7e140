"""Each recovery test leaves no workflow running: the pool's incident id is shared across tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from temporalio.client import Client


@pytest_asyncio.fixture(autouse=True)
async def terminate_leftover_workflows(temporal_client: Client) -> AsyncIterator[None]:
    yield
    async for wf in temporal_client.list_workflows('ExecutionStatus="Running"'):
        await temporal_client.get_workflow_handle(wf.id, run_id=wf.run_id).terminate("test finished")
