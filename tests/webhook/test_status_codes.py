"""What Alertmanager (and an operator) sees from the webhook, status code by status code.

Alertmanager retries 5xx and network errors and never retries 4xx, so: a good
notification is 200, a bad one is a 4xx that starts nothing, and only a
transient failure (Temporal unreachable) is a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from typer.testing import CliRunner

from fleet.incident import PoolRef, incident_workflow_id
from tests.support import (
    ServedWebhook,
    pool_alert_labels,
    report_loss_signals,
    serve_webhook,
    webhook_settings,
    workflow_ids,
)
from worker.cli.app import app as cli_app
from worker.config import Settings
from worker.intake.rules import AlertRules
from worker.payloads import data_converter
from worker.processes import free_port
from worker.webhook.app import WebhookConfigError, create_app
from worker.webhook.examples import alert, example_payload, notification


def pool_payload(service: str, namespace: str = "llm", **extra: str) -> dict[str, Any]:
    return notification([alert(pool_alert_labels(namespace, service, **extra))])


async def post(served: ServedWebhook, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(
            served.url, content=content, headers=headers if headers is not None else served.auth
        )


async def no_workflows(client: Client, task_queue: str) -> bool:
    await asyncio.sleep(0.3)  # visibility lags the start by a moment
    return await workflow_ids(client, f'TaskQueue = "{task_queue}"') == []


async def test_firing_alert_starts_the_pools_incident_with_the_report_signalled(
    served: ServedWebhook, temporal_client: Client, service: str
) -> None:
    payload = pool_payload(service, replica_group=f"{service}-2")
    response = await post(served, payload)

    assert response.status_code == 200, response.text
    body = response.json()
    workflow_id = incident_workflow_id(PoolRef(namespace="llm", service=service))
    assert body["status"] == "accepted"
    assert body["incidents"] == [workflow_id]
    assert body["delivered"][0]["delivery"] == "signal-with-start"
    described = await temporal_client.get_workflow_handle(workflow_id).describe()
    assert described.workflow_type == "FleetIncident"
    assert described.task_queue == served.settings.task_queue
    [signal] = await report_loss_signals(temporal_client, workflow_id)
    assert signal["pool"] == {"namespace": "llm", "service": service}
    assert signal["replica_group"] == f"{service}-2"
    assert signal["fingerprint"] == payload["alerts"][0]["fingerprint"]
    assert signal["status"] == "firing"
    assert served.metric("fleetmend_incident_signals_sent_total", mode="signal-with-start") == 1


async def test_resolved_alert_is_signalled_too(
    served: ServedWebhook, temporal_client: Client, service: str
) -> None:
    labels = pool_alert_labels("llm", service)
    await post(served, notification([alert(labels)]))
    response = await post(served, notification([alert(labels, resolved=True)]))

    assert response.status_code == 200
    signals = await report_loss_signals(temporal_client, f"incident/llm/{service}")
    assert [s["status"] for s in signals] == ["firing", "resolved"]


async def test_unknown_alert_is_ignored_with_200_and_counted(
    served: ServedWebhook, temporal_client: Client
) -> None:
    payload = notification([alert({"alertname": "DiskAlmostFull", "instance": "db-1"})])
    response = await post(served, payload)

    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ignored"
    assert body["ignored"][0]["reason"] == "no-rule"
    assert served.metric("fleetmend_alerts_ignored_total", reason="no-rule") == 1
    assert await no_workflows(temporal_client, served.settings.task_queue)


async def test_alert_missing_the_labels_its_rule_needs_is_ignored_with_the_reason(
    served: ServedWebhook, service: str
) -> None:
    response = await post(served, notification([alert({"alertname": "PoolReplicaDown", "namespace": "llm"})]))

    assert response.status_code == 200
    [ignored] = response.json()["ignored"]
    assert ignored["reason"] == "labels-missing"
    assert "service" in ignored["detail"]


async def test_context_alert_reaches_only_an_incident_that_is_already_open(
    served: ServedWebhook, temporal_client: Client, service: str
) -> None:
    saturation = notification(
        [alert({"alertname": "PoolKVSaturation", "namespace": "llm", "service": service})]
    )
    before = await post(served, saturation)
    assert before.json()["ignored"][0]["reason"] == "no-open-incident"
    assert await no_workflows(temporal_client, served.settings.task_queue)

    await post(served, pool_payload(service))
    after = await post(served, saturation)
    assert after.json()["delivered"][0]["delivery"] == "signal"
    signals = await report_loss_signals(temporal_client, f"incident/llm/{service}")
    assert [s["alert_name"] for s in signals] == ["PoolReplicaDown", "PoolKVSaturation"]


@pytest.mark.parametrize(
    ("headers", "case"),
    [
        ({}, "no Authorization header"),
        ({"Authorization": "Bearer wrong-token"}, "wrong token"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, "wrong scheme"),
        ({"Authorization": "Bearer"}, "scheme without a token"),
    ],
)
async def test_unauthenticated_requests_get_401_and_start_nothing(
    served: ServedWebhook, temporal_client: Client, headers: dict[str, str], case: str, service: str
) -> None:
    response = await post(served, pool_payload(service), headers=headers)

    assert response.status_code == 401, case
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"] == "unauthorized"
    assert served.metric("fleetmend_webhook_requests_rejected_total", reason="unauthorized") == 1
    assert await no_workflows(temporal_client, served.settings.task_queue)


async def test_token_with_a_wrong_prefix_or_suffix_is_refused(served: ServedWebhook, service: str) -> None:
    for guess in (served.token[:-1], served.token + "x", served.token.upper(), " " + served.token + "x"):
        response = await post(served, pool_payload(service), headers={"Authorization": f"Bearer {guess}"})
        assert response.status_code == 401


async def test_body_over_the_limit_gets_413_and_starts_nothing(
    temporal_env: WorkflowEnvironment,
    task_queue: str,
    webhook_token: str,
    pool_rules: AlertRules,
    service: str,
) -> None:
    settings = webhook_settings(temporal_env, task_queue, webhook_token, webhook_max_body_bytes=2048)
    app = create_app(settings, rules=pool_rules)
    big = pool_payload(service, filler="x" * 4096)
    with serve_webhook(app, settings) as base_url:
        served = ServedWebhook(app, base_url, webhook_token, settings)
        declared = await post(served, big)

        async def chunks() -> Any:  # no Content-Length: the limit must hold while streaming
            raw = json.dumps(big).encode()
            for i in range(0, len(raw), 512):
                yield raw[i : i + 512]

        async with httpx.AsyncClient(timeout=30) as http:
            streamed = await http.post(served.url, content=chunks(), headers=served.auth)
        small = await post(served, pool_payload(service))

    assert declared.status_code == 413
    assert "2048-byte limit" in declared.json()["message"]
    assert streamed.status_code == 413
    assert small.status_code == 200
    assert await workflow_ids(temporal_env.client, f'TaskQueue = "{task_queue}"', at_least=1) == [
        f"incident/llm/{service}"
    ]


@pytest.mark.parametrize(
    ("content_type", "shown"),
    [
        ("text/plain", "'text/plain'"),
        ("text/plain; charset=utf-8", "'text/plain; charset=utf-8'"),
        ("application/x-www-form-urlencoded", "'application/x-www-form-urlencoded'"),  # curl -d
        (None, "no Content-Type"),
    ],
)
async def test_a_body_not_declared_json_gets_415_and_starts_nothing(
    served: ServedWebhook, temporal_client: Client, service: str, content_type: str | None, shown: str
) -> None:
    """The payload itself is a valid notification that would open an incident as JSON."""
    headers = {"Authorization": f"Bearer {served.token}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    response = await post(served, pool_payload(service), headers=headers)

    assert response.status_code == 415, response.text
    body = response.json()
    assert body["error"] == "unsupported-media-type"
    assert shown in body["message"] and "application/json" in body["message"]
    assert served.metric("fleetmend_webhook_requests_rejected_total", reason="unsupported-media-type") == 1
    assert served.metric("fleetmend_alerts_received_total", status="firing") == 0
    assert await no_workflows(temporal_client, served.settings.task_queue)


async def test_json_with_a_charset_is_accepted(served: ServedWebhook, service: str) -> None:
    headers = {"Authorization": f"Bearer {served.token}", "Content-Type": "Application/JSON; charset=utf-8"}
    response = await post(served, pool_payload(service), headers=headers)
    assert response.status_code == 200, response.text


async def test_an_unauthenticated_body_of_any_type_is_401_not_415(
    served: ServedWebhook, service: str
) -> None:
    response = await post(served, b"hello", headers={"Content-Type": "text/plain"})
    assert response.status_code == 401


@pytest.mark.parametrize(
    ("body", "status", "reason", "says"),
    [
        (b'{"version": "4", "alerts": [', 400, "malformed-json", "not JSON"),
        (b"\xff\xfe not utf-8", 400, "malformed-json", "not JSON"),
        (b"[]", 422, "invalid-payload", "JSON object"),
        ({**pool_payload("x"), "version": "3"}, 422, "unsupported-version", 'version "4"'),
        (
            {k: v for k, v in pool_payload("x").items() if k != "version"},
            422,
            "unsupported-version",
            "missing",
        ),
        ({**pool_payload("x"), "version": 4}, 422, "unsupported-version", "4"),
    ],
)
async def test_malformed_or_foreign_payloads_get_a_4xx_that_says_what_is_wrong(
    served: ServedWebhook, temporal_client: Client, body: Any, status: int, reason: str, says: str
) -> None:
    response = await post(served, body)

    assert response.status_code == status
    assert response.json()["error"] == reason
    assert says in response.json()["message"]
    assert await no_workflows(temporal_client, served.settings.task_queue)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: p["alerts"][0].update(status="burning"), "alerts.0.status"),
        (lambda p: p["alerts"][0].update(startsAt="yesterday"), "alerts.0.startsAt"),
        (lambda p: p["alerts"][0].pop("fingerprint"), "alerts.0.fingerprint"),
        (lambda p: p["alerts"][0]["labels"].update(severity=3), "alerts.0.labels.severity"),
        (lambda p: p.update(alerts={"not": "a list"}), "alerts"),
        (lambda p: p["alerts"][0].update(fingerprint="a b; DROP"), "alerts.0.fingerprint"),
    ],
)
async def test_invalid_fields_get_422_naming_the_field(
    served: ServedWebhook, temporal_client: Client, mutate: Any, field: str, service: str
) -> None:
    payload = pool_payload(service)
    mutate(payload)
    response = await post(served, payload)

    assert response.status_code == 422
    body = response.json()
    assert body["error"] == "invalid-payload"
    assert any(d.startswith(field + ":") for d in body["details"]), body["details"]
    assert await no_workflows(temporal_client, served.settings.task_queue)


async def test_unreachable_temporal_gets_503_and_alertmanagers_retry_lands(
    temporal_env: WorkflowEnvironment,
    task_queue: str,
    webhook_token: str,
    pool_rules: AlertRules,
    service: str,
) -> None:
    """First delivery: Temporal down (nothing listens on its port) -> 503 + Retry-After.
    Alertmanager retries; by then Temporal is back -> 200 and exactly one incident."""
    settings = webhook_settings(temporal_env, task_queue, webhook_token)
    temporal_up = False
    dead_address = f"127.0.0.1:{free_port()}"

    async def connect() -> Client:
        address = settings.temporal_address if temporal_up else dead_address
        return await Client.connect(
            address, namespace=settings.temporal_namespace, data_converter=data_converter
        )

    app = create_app(settings, rules=pool_rules, temporal_client_factory=connect)
    payload = pool_payload(service)
    with serve_webhook(app, settings) as base_url:
        served = ServedWebhook(app, base_url, webhook_token, settings)
        down = await post(served, payload)
        temporal_up = True
        retried = await post(served, payload)

    assert down.status_code == 503
    assert down.headers["retry-after"] == "5"
    assert down.json()["error"] == "temporal-unavailable"
    assert dead_address in down.json()["message"]
    assert retried.status_code == 200
    assert await workflow_ids(temporal_env.client, f'TaskQueue = "{task_queue}"', at_least=1) == [
        f"incident/llm/{service}"
    ]


async def test_healthz_readyz_and_metrics(
    temporal_env: WorkflowEnvironment,
    task_queue: str,
    webhook_token: str,
    pool_rules: AlertRules,
    pg_url: str,
) -> None:
    without_db = webhook_settings(temporal_env, task_queue, webhook_token)
    with_db = webhook_settings(temporal_env, task_queue, webhook_token, database_url=pg_url)
    async with httpx.AsyncClient(timeout=30) as http:
        with serve_webhook(create_app(without_db, rules=pool_rules), without_db) as base_url:
            health = await http.get(base_url + "/healthz")
            unready = await http.get(base_url + "/readyz")
        app = create_app(with_db, rules=pool_rules)
        with serve_webhook(app, with_db) as base_url:
            ready = await http.get(base_url + "/readyz")
            await http.post(
                base_url + "/alerts/alertmanager",
                content=b"{",
                headers={"Authorization": f"Bearer {webhook_token}", "Content-Type": "application/json"},
            )
            metrics = await http.get(base_url + "/metrics")

    assert health.status_code == 200
    assert unready.status_code == 503
    assert unready.json()["checks"]["temporal"] == "ok"
    assert "FLEETMEND_DATABASE_URL" in unready.json()["checks"]["database"]
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"ready": True, "checks": {"temporal": "ok", "database": "ok"}}
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'fleetmend_webhook_requests_rejected_total{reason="malformed-json"} 1.0' in metrics.text


def test_webhook_refuses_to_start_without_a_token(pool_rules: AlertRules) -> None:
    with pytest.raises(WebhookConfigError, match="FLEETMEND_WEBHOOK_TOKEN"):
        create_app(Settings(webhook_token=None), rules=pool_rules)


@pytest.mark.parametrize(
    ("tokens", "named"),
    [
        (
            {"webhook_token": "same", "effects_token": "same"},
            "FLEETMEND_WEBHOOK_TOKEN and FLEETMEND_EFFECTS_TOKEN",
        ),
        (
            {"webhook_token": "same", "ledger_token": "same"},
            "FLEETMEND_WEBHOOK_TOKEN and FLEETMEND_LEDGER_TOKEN",
        ),
        (
            {"webhook_token": "w", "effects_token": "same", "ledger_token": "same"},
            "FLEETMEND_EFFECTS_TOKEN and FLEETMEND_LEDGER_TOKEN",
        ),
    ],
)
def test_webhook_refuses_one_token_for_two_callers(
    pool_rules: AlertRules, tokens: dict[str, str], named: str
) -> None:
    """Alertmanager's credential must not also create effects or read the audit ledger."""
    settings = Settings(**{k: SecretStr(v) for k, v in tokens.items()})
    with pytest.raises(WebhookConfigError, match=named):
        create_app(settings, rules=pool_rules)


