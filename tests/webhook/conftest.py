"""Fixtures for the alert webhook: the real app served by uvicorn on a loopback socket.

The server runs in a thread with its own event loop, so both async tests and
synchronous (hypothesis) tests can talk to it over real HTTP. Temporal is the
session dev server from ``tests/conftest.py``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.support import ServedWebhook, serve_webhook, webhook_settings
from worker.intake.rules import AlertRules, parse_alert_rules
from worker.webhook.app import create_app

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
