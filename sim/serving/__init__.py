"""The serving layer of the simulated fleet: vLLM-like engines, telemetry, faults, load.

``attach(world, app)`` builds a ``ServingLayer`` for a ``SimWorld``, mounts its
HTTP API (``sim.serving.http``, shapes in ``sim.control``) on the simulator's FastAPI app,
and starts its tick loop with the app (lifespan). ``world.serving`` then names the layer, so
``start_load(world, ...)`` sends load through the gateway set in front of its engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from sim.serving.layer import ServingLayer, ServingSettings
from sim.serving.loadgen import LoadReport, LoadRun, LoadSpec, start_load

__all__ = ["LoadReport", "LoadRun", "LoadSpec", "ServingLayer", "ServingSettings", "attach", "start_load"]


def attach(world: Any, app: Any, settings: ServingSettings | None = None) -> ServingLayer:
    """Mount the serving layer on ``app`` and run it for the app's lifetime."""
    from sim.serving.http import build_router

    layer = ServingLayer(world, settings)
    world.serving = layer
    app.include_router(build_router(layer))
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_: Any) -> AsyncIterator[Any]:
        async with inner(app_) as state:
            layer.start()
            try:
                yield state
            finally:
                await layer.stop()

    app.router.lifespan_context = lifespan
    return layer