async def test_metrics_are_open_and_name_no_pool_node_or_fingerprint(
    served: ServedWebhook, service: str
) -> None:
    """/metrics needs no token because nothing in it identifies the fleet: counts by reason, rule
    and status code only (README, "Authentication")."""
    payload = pool_payload(service, replica_group=f"{service}-0", node="gpu-node-secret-7")
    assert (await post(served, payload)).status_code == 200
    async with httpx.AsyncClient(timeout=30) as http:
        metrics = await http.get(served.base_url + "/metrics")
    assert metrics.status_code == 200
    assert (
        'fleetmend_alerts_accepted_total{action="start-incident",alertname="PoolReplicaDown"} 1.0'
        in metrics.text
    )
    for secret in (service, "gpu-node-secret-7", payload["alerts"][0]["fingerprint"], served.token):
        assert secret not in metrics.text


async def test_token_never_appears_in_logs_or_config(
    served: ServedWebhook, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, service: str
) -> None:
    caplog.set_level(logging.DEBUG)
    await post(served, pool_payload(service))
    await post(served, pool_payload(service), headers={"Authorization": f"Bearer {served.token}x"})
    await post(served, b"{", headers=served.auth)
    logged = caplog.text + "".join(json.dumps(r.__dict__, default=str) for r in caplog.records)
    assert "rejected" in logged and "delivered" in logged  # the logs were captured at all
    assert served.token not in logged

    monkeypatch.setenv("FLEETMEND_WEBHOOK_TOKEN", served.token)
    for args in (["config"], ["config", "--json"]):
        result = CliRunner().invoke(cli_app, args)
        assert result.exit_code == 0, result.output
        assert served.token not in result.output
        assert "webhook_token" in result.output.lower()


