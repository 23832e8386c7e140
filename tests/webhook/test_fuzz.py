"""Fuzzing the alert endpoint: thousands of unauthenticated, malformed, invalid and oversized
requests over real HTTP. None may get a 5xx (Alertmanager would retry garbage forever) and
none may start or signal a workflow — checked against the real Temporal dev server.

Every generated request is built around one *valid* notification for a routed alert, so a
request that slipped through would really start ``incident/llm/<pool>``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from tests.support import (
    ServedWebhook,
    pool_alert_labels,
    serve_webhook,
    webhook_settings,
    workflow_ids,
)
from worker.intake.rules import AlertRules
from worker.webhook.app import create_app
from worker.webhook.examples import alert, notification

BODY_LIMIT = 4096
FUZZ_POOL = f"fuzz-{secrets.token_hex(4)}"
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Header values httpx can send: printable ASCII.
header_text = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=25,
)
not_a_string = st.none() | st.booleans() | st.integers() | st.lists(json_scalars, max_size=3) | st.just({})


def valid_payload() -> dict[str, Any]:
    return notification([alert(pool_alert_labels("llm", FUZZ_POOL, replica_group=f"{FUZZ_POOL}-0"))])


@pytest.fixture(scope="module")
def fuzz_target(temporal_env: WorkflowEnvironment, pool_rules: AlertRules) -> Iterator[ServedWebhook]:
    token = secrets.token_urlsafe(32)
    task_queue = f"fuzz-{secrets.token_hex(6)}"
    cfg = webhook_settings(temporal_env, task_queue, token, webhook_max_body_bytes=BODY_LIMIT)
    app = create_app(cfg, rules=pool_rules)
    with serve_webhook(app, cfg) as base_url:
        yield ServedWebhook(app, base_url, token, cfg)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


def send(http: httpx.Client, target: ServedWebhook, body: bytes, headers: dict[str, str]) -> httpx.Response:
    response = http.post(target.url, content=body, headers=headers)
    assert response.status_code < 500, (response.status_code, response.text[:300])
    assert response.status_code != 200, f"accepted a request that must be refused: {body[:200]!r}"
    return response


@st.composite
def wrong_authorization(draw: st.DrawFn, token: str) -> dict[str, str]:
    kind = draw(st.sampled_from(["none", "bearer", "basic", "raw", "near-miss"]))
    if kind == "none":
        return {}
    if kind == "near-miss":  # the token with one character changed, dropped or added
        i = draw(st.integers(0, len(token) - 1))
        op = draw(st.sampled_from(["change", "drop", "add"]))
        ch = draw(st.sampled_from("abcXYZ019-_"))
        guess = (
            token[:i] + ch + token[i + 1 :]
            if op == "change"
            else token[:i] + token[i + 1 :]
            if op == "drop"
            else token[:i] + ch + token[i:]
        )
        if guess == token:
            guess += "x"
        return {"Authorization": f"Bearer {guess}"}
    value = draw(header_text)
    if kind == "bearer":
        value = f"Bearer {value}"
    elif kind == "basic":
        value = f"Basic {value}"
    if value.partition(" ")[2].strip() == token:
        value += "x"
    return {"Authorization": value.strip() or "x"}


@given(data=st.data())
@settings(FUZZ, max_examples=700)
def test_unauthenticated_requests_are_always_401(
    fuzz_target: ServedWebhook, http: httpx.Client, data: st.DataObject
) -> None:
    headers = data.draw(wrong_authorization(fuzz_target.token))
    body = data.draw(
        st.sampled_from([json.dumps(valid_payload()).encode()]) | st.binary(max_size=2 * BODY_LIMIT)
    )
    assert send(http, fuzz_target, body, headers).status_code == 401


@given(body=st.binary(max_size=BODY_LIMIT) | json_values.map(lambda v: json.dumps(v).encode()))
@settings(FUZZ, max_examples=700)
def test_arbitrary_bytes_and_json_are_4xx(
    fuzz_target: ServedWebhook, http: httpx.Client, body: bytes
) -> None:
    assert send(http, fuzz_target, body, fuzz_target.auth).status_code in (400, 413, 422)


REQUIRED_TOP = ["version", "status", "receiver", "alerts"]
REQUIRED_ALERT = ["status", "labels", "startsAt", "fingerprint"]


@st.composite
def invalid_payloads(draw: st.DrawFn) -> dict[str, Any]:
    """A valid notification with one change that makes it invalid."""
    payload = valid_payload()
    first = payload["alerts"][0]
    mutation = draw(
        st.sampled_from(
            [
                "drop-top",
                "drop-alert-field",
                "version",
                "top-status",
                "alert-status",
                "starts-at",
                "fingerprint",
                "label-value",
                "labels-type",
                "alerts-type",
                "alert-type",
                "receiver-type",
            ]
        )
    )
    if mutation == "drop-top":
        del payload[draw(st.sampled_from(REQUIRED_TOP))]
    elif mutation == "drop-alert-field":
        del first[draw(st.sampled_from(REQUIRED_ALERT))]
    elif mutation == "version":
        payload["version"] = draw(json_values.filter(lambda v: v != "4"))
    elif mutation == "top-status":
        payload["status"] = draw(json_values.filter(lambda v: v not in ("firing", "resolved")))
    elif mutation == "alert-status":
        first["status"] = draw(json_values.filter(lambda v: v not in ("firing", "resolved")))
    elif mutation == "starts-at":
        first["startsAt"] = draw(
            st.none() | st.lists(json_scalars, max_size=2) | st.just({}) | st.just("yesterday")
        )
    elif mutation == "fingerprint":
        first["fingerprint"] = draw(
            st.just("")
            | st.text(min_size=65, max_size=80, alphabet="abcdef0123456789")
            | st.text(min_size=1, max_size=20).filter(
                lambda s: any(not (c.isascii() and (c.isalnum() or c in "._:-")) for c in s)
            )
            | not_a_string
        )
    elif mutation == "label-value":
        first["labels"][draw(st.sampled_from(sorted(first["labels"])))] = draw(not_a_string)
    elif mutation == "labels-type":
        first["labels"] = draw(not_a_string.filter(lambda v: v != {}))
    elif mutation == "alerts-type":
        payload["alerts"] = draw(json_scalars | st.just({}))
    elif mutation == "alert-type":
        payload["alerts"][0] = draw(json_scalars | st.lists(json_scalars, max_size=2))
    else:
        payload["receiver"] = draw(not_a_string)
    return payload


@given(payload=invalid_payloads())
@settings(FUZZ, max_examples=1000)
def test_invalid_fields_are_422_never_a_workflow(
    fuzz_target: ServedWebhook, http: httpx.Client, payload: dict[str, Any]
) -> None:
    response = send(http, fuzz_target, json.dumps(payload).encode(), fuzz_target.auth)
    assert response.status_code == 422, response.text
    assert response.json()["message"]


@given(padding=st.integers(BODY_LIMIT + 1, 8 * BODY_LIMIT), streamed=st.booleans(), garbage=st.booleans())
@settings(FUZZ, max_examples=300)
def test_oversized_bodies_are_413(
    fuzz_target: ServedWebhook, http: httpx.Client, padding: int, streamed: bool, garbage: bool
) -> None:
    payload = valid_payload()
    payload["alerts"][0]["annotations"]["description"] = "x" * padding
    body = b"\x00" * padding if garbage else json.dumps(payload).encode()
    if streamed:  # chunked, no Content-Length: the limit must hold while reading
        response = http.post(
            fuzz_target.url,
            content=iter([body[i : i + 1024] for i in range(0, len(body), 1024)]),
            headers=fuzz_target.auth,
        )
    else:
        response = http.post(fuzz_target.url, content=body, headers=fuzz_target.auth)
    assert response.status_code == 413


async def test_after_the_fuzzing_no_workflow_exists_and_no_signal_was_sent(
    fuzz_target: ServedWebhook, temporal_client: Client
) -> None:
    rejected = sum(
        fuzz_target.metric("fleetmend_webhook_requests_rejected_total", reason=r)
        for r in ("unauthorized", "too-large", "malformed-json", "invalid-payload", "unsupported-version")
    )
    assert rejected >= 2700  # the four fuzz tests above really ran
    assert fuzz_target.metric("fleetmend_incident_signals_sent_total", mode="signal-with-start") == 0
    assert fuzz_target.metric("fleetmend_alerts_received_total", status="firing") == 0
    assert await workflow_ids(temporal_client, f'TaskQueue = "{fuzz_target.settings.task_queue}"') == []
    with pytest.raises(RPCError) as err:
        await temporal_client.get_workflow_handle(f"incident/llm/{FUZZ_POOL}").describe()
    assert err.value.status == RPCStatusCode.NOT_FOUND
