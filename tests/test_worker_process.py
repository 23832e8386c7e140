"""The worker against a real Temporal dev server: the smoke path, start-up checks, metrics, logs."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from google.protobuf.duration_pb2 import Duration
from prometheus_client.parser import text_string_to_metric_families
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from fleet.search_attributes import CLI_TYPE_NAMES, FLEETMEND_KIND, FLEETMEND_PHASE
from ledger.migrate import upgrade_head
from tests.support import running_worker
from tests.timer_workflow import SixHourWait
from worker import jsonlog
from worker.config import Settings, load_settings
from worker.processes import free_port, log_tail
from worker.startup_checks import StartupCheckError, check_search_attributes, missing_search_attributes
from worker.worker import connect_checked, metrics_runtime, run_worker
from workflows.smoke import FleetmendSmoke


async def test_smoke_workflow_runs_through_a_real_worker(
    temporal_client: Client, worker_settings: Settings
) -> None:
    async with running_worker(temporal_client, worker_settings):
        handle = await temporal_client.start_workflow(
            FleetmendSmoke.run,
            "ping",
            id=f"smoke-{uuid.uuid4().hex[:8]}",
            task_queue=worker_settings.task_queue,
            execution_timeout=timedelta(seconds=30),
        )
        result = await handle.result()
    assert result.reply.echo == "ping"
    # The sync activity ran on the worker's thread pool, as the Kubernetes activities will.
    assert result.reply.thread.startswith("fleetmend-activity")
    described = await handle.describe()
    assert described.typed_search_attributes.get(FLEETMEND_KIND) == "smoke"
    assert described.typed_search_attributes.get(FLEETMEND_PHASE) == "done"


async def _namespace(client: Client) -> str:
    """A fresh namespace on the session server, with no custom search attributes yet."""
    name = f"fm-{uuid.uuid4().hex[:10]}"
    await client.workflow_service.register_namespace(
        RegisterNamespaceRequest(namespace=name, workflow_execution_retention_period=Duration(seconds=86400))
    )
    return name


async def test_worker_refuses_to_start_when_a_search_attribute_is_missing(
    temporal_client: Client, worker_settings: Settings
) -> None:
    namespace = await _namespace(temporal_client)
    present = {name: kind for name, kind in CLI_TYPE_NAMES.items() if name != "FleetmendPhase"}
    await temporal_client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=namespace,
            search_attributes={
                name: IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{kind.upper()}")
                for name, kind in present.items()
            },
        )
    )
    settings = worker_settings.model_copy(update={"temporal_namespace": namespace})
    with pytest.raises(StartupCheckError) as failure:
        await connect_checked(settings, runtime=None, database_url=None)
    message = str(failure.value)
    assert "FleetmendPhase" in message
    assert "FleetmendKind" not in message  # only what is actually missing is named
    assert f"search-attribute create --namespace {namespace} --name FleetmendPhase --type Keyword" in message


async def test_all_search_attributes_registered_on_the_dev_server(temporal_client: Client) -> None:
    await check_search_attributes(temporal_client, temporal_client.namespace)


def test_a_search_attribute_of_the_wrong_type_counts_as_missing() -> None:
    keyword = IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
    registered = {name: keyword for name in CLI_TYPE_NAMES}  # FleetmendDryRun should be Bool
    assert missing_search_attributes(registered, CLI_TYPE_NAMES) == {"FleetmendDryRun": "Bool"}


async def test_worker_refuses_an_unknown_namespace(worker_settings: Settings) -> None:
    settings = worker_settings.model_copy(update={"temporal_namespace": "no-such-namespace"})
    with pytest.raises(
        StartupCheckError, match=r"namespace 'no-such-namespace' does not exist.*namespace create"
    ):
        await connect_checked(settings, runtime=None, database_url=None)


async def test_worker_names_the_fix_when_temporal_is_unreachable(worker_settings: Settings) -> None:
    settings = worker_settings.model_copy(update={"temporal_address": f"127.0.0.1:{free_port()}"})
    with pytest.raises(StartupCheckError, match=r"cannot reach Temporal at .*FLEETMEND_TEMPORAL_ADDRESS"):
        await connect_checked(settings, runtime=None, database_url=None)


async def test_worker_exports_sdk_metrics_and_stops_on_request(
    temporal_client: Client, worker_settings: Settings
) -> None:
    settings = worker_settings.model_copy(update={"worker_metrics_port": free_port()})
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        run_worker(settings, stop=stop, database_url=None, runtime=metrics_runtime(settings), ready=ready)
    )
    await asyncio.wait_for(ready.wait(), timeout=30)
    await temporal_client.execute_workflow(
        FleetmendSmoke.run, "metrics", id=f"smoke-{uuid.uuid4().hex[:8]}", task_queue=settings.task_queue
    )
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{settings.worker_metrics_port}/metrics")).text
    names = {family.name for family in text_string_to_metric_families(text)}
    assert "temporal_worker_task_slots_available" in names
    assert any(name.startswith("temporal_activity_execution_latency") for name in names)
    stop.set()
    await asyncio.wait_for(task, timeout=30)


def test_logs_are_json_lines_with_extra_fields() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        jsonlog.configure("INFO", stream=stream)
        logging.getLogger("fleetmend.test").info("worker polling", extra={"task_queue": "fleetmend"})
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    entry = json.loads(stream.getvalue().splitlines()[-1])
    assert entry["msg"] == "worker polling"
    assert entry["task_queue"] == "fleetmend"
    assert entry["level"] == "info"


async def test_time_skipping_server_finishes_a_six_hour_timer_quickly(
    time_skipping_env: WorkflowEnvironment, task_queue: str, tmp_path: Path
) -> None:
    client = time_skipping_env.client
    settings = load_settings(task_queue=task_queue, worker_metrics_port=0, state_dir=tmp_path)
    async with running_worker(client, settings, workflows=[SixHourWait], activities=[]):
        elapsed = await asyncio.wait_for(
            client.execute_workflow(
                SixHourWait.run, id=f"wait-{uuid.uuid4().hex[:8]}", task_queue=task_queue
            ),
            timeout=60,
        )
    assert elapsed.startswith("6:00:")


async def test_worker_refuses_an_unmigrated_ledger_and_accepts_a_migrated_one(
    worker_settings: Settings, pg_url: str
) -> None:
    with pytest.raises(StartupCheckError, match="not at the latest migration"):
        await connect_checked(worker_settings, runtime=None, database_url=pg_url)
    upgrade_head(pg_url)
    await connect_checked(worker_settings, runtime=None, database_url=pg_url)


async def test_worker_names_the_fix_when_the_ledger_is_unreachable(worker_settings: Settings) -> None:
    url = f"postgresql+psycopg://fm:pw@127.0.0.1:{free_port()}/ledger"
    with pytest.raises(StartupCheckError, match="FLEETMEND_DATABASE_URL points at a reachable Postgres"):
        await connect_checked(worker_settings, runtime=None, database_url=url)


def test_fleetmend_worker_command_logs_json_serves_and_stops_on_sigterm(
    worker_settings: Settings, ledger_url: str
) -> None:
    metrics_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEND_")}
    env.update(
        {
            "FLEETMEND_TEMPORAL_ADDRESS": worker_settings.temporal_address,
            "FLEETMEND_TASK_QUEUE": worker_settings.task_queue,
            "FLEETMEND_DATABASE_URL": ledger_url,
            "FLEETMEND_WORKER_METRICS_PORT": str(metrics_port),
        }
    )
    log_file = worker_settings.state_dir.parent / "worker.log"
    with log_file.open("wb") as sink:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "fleetmend"), "worker"], stderr=sink, stdout=sink, env=env
        )
    try:
        deadline = time.monotonic() + 60
        while "worker polling" not in log_file.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_file.read_text()
            time.sleep(0.2)
        polling = next(
            json.loads(line) for line in log_file.read_text().splitlines() if "worker polling" in line
        )
        assert polling["task_queue"] == worker_settings.task_queue
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_child_that_panicked_is_reported_by_its_panic_line_not_only_its_stack(tmp_path: Path) -> None:
    log = tmp_path / "temporal.log"
    stack = [f"\tgoroutine frame {i}" for i in range(40)]
    log.write_text(
        "\n".join(["starting", "panic: listen tcp 127.0.0.1:4242: bind: address already in use", *stack])
    )
    tail = log_tail(log).splitlines()
    assert tail[0] == "panic: listen tcp 127.0.0.1:4242: bind: address already in use"
    assert tail[-1] == "\tgoroutine frame 39" and len(tail) == 7
    log.write_text("one\ntwo\nError: can't set frontend port 1: in use\n")  # already among the last lines
    assert log_tail(log) == "one\ntwo\nError: can't set frontend port 1: in use"
