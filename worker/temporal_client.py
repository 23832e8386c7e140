"""How every fleetmend process connects to Temporal.

One place decides the data converter (pydantic v2, so workflow inputs, results,
queries and updates are validated models) and the namespace, so the worker, the
webhook API and the CLI always agree with each other.
"""

from __future__ import annotations

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime

from worker.config import Settings


async def connect(
    settings: Settings, *, runtime: Runtime | None = None, identity: str | None = None
) -> Client:
    """Connect to ``settings.temporal_address`` in ``settings.temporal_namespace``.

    Raises ``RuntimeError`` (from the SDK) when the server cannot be reached; callers
    that need a friendlier message use ``worker.startup_checks``.
    """
    return await Client.connect(
        settings.temporal_address,
        namespace=settings.temporal_namespace,
        data_converter=pydantic_data_converter,
        runtime=runtime,
        identity=identity,
    )
