"""The alert webhook API: Alertmanager posts here, fleetmend starts the right incident once.

Status codes follow Alertmanager's retry rules (it retries 5xx and network
errors, never 4xx):

* 200 — every alert was delivered to its pool's incident or deliberately ignored;
* 400/422 — the payload is malformed, of another version or has invalid fields:
  retrying cannot help, so nothing is retried and nothing is started;
* 401 — missing or wrong bearer token (``FLEETMEND_WEBHOOK_TOKEN``, compared in constant time);
* 413 — body larger than ``FLEETMEND_WEBHOOK_MAX_BODY_BYTES`` (32 MiB by default: a
  10,000-alert group, the shipped receiver's ``max_alerts``, fits with room to spare);
* 415 — the body is not declared ``application/json`` (Alertmanager always declares it);
* 503 — Temporal or the Kubernetes API is unreachable: Alertmanager retries, and
  repeats are harmless because delivery is idempotent.

The same server carries the effect API (``POST /v1/effects``, token
``FLEETMEND_EFFECTS_TOKEN``) and the ledger audit API (``GET /ledger/effects...``,
token ``FLEETMEND_LEDGER_TOKEN``), see ``worker/webhook/effects_api.py``. Open
without a token: ``GET /healthz`` (process alive), ``GET /readyz`` (Temporal and the
ledger database reachable) and ``GET /metrics`` (Prometheus). The metrics are not
sensitive: counters and latencies labelled only by reason, status code, delivery
mode and the routing rules' alert names (no pool, node, pod, fingerprint, token or
ledger content), and Prometheus scrapes them without credentials like every exporter.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from worker.config import Settings
from worker.intake.alertmanager import SUPPORTED_VERSION, AlertmanagerPayload
from worker.intake.intake import AlertIntake, IntakeResult, TemporalClientFactory, TemporalUnavailable
from worker.intake.metrics import WebhookMetrics
from worker.intake.routing import AlertRouter
from worker.intake.rules import AlertRules, load_alert_rules
from worker.intake.topology import KubernetesUnavailable, PoolTopology
from worker.webhook.auth import TokenReuse, bearer_matches, check_tokens_distinct

log = logging.getLogger("fleetmend.webhook")

ALERTMANAGER_PATH = "/alerts/alertmanager"
RETRY_AFTER_S = "5"
JSON_MEDIA_TYPE = "application/json"
# Ignored alerts listed one by one in a reply; the rest are counted by reason (a 10,000-alert
# group of noise would otherwise answer with megabytes nobody reads).
MAX_IGNORED_LISTED = 100

DatabaseProbe = Callable[[], Awaitable[None]]


class WebhookConfigError(ValueError):
    """The webhook cannot start with these settings; the message says what to set."""


class _Rejected(Exception):
    def __init__(self, status: int, reason: str, message: str, details: list[str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.details = details or []


def create_app(
    settings: Settings,
    *,
    temporal_client_factory: TemporalClientFactory | None = None,
    rules: AlertRules | None = None,
    topology: PoolTopology | None = None,
    database_probe: DatabaseProbe | None = None,
    metrics: WebhookMetrics | None = None,
) -> FastAPI:
    """Build the webhook API. Raises ``WebhookConfigError`` / ``AlertRulesError`` before serving
    anything when the token or the routing rules are unusable."""
    token = settings.webhook_token.get_secret_value() if settings.webhook_token else ""
    if not token:
        raise WebhookConfigError(
            "FLEETMEND_WEBHOOK_TOKEN is not set: the alert webhook refuses to run without a bearer token. "
            "Generate one (e.g. `openssl rand -hex 32`), set it here and in Alertmanager's "
            "http_config.authorization (credentials_file, see deploy/alertmanager/alertmanager.yml)"
        )
    try:
        check_tokens_distinct(settings)
    except TokenReuse as err:
        raise WebhookConfigError(str(err)) from err
    expected_token = token.encode()
    rules = rules or load_alert_rules(settings.alert_rules_file)
    topology = topology or PoolTopology.from_settings(settings)
    metrics = metrics or WebhookMetrics()
    client_factory = temporal_client_factory or _default_client_factory(settings)
    intake = AlertIntake(settings, AlertRouter(rules, topology), client_factory, metrics)
    engine_holder: list[Engine] = []
    probe_database = database_probe or _sqlalchemy_probe(settings, engine_holder)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        log.info(
            "alert webhook ready",
            extra={"rules": len(rules.rules), "path": ALERTMANAGER_PATH, "task_queue": settings.task_queue},
        )
        for setting, value, api in (
            ("FLEETMEND_EFFECTS_TOKEN", settings.effects_token, "POST /v1/effects"),
            ("FLEETMEND_LEDGER_TOKEN", settings.ledger_token, "GET /ledger/effects"),
        ):
            if not (value and value.get_secret_value()):
                log.warning(f"{setting} is not set: {api} refuses every request (503) until it is")
        yield
        for engine in engine_holder:
            engine.dispose()

    app = FastAPI(
        title="fleetmend alert webhook",
        summary="Alertmanager webhook receiver: alerts become loss reports in the pool's FleetIncident.",
        lifespan=lifespan,
    )
    app.state.metrics = metrics
    app.state.intake = intake

    @app.post(
        ALERTMANAGER_PATH,
        summary="Receive an Alertmanager webhook notification (payload version 4)",
        responses={
            200: {"description": "Alerts delivered to their incidents or ignored (with reasons)"},
            400: {"description": "Body is not JSON"},
            401: {"description": "Missing or wrong bearer token"},
            413: {"description": "Body over the size limit"},
            415: {"description": "Content-Type is not application/json"},
            422: {"description": "Wrong payload version or invalid fields"},
            503: {"description": "Temporal or Kubernetes unreachable: Alertmanager retries"},
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": AlertmanagerPayload.model_json_schema(by_alias=True)}
                },
            }
        },
    )
    async def receive_alerts(request: Request) -> Response:
        started = time.perf_counter()
        try:
            if not bearer_matches(request.headers.get("authorization"), expected_token):
                raise _Rejected(401, "unauthorized", "missing or wrong bearer token")
            _require_json(request.headers.get("content-type"))
            body = await _read_limited(request, settings.webhook_max_body_bytes)
            payload = _parse_payload(body)
            result = await intake.handle(payload)
            response: Response = JSONResponse(_accepted_body(payload, result))
        except _Rejected as rejection:
            metrics.requests_rejected.labels(rejection.reason).inc()
            log.warning(
                "alert notification rejected",
                extra={
                    "reason": rejection.reason,
                    "status_code": rejection.status,
                    "detail": rejection.message,
                    "client": request.client.host if request.client else None,
                },
            )
            response = _error_response(rejection)
        except (TemporalUnavailable, KubernetesUnavailable) as err:
            reason = (
                "temporal-unavailable" if isinstance(err, TemporalUnavailable) else "kubernetes-unavailable"
            )
            metrics.requests_rejected.labels(reason).inc()
            log.error(
                "alert notification not delivered; the sender will retry",
                extra={"reason": reason, "detail": str(err)},
            )
            response = _error_response(_Rejected(503, reason, f"{err}; retry later (delivery is idempotent)"))
            response.headers["Retry-After"] = RETRY_AFTER_S
        metrics.request_seconds.labels(str(response.status_code)).observe(time.perf_counter() - started)
        return response

    @app.get("/healthz", summary="Liveness: the process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="Readiness: Temporal and the ledger database are reachable")
    async def readyz() -> JSONResponse:
        checks = dict(
            zip(
                ("temporal", "database"),
                await asyncio.gather(_check(_temporal_probe(intake)), _check(probe_database)),
                strict=True,
            )
        )
        ready = all(v == "ok" for v in checks.values())
        return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)

    @app.get("/metrics", summary="Prometheus metrics of the receiver")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _include_effects_api(app, settings)
    return app


def _require_json(content_type: str | None) -> None:
    """Alertmanager declares ``application/json``; anything else was not meant for this route."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type == JSON_MEDIA_TYPE or (
        media_type.startswith("application/") and media_type.endswith("+json")
    ):
        return
    shown = f"Content-Type {content_type[:100]!r}" if content_type else "no Content-Type"
    raise _Rejected(
        415,
        "unsupported-media-type",
        f"{shown}: the body must be an Alertmanager webhook notification sent as {JSON_MEDIA_TYPE}",
    )


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _Rejected(400, "invalid-content-length", f"Content-Length {declared!r} is not a byte count")
        if int(declared) > limit:
            raise _Rejected(413, "too-large", f"body of {declared} bytes exceeds the {limit}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _Rejected(413, "too-large", f"body exceeds the {limit}-byte limit")
    return bytes(body)


def _parse_payload(body: bytes) -> AlertmanagerPayload:
    # Fast path: pydantic parses and validates in one pass (a 10,000-alert group in a fraction
    # of json.loads + model_validate). Anything it refuses is diagnosed below, step by step.
    try:
        parsed = AlertmanagerPayload.model_validate_json(body)
    except (ValidationError, RecursionError):
        pass
    else:
        if parsed.version == SUPPORTED_VERSION:
            return parsed
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _Rejected(400, "malformed-json", f"body is not JSON: {str(err)[:200]}") from err
    if not isinstance(data, dict):
        raise _Rejected(
            422, "invalid-payload", "payload must be a JSON object (Alertmanager webhook version 4)"
        )
    version = data.get("version")
    if version != SUPPORTED_VERSION:
        shown = "missing" if version is None else repr(version)[:40]
        raise _Rejected(
            422,
            "unsupported-version",
            f"payload version {shown} is not supported: fleetmend accepts Alertmanager webhook payload "
            f'version "{SUPPORTED_VERSION}"',
        )
    try:
        return AlertmanagerPayload.model_validate(data)
    except (ValidationError, RecursionError) as err:
        details = (
            [f"{'.'.join(str(p) for p in e['loc']) or '(payload)'}: {e['msg']}" for e in err.errors()[:20]]
            if isinstance(err, ValidationError)
            else ["payload nests too deeply"]
        )
        raise _Rejected(422, "invalid-payload", "payload fields are invalid", details) from err


def _accepted_body(payload: AlertmanagerPayload, result: IntakeResult) -> dict[str, Any]:
    by_reason: dict[str, int] = {}
    for ignored in result.ignored:
        by_reason[ignored.reason.value] = by_reason.get(ignored.reason.value, 0) + 1
    return {
        "status": "accepted" if result.delivered else "ignored",
        "alerts": len(payload.alerts),
        "incidents": result.workflows,
        "delivered": [
            {
                "workflow_id": d.workflow_id,
                "alertname": d.alert_name,
                "fingerprint": d.fingerprint,
                "status": d.status,
                "replica_group": d.replica_group,
                "delivery": d.mode,
            }
            for d in result.delivered
        ],
        "ignored": [
            {
                "alertname": i.alert_name,
                "fingerprint": i.fingerprint,
                "reason": i.reason.value,
                "detail": i.detail,
            }
            for i in result.ignored[:MAX_IGNORED_LISTED]
        ],
        "ignored_count": len(result.ignored),
        "ignored_by_reason": dict(sorted(by_reason.items())),
    }


def _error_response(rejection: _Rejected) -> JSONResponse:
    body: dict[str, Any] = {"error": rejection.reason, "message": rejection.message}
    if rejection.details:
        body["details"] = rejection.details
    headers = {"WWW-Authenticate": "Bearer"} if rejection.status == 401 else None
    return JSONResponse(body, status_code=rejection.status, headers=headers)


async def _check(probe: DatabaseProbe) -> str:
    try:
        await asyncio.wait_for(probe(), timeout=5.0)
    except Exception as err:
        return f"unreachable: {str(err).splitlines()[0][:300] if str(err) else type(err).__name__}"
    return "ok"


def _temporal_probe(intake: AlertIntake) -> DatabaseProbe:
    async def probe() -> None:
        client = await intake.client()
        await client.service_client.check_health()

    return probe


def _sqlalchemy_probe(settings: Settings, engines: list[Engine]) -> DatabaseProbe:
    url = settings.database_url_value()

    def select_one() -> None:
        if not engines:
            engines.append(create_engine(url or "", pool_pre_ping=True, connect_args={"connect_timeout": 3}))
        with engines[0].connect() as conn:
            conn.execute(text("SELECT 1"))

    async def probe() -> None:
        if not url:
            raise RuntimeError("FLEETMEND_DATABASE_URL is not set (the ledger database)")
        await asyncio.to_thread(select_one)

    return probe


def _default_client_factory(settings: Settings) -> TemporalClientFactory:
    from worker.temporal_client import connect

    return lambda: connect(settings, identity="fleetmend-webhook")


def _include_effects_api(app: FastAPI, settings: Settings) -> None:
    """Mount the effect-ledger query API when that module is installed."""
    if importlib.util.find_spec("worker.webhook.effects_api") is None:
        return
    module = importlib.import_module("worker.webhook.effects_api")
    router = module.create_router(settings) if hasattr(module, "create_router") else module.router
    app.include_router(router)


def serve(settings: Settings) -> None:
    """Run the webhook API with uvicorn on ``webhook_host:webhook_port`` until interrupted."""
    import uvicorn

    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.webhook_host,
        port=settings.webhook_port,
        log_config=None,
    )