async def test_alert_cli_posts_an_example_with_the_token(
    served: ServedWebhook,
    temporal_client: Client,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    service: str,
) -> None:
    monkeypatch.setenv("FLEETMEND_WEBHOOK_TOKEN", served.token)
    payload = example_payload("node-not-ready")
    payload["alerts"][0]["labels"] = pool_alert_labels("llm", service)
    path = tmp_path / "alert.json"
    path.write_text(json.dumps(payload))

    result = await asyncio.to_thread(
        CliRunner().invoke, cli_app, ["alert", "--file", str(path), "--url", served.url]
    )

    assert result.exit_code == 0, result.output
    assert "HTTP 200" in result.output
    assert f"incident/llm/{service}" in result.output
    monkeypatch.setenv("FLEETMEND_WEBHOOK_TOKEN", "not-the-token")
    refused = await asyncio.to_thread(
        CliRunner().invoke, cli_app, ["alert", "--file", str(path), "--url", served.url]
    )
    assert refused.exit_code == 1
    assert "HTTP 401" in refused.output


async def test_alert_cli_uses_the_dev_stacks_token_file_when_no_token_is_configured(
    served: ServedWebhook, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, service: str
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "webhook-token").write_text(served.token + "\n")
    monkeypatch.delenv("FLEETMEND_WEBHOOK_TOKEN", raising=False)
    monkeypatch.setenv("FLEETMEND_STATE_DIR", str(state))
    path = tmp_path / "alert.json"
    path.write_text(json.dumps(pool_payload(service)))

    result = await asyncio.to_thread(
        CliRunner().invoke, cli_app, ["alert", "--file", str(path), "--url", served.url]
    )

    assert result.exit_code == 0, result.output
    assert "HTTP 200" in result.output


