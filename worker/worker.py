"""The fleetmend worker: polls the task queue and runs the incident workflows and their activities.

Activities run in a thread pool because the official Kubernetes client is
synchronous; the SDK's Prometheus metrics (slots, schedule-to-start latency, ...)
and fleetmend's own (``worker.fleet_metrics``) are served on ``settings.worker_metrics_port``.

Worker Versioning: the worker polls as deployment version
``<worker_deployment_name>.<worker_build_id>`` (build id default: the package
version). Every workflow is pinned to the version it started on, so a worker
roll never replays a running procedure on new code; the long-lived ones
(``FleetIncident``, ``ReadinessKeeper``) move to the new current version at their
next continue-as-new. A new version takes new work once an operator makes it
current (``temporal worker deployment set-current-version``); only the very
first version of a deployment makes itself current, so a fresh install works.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from temporalio.api.workflowservice.v1 import (
    DescribeWorkerDeploymentRequest,
    SetWorkerDeploymentCurrentVersionRequest,
)
from temporalio.client import Client
from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker, WorkerDeploymentConfig

from worker import registry
from worker.config import Settings
from worker.fleet_metrics import PHASE_DURATION, PHASE_DURATION_BUCKETS, ProcedureMetricsInterceptor
from worker.health import HealthServer
from worker.priorities import WorkerPriorities
from worker.processes import require_free_port
from worker.startup_checks import StartupCheckError, run_startup_checks, unreachable_message
from worker.temporal_client import TemporalSettingError, connect

log = logging.getLogger("fleetmend.worker")


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


def package_version() -> str:
    try:
        return version("fleetmend")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def deployment_version(settings: Settings) -> WorkerDeploymentVersion:
    """This worker's Worker Deployment Version: ``<deployment name>.<build id>``."""
    return WorkerDeploymentVersion(
        deployment_name=settings.worker_deployment_name,
        build_id=settings.worker_build_id or package_version(),
    )


def deployment_config(settings: Settings) -> WorkerDeploymentConfig | None:
    """Versioned polling, every workflow pinned by default (None when versioning is off).

    Pinned is the default so a procedure written before this module knew of it (or a new
    one) can never be moved onto new code mid-run; the long-lived workflows declare it
    too and upgrade themselves at continue-as-new.
    """
    if not settings.worker_versioning:
        return None
    return WorkerDeploymentConfig(
        version=deployment_version(settings),
        use_worker_versioning=True,
        default_versioning_behavior=VersioningBehavior.PINNED,
    )


async def current_version(client: Client, settings: Settings) -> str | None:
    """The deployment's current version (``name.build``), or None when it has none (or does not exist)."""
    try:
        described = await client.workflow_service.describe_worker_deployment(
            DescribeWorkerDeploymentRequest(
                namespace=client.namespace, deployment_name=settings.worker_deployment_name
            )
        )
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    current = described.worker_deployment_info.routing_config.current_deployment_version
    return f"{current.deployment_name}.{current.build_id}" if current.build_id else None


# Answers to the first version's promotion that a later attempt can get past: the deployment not seen yet
# (NOT_FOUND, FAILED_PRECONDITION), or the server too busy to finish the call.
_INTERRUPTED = (RPCStatusCode.CANCELLED, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.UNAVAILABLE)
_RETRIED_WHILE_PROMOTING = (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION, *_INTERRUPTED)


async def promote_first_version(client: Client, settings: Settings, *, attempts: int = 60) -> bool:
    """Make this version current when the deployment has no current version yet (a fresh install).

    Never replaces an existing current version: rolling a new version out is the
    operator's decision (README, "Roll a new worker during an incident"). The
    deployment appears on the server only after this worker's first polls, so the
    call is retried briefly; so is a call the server cancelled or timed out, the read of
    the current version as well as the promotion (a loaded dev server answered CANCELLED
    "operation was canceled" to each once, and the worker would have exited for it).
    Returns whether this call made the version current.
    """
    mine = deployment_version(settings)
    interrupted = False  # a call of ours the server cancelled or timed out may still have taken effect
    for _ in range(attempts):
        try:
            current = await current_version(client, settings)
        except RPCError as err:  # the read itself was cancelled or timed out: read again
            if err.status not in _INTERRUPTED:
                raise
            await asyncio.sleep(0.5)
            continue
        if current is not None:
            return interrupted and current == mine.to_canonical_string()
        try:
            await client.workflow_service.set_worker_deployment_current_version(
                SetWorkerDeploymentCurrentVersionRequest(
                    namespace=client.namespace,
                    deployment_name=mine.deployment_name,
                    build_id=mine.build_id,
                    identity=f"fleetmend-worker {mine.to_canonical_string()} (first version)",
                )
            )
            log.info("worker version made current", extra={"version": mine.to_canonical_string()})
            return True
        except RPCError as err:
            if err.status not in _RETRIED_WHILE_PROMOTING:
                raise
            interrupted |= err.status in _INTERRUPTED
        await asyncio.sleep(0.5)  # the server has not seen this version's pollers yet, or was busy
    raise StartupCheckError(
        f"worker version {mine.to_canonical_string()} never appeared in Temporal's deployment list; "
        "check that the server supports Worker Versioning, or set FLEETMEND_WORKER_VERSIONING=false"
    )


