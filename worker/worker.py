"""The fleetmend worker: polls the task queue and runs the incident workflows and their activities.

Activities run in a thread pool because the official Kubernetes client is
synchronous; the SDK's Prometheus metrics (slots, schedule-to-start latency, ...)
and fleetmend's own (``worker.fleet_metrics``) are served on ``settings.worker_metrics_port``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from temporalio.client import Client
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.worker import Worker

from worker import registry
from worker.config import Settings
from worker.fleet_metrics import PHASE_DURATION, PHASE_DURATION_BUCKETS, ProcedureMetricsInterceptor
from worker.processes import require_free_port
from worker.startup_checks import StartupCheckError, run_startup_checks, unreachable_message
from worker.temporal_client import connect

log = logging.getLogger("fleetmend.worker")

MAX_CONCURRENT_ACTIVITIES = 32


def metrics_runtime(settings: Settings) -> Runtime | None:
    """A Temporal runtime exporting SDK metrics over Prometheus, or None when the port is 0.

    A runtime binds its port for the life of the process, so create one per process.
    """
    if not settings.worker_metrics_port:
        return None
    require_free_port(
        settings.worker_metrics_host,
        settings.worker_metrics_port,
        what="worker metrics",
        setting="FLEETMEND_WORKER_METRICS_PORT",
    )
    bind = f"{settings.worker_metrics_host}:{settings.worker_metrics_port}"
    buckets = {PHASE_DURATION: list(PHASE_DURATION_BUCKETS)}  # fleetmend's own: see worker.fleet_metrics
    telemetry = TelemetryConfig(
        metrics=PrometheusConfig(bind_address=bind, histogram_bucket_overrides=buckets),
        global_tags={"service": "fleetmend-worker"},
    )
    return Runtime(telemetry=telemetry)


def build_worker(
    client: Client,
    settings: Settings,
    *,
    activity_executor: ThreadPoolExecutor,
    task_queue: str | None = None,
    workflows: Sequence[type] | None = None,
    activities: Sequence[Callable[..., Any]] | None = None,
) -> Worker:
    """A ``Worker`` on the fleetmend task queue with the registry's workflows and activities."""
    return Worker(
        client,
        task_queue=task_queue or settings.task_queue,
        workflows=list(registry.WORKFLOWS if workflows is None else workflows),
        activities=list(registry.build_activities(settings) if activities is None else activities),
        activity_executor=activity_executor,
        max_concurrent_activities=MAX_CONCURRENT_ACTIVITIES,
        interceptors=[ProcedureMetricsInterceptor()],
        # Let an in-flight Kubernetes call or drain step finish on deploy instead of cutting it.
        graceful_shutdown_timeout=timedelta(seconds=10),
    )


async def connect_checked(settings: Settings, *, runtime: Runtime | None, database_url: str | None) -> Client:
    """Connect and run every start-up check; any failure is a ``StartupCheckError`` naming its fix."""
    try:
        client = await connect(settings, runtime=runtime)
    except Exception as err:
        raise StartupCheckError(unreachable_message(settings, err)) from err
    await run_startup_checks(client, settings, database_url=database_url)
    return client


async def run_worker(
    settings: Settings,
    *,
    stop: asyncio.Event,
    database_url: str | None,
    runtime: Runtime | None = None,
    ready: asyncio.Event | None = None,
) -> None:
    """Check, then poll until ``stop`` is set; shuts down gracefully.

    ``database_url`` is the ledger the activities use (checked to be at head);
    None skips that check (only for workers that touch no ledger, e.g. smoke tests).
    """
    client = await connect_checked(settings, runtime=runtime, database_url=database_url)
    with ThreadPoolExecutor(
        max_workers=MAX_CONCURRENT_ACTIVITIES, thread_name_prefix="fleetmend-activity"
    ) as pool:
        async with build_worker(client, settings, activity_executor=pool):
            log.info(
                "worker polling",
                extra={
                    "task_queue": settings.task_queue,
                    "namespace": settings.temporal_namespace,
                    "temporal_address": settings.temporal_address,
                    "metrics_port": settings.worker_metrics_port or None,
                },
            )
            if ready is not None:
                ready.set()
            await stop.wait()
            log.info("worker stopping", extra={"task_queue": settings.task_queue})