async def test_openapi_documents_the_alertmanager_payload_and_mounts_the_effect_api(
    served: ServedWebhook,
) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        spec = (await http.get(served.base_url + "/openapi.json")).json()

    operation = spec["paths"]["/alerts/alertmanager"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    assert {"version", "status", "receiver", "alerts"} <= set(schema["required"])
    assert {"200", "401", "413", "415", "422", "503"} <= set(operation["responses"])
    assert "/v1/effects" in spec["paths"]  # the ledger's effect API shares the webhook's server


def test_the_dev_stack_keeps_a_token_per_caller_in_0600_files(tmp_path: Any, pool_rules: AlertRules) -> None:
    from worker.devstack.stack import dev_token_file, ensure_dev_webhook_token

    first = ensure_dev_webhook_token(Settings(state_dir=tmp_path, effects_token=SecretStr("configured")))
    assert first.effects_token is not None and first.effects_token.get_secret_value() == "configured"
    assert not dev_token_file(first, "effects_token").exists()  # a configured token is not written anywhere
    again = ensure_dev_webhook_token(Settings(state_dir=tmp_path))

    for setting in ("webhook_token", "ledger_token"):
        path = dev_token_file(first, setting)
        assert path.stat().st_mode & 0o777 == 0o600
        assert getattr(first, setting).get_secret_value() == path.read_text().strip()
        assert getattr(again, setting).get_secret_value() == path.read_text().strip()  # kept across restarts
    assert again.effects_token is not None
    values = {
        s.get_secret_value() for s in (again.webhook_token, again.effects_token, again.ledger_token) if s
    }
    assert len(values) == 3
    create_app(again, rules=pool_rules)  # distinct: the webhook starts with them