def activity_threads(settings: Settings) -> ThreadPoolExecutor:
    """The activity executor ``build_worker`` wants: one thread per activity slot (``Settings.activity_threads``).

    The caller owns it (``with activity_threads(settings) as pool: ...``) and shuts it down after the worker.
    """
    return ThreadPoolExecutor(max_workers=settings.activity_threads, thread_name_prefix="fleetmend-activity")


def build_worker(
    client: Client,
    settings: Settings,
    *,
    activity_executor: ThreadPoolExecutor,
    task_queue: str | None = None,
    workflows: Sequence[type] | None = None,
    activities: Sequence[Callable[..., Any]] | None = None,
    versioned: bool = False,
) -> Worker:
    """A ``Worker`` on the fleetmend task queue with the registry's workflows and activities.

    ``versioned`` polls as this settings' deployment version (``fleetmend worker`` does;
    in-process test workers stay unversioned unless they ask).
    """
    return Worker(
        client,
        task_queue=task_queue or settings.task_queue,
        workflows=list(registry.WORKFLOWS if workflows is None else workflows),
        activities=list(registry.build_activities(settings) if activities is None else activities),
        activity_executor=activity_executor,
        max_concurrent_activities=settings.worker_max_concurrent_activities,
        max_concurrent_workflow_tasks=settings.worker_max_concurrent_workflow_tasks,
        max_cached_workflows=settings.worker_max_cached_workflows,
        interceptors=[ProcedureMetricsInterceptor(), WorkerPriorities()],
        # Let an in-flight Kubernetes call or drain step finish on deploy instead of cutting it.
        graceful_shutdown_timeout=timedelta(seconds=10),
        deployment_config=deployment_config(settings) if versioned else None,
    )


async def connect_checked(settings: Settings, *, runtime: Runtime | None, database_url: str | None) -> Client:
    """Connect and run every start-up check; any failure is a ``StartupCheckError`` naming its fix."""
    try:
        client = await connect(settings, runtime=runtime)
    except TemporalSettingError as err:
        raise StartupCheckError(str(err)) from err
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
    health = HealthServer(settings) if settings.worker_health_port else None
    if health is not None:
        await health.start()  # /healthz answers from here on; /readyz once polling
    try:
        client = await connect_checked(settings, runtime=runtime, database_url=database_url)
        with activity_threads(settings) as pool:
            async with build_worker(client, settings, activity_executor=pool, versioned=True):
                if settings.worker_versioning:
                    await promote_first_version(client, settings)
                log.info(
                    "worker polling",
                    extra={
                        "task_queue": settings.task_queue,
                        "namespace": client.namespace,
                        "temporal_address": client.service_client.config.target_host,
                        "metrics_port": settings.worker_metrics_port or None,
                        "deployment_version": deployment_version(settings).to_canonical_string()
                        if settings.worker_versioning
                        else None,
                    },
                )
                if health is not None:
                    health.polling(client, database_url)
                fast_path = None
                if settings.fastpath_enabled:
                    from worker.fastpath.service import build_fast_path

                    async def same_client() -> Client:
                        return client

                    fast_path = asyncio.create_task(
                        build_fast_path(settings, same_client).run(stop), name="fastpath"
                    )
                if ready is not None:
                    ready.set()
                await stop.wait()
                if fast_path is not None:
                    await asyncio.wait_for(fast_path, timeout=15)
                if health is not None:
                    health.stopping()
                log.info("worker stopping", extra={"task_queue": settings.task_queue})
    finally:
        if health is not None:
            await health.stop()
