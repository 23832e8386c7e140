"""Fixtures for the alert webhook: the real app served by uvicorn on a loopback socket.

The server runs in a thread with its own event loop, so both async tests and
synchronous (hypothesis) tests can talk to it over real HTTP. Temporal is the
session dev server from ``tests/conftest.py``.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr
from starlette.types import ASGIApp
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from fleet.incident import REPORT_LOSS_SIGNAL
from worker.config import Settings
from worker.intake.rules import AlertRules, parse_alert_rules
from worker.webhook.app import ALERTMANAGER_PATH, create_app

# Alerts that name the pool directly need no Kubernetes API: status-code and storm
# tests use these; node/pod resolution is tested against the simulated cluster.
POOL_RULES_YAML = """
version: 1
rules:
  - alert: PoolReplicaDown
    description: a pool lost a replica group (labels name the pool)
    action: start-incident
    fault: node-lost
    entity: {namespace: namespace, service: service, replica_group: replica_group}
  - alert: PoolKVSaturation
    action: signal-open-incident
    severity: warning
    entity: {namespace: namespace, service: service}
"""


@dataclass
class ServedWebhook:
    app: FastAPI
    base_url: str
    token: str
    settings: Settings

    @property
    def url(self) -> str:
        return self.base_url + ALERTMANAGER_PATH

    @property
    def auth(self) -> dict[str, str]:
        """The headers Alertmanager sends: its bearer token and the JSON content type."""
        return {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}

    def metric(self, name: str, **labels: str) -> float:
        value = self.app.state.metrics.registry.get_sample_value(name, labels or None)
        return float(value or 0.0)


@contextmanager
def serve_webhook(app: ASGIApp, settings: Settings) -> Iterator[str]:
    """Serve ``app`` (the webhook's FastAPI app, or an ASGI wrapper of it) on a free loopback port
    in a background thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit this; without it each reply waits out a 40 ms delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_keep_alive=30)
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        for _ in range(400):
            if server.started:
                break
            if not thread.is_alive():
                raise RuntimeError("webhook server thread died during start-up")
            threading.Event().wait(0.025)
        else:
            raise RuntimeError("webhook server did not start within 10 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def webhook_settings(env: WorkflowEnvironment, task_queue: str, token: str, **overrides: Any) -> Settings:
    return Settings(
        temporal_address=env.client.service_client.config.target_host,
        temporal_namespace=env.client.namespace,
        task_queue=task_queue,
        webhook_token=SecretStr(token),
        **overrides,
    )


@pytest.fixture(scope="session")
def pool_rules() -> AlertRules:
    return parse_alert_rules(POOL_RULES_YAML, source="test rules")


@pytest.fixture
def service() -> str:
    """A pool name of this test's own: incident workflow ids are per pool and the dev server is shared."""
    return f"pool-{secrets.token_hex(4)}"


@pytest.fixture
def webhook_token() -> str:
    return secrets.token_hex(24)


@pytest.fixture
def served(
    temporal_env: WorkflowEnvironment, task_queue: str, webhook_token: str, pool_rules: AlertRules
) -> Iterator[ServedWebhook]:
    """The webhook with the pool rules, talking to the session Temporal dev server."""
    settings = webhook_settings(temporal_env, task_queue, webhook_token)
    app = create_app(settings, rules=pool_rules)
    with serve_webhook(app, settings) as base_url:
        yield ServedWebhook(app, base_url, webhook_token, settings)


def pool_alert_labels(namespace: str, service: str, **extra: str) -> dict[str, str]:
    return {
        "alertname": "PoolReplicaDown",
        "namespace": namespace,
        "service": service,
        "severity": "critical",
        **extra,
    }


async def report_loss_signals(client: Client, workflow_id: str) -> list[dict[str, Any]]:
    """The ``report_loss`` payloads in the workflow's history, decoded as JSON."""
    import json

    signals = []
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            attrs = event.workflow_execution_signaled_event_attributes
            if attrs.signal_name == REPORT_LOSS_SIGNAL:
                signals.append(json.loads(attrs.input.payloads[0].data))
    return signals


async def workflow_ids(
    client: Client, query: str, *, at_least: int = 0, timeout_s: float = 10.0
) -> list[str]:
    """Workflow ids matching a visibility query, waiting up to ``timeout_s`` for ``at_least`` of them
    (visibility trails the start by a moment)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        ids = sorted([wf.id async for wf in client.list_workflows(query)])
        if len(ids) >= at_least or asyncio.get_running_loop().time() > deadline:
            return ids
        await asyncio.sleep(0.1)
