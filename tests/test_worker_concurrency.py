"""The worker's concurrency comes from its settings (README "A slow world, and many incidents at once"),
and a look at a pool's engines never waits past its share of the attempt's time."""

from __future__ import annotations

import ast
import threading
import time
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.client import Client

from activities.engine_reads import EngineRead, read_all
from activities.smoke import smoke_probe
from fleet.observation import EngineHealth
from kube.client import kube_apis
from worker.config import CONCURRENCY_SETTINGS, Settings, load_settings
from worker.registry import activity_config
from worker.worker import activity_threads, build_worker
from workflows.smoke import FleetmendSmoke


def test_defaults_hold_a_burst_of_recoveries_and_every_slot_has_a_thread() -> None:
    settings = Settings()
    assert settings.worker_max_concurrent_activities >= 100  # ~50 recoveries per worker x 2 or more
    assert settings.activity_threads == settings.worker_max_concurrent_activities
    assert settings.http_connections >= settings.worker_max_concurrent_activities
    for name in CONCURRENCY_SETTINGS:
        assert Settings.model_fields[name].description, name


def test_fewer_threads_than_activity_slots_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETMEND_WORKER_MAX_CONCURRENT_ACTIVITIES", "50")
    monkeypatch.setenv("FLEETMEND_WORKER_ACTIVITY_THREADS", "20")
    with pytest.raises(ValidationError, match=r"worker_activity_threads \(20\) is below .* \(50\)"):
        load_settings()
    monkeypatch.setenv("FLEETMEND_WORKER_ACTIVITY_THREADS", "80")
    assert load_settings().activity_threads == 80


async def test_the_worker_is_built_with_the_settings_concurrency(temporal_client: Client) -> None:
    settings = load_settings(
        task_queue=f"concurrency-{uuid.uuid4().hex[:8]}",
        worker_max_concurrent_activities=40,
        worker_max_concurrent_workflow_tasks=30,
        worker_max_cached_workflows=300,
    )
    with activity_threads(settings) as pool:
        worker = build_worker(
            temporal_client,
            settings,
            activity_executor=pool,
            workflows=[FleetmendSmoke],
            activities=[smoke_probe],
        )
        config = worker.config()
        assert config.get("max_concurrent_activities") == 40
        assert config.get("max_concurrent_workflow_tasks") == 30
        assert config.get("max_cached_workflows") == 300
        assert pool._max_workers == 40  # one thread per slot


def test_activities_get_the_connection_pools_the_settings_name(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    config = activity_config(
        load_settings(
            kubeconfig=kubeconfig, kube_connections=48, engine_reads_per_look=3, http_connections=99
        )
    )
    assert (config.kube_connections, config.engine_reads_per_look, config.http_connections) == (48, 3, 99)
    apis = kube_apis(config, config.kube_connections)
    assert apis.core.api_client.configuration.connection_pool_maxsize == 48


def test_a_look_names_the_engines_that_did_not_answer_by_its_deadline_and_keeps_the_others() -> None:
    never = threading.Event()

    def read(key: str) -> EngineRead:
        if key == "stuck":
            never.wait(30)  # an engine that connected and answers nothing (its HTTP timeout would end it)
        return EngineRead(EngineHealth.OK)

    try:
        reads = read_all(read, ["a", "stuck", "b"], deadline=time.monotonic() + 0.5, concurrency=3)
    finally:
        never.set()
    assert reads["a"] == reads["b"] == EngineRead(EngineHealth.OK)
    assert reads["stuck"] == EngineRead(EngineHealth.UNKNOWN, unread="not read within the look's time")
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        read_all(read, ["a"], deadline=time.monotonic() + 1, concurrency=0)


def test_no_activity_runs_blocking_code_on_the_worker_event_loop() -> None:
    """fleetmend's activities are plain functions run on the activity threads; the only ``async`` ones
    ask Temporal through the SDK's own asynchronous client (nothing in them blocks the loop): is an
    incident open on a pool, the removal breaker's Update-With-Start, and the recoveries rebuilding
    fleet-wide (a visibility list)."""
    async_activities: list[str] = []
    for path in sorted((Path(__file__).resolve().parents[1] / "activities").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AsyncFunctionDef) and any(
                "activity.defn" in ast.unparse(d) for d in node.decorator_list
            ):
                async_activities.append(node.name)
    assert async_activities == ["incident_on_pool", "ask_breaker", "recovery_slots"], async_activities
