"""The inference effect API over real HTTP, against the real simulator's ticket and notify endpoints.

Every route but the health checks needs its own bearer token: ``FLEETMEND_EFFECTS_TOKEN`` for
``POST /v1/effects``, ``FLEETMEND_LEDGER_TOKEN`` for the audit routes.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr

from activities.effects import TicketCreate, TicketParams, default_registry
from ledger import Attempt, EffectLedger
from ledger.reconcile import reconcile, world_actions_from_sim
from sim.runner import RunningSim, start_sim
from sim.scenario import shipped_scenarios
from tests.ledger.world import SimulatedCrash
from tests.sim.serving_fixtures import running_serving, scenario
from tests.support import JIRA_ISSUE_PATH, jira_issues, open_issue_by_hand, sim_jira
from worker.config import Settings
from worker.webhook.app import create_app
from worker.webhook.effects_api import effects_router

EFFECTS_TOKEN = secrets.token_hex(16)
LEDGER_TOKEN = secrets.token_hex(16)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # what the serving fixtures' scenario serves


class TokenPerRoute(httpx.Auth):
    """What a well-configured caller sends: the effect API's token to /v1, the ledger's to /ledger."""

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = LEDGER_TOKEN if request.url.path.startswith("/ledger") else EFFECTS_TOKEN
        request.headers["Authorization"] = f"Bearer {token}"
        yield request


@pytest.fixture
def sim() -> Iterator[RunningSim]:
    running = start_sim(shipped_scenarios()["gpu-node-loss"], speed=10.0)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def sim_http(sim: RunningSim) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim.base_url, timeout=10) as client:
        yield client


class ServedApp:
    def __init__(self, app: FastAPI) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "API did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def served_effects_api(
    sim_base_url: str,
    ledger: EffectLedger,
    effects_token: str | None = EFFECTS_TOKEN,
    ledger_token: str | None = LEDGER_TOKEN,
) -> tuple[ServedApp, httpx.Client]:
    http = httpx.Client(timeout=5)
    registry = default_registry(
        http, tickets=sim_jira(sim_base_url), notifier_url=f"{sim_base_url}/sim/v1/notify"
    )
    app = FastAPI()
    app.include_router(
        effects_router(
            lambda: ledger,
            registry,
            effects_token=SecretStr(effects_token) if effects_token else None,
            ledger_token=SecretStr(ledger_token) if ledger_token else None,
        )
    )
    return ServedApp(app), http


@pytest.fixture
def served_api(sim: RunningSim, ledger: EffectLedger) -> Iterator[ServedApp]:
    served, http = served_effects_api(sim.base_url, ledger)
    yield served
    served.stop()
    http.close()


@pytest.fixture
def api(served_api: ServedApp) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served_api.base_url, timeout=30, auth=TokenPerRoute()) as client:
        yield client


@pytest.fixture
def anonymous(served_api: ServedApp) -> Iterator[httpx.Client]:
    """A client of the same API that sends whatever Authorization a test gives it."""
    with httpx.Client(base_url=served_api.base_url, timeout=30) as client:
        yield client


TICKET = {
    "operation_id": "req-17/0",
    "kind": "ticket.create",
    "target": "jira",
    "params": {"title": "inference request req-17", "body": "proposed by req-17"},
}


def tickets(sim_http: httpx.Client, op_id: str | None = None) -> list[dict[str, Any]]:
    return jira_issues(sim_http, op_id=op_id)


def ticket_posts(sim_http: httpx.Client) -> list[dict[str, Any]]:
    return [
        a
        for a in sim_http.get("/sim/v1/actions").json()
        if a["verb"] == "POST" and a["path"] == JIRA_ISSUE_PATH
    ]


def test_first_call_and_every_repeat_get_the_same_answer_and_one_ticket(
    api: httpx.Client, sim_http: httpx.Client
) -> None:
    first = api.post("/v1/effects", json=TICKET)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["state"] == "applied" and body["replayed"] is False and body["request_id"] == "req-17"
    ticket = body["result"]["ticket"]
    assert ticket["key"].startswith("OPS-")

    for _ in range(3):
        again = api.post("/v1/effects", json=TICKET)
        assert again.status_code == 200
        assert again.json()["result"] == body["result"] and again.json()["replayed"] is True
    (issue,) = tickets(sim_http, "req-17/0")
    assert issue["key"] == ticket["key"] and issue["fields"]["summary"] == "inference request req-17"
    assert "req-17/0" in issue["fields"]["description"]  # the operation, for whoever reads the issue
    posts = ticket_posts(sim_http)
    assert len(posts) == 1  # the world saw one request, not four
    assert posts[0]["body_digest"] == body["action_signature"]["body_digest"]


def test_divergent_params_get_409_with_the_original_outcome(
    api: httpx.Client, sim_http: httpx.Client
) -> None:
    original = api.post("/v1/effects", json=TICKET).json()
    divergent = api.post("/v1/effects", json={**TICKET, "params": {"title": "a different proposal"}})
    assert divergent.status_code == 409
    answer = divergent.json()
    assert answer["original"]["result"] == original["result"] and "different parameters" in answer["detail"]
    assert len(tickets(sim_http)) == 1 and len(ticket_posts(sim_http)) == 1
    detail = api.get("/ledger/effects/req-17/0").json()
    assert [d["params"] for d in detail["divergences"]] == [{"title": "a different proposal", "body": ""}]


def test_unknown_kind_and_bad_params_are_422_and_record_nothing(
    api: httpx.Client, sim_http: httpx.Client
) -> None:
    unknown = api.post("/v1/effects", json={**TICKET, "kind": "http.get", "operation_id": "req-1/0"})
    assert unknown.status_code == 422 and "registered kinds: notify.post, ticket.create" in unknown.text
    bad = api.post("/v1/effects", json={**TICKET, "params": {"title": ""}, "operation_id": "req-2/0"})
    assert bad.status_code == 422 and "title" in bad.text
    extra = api.post("/v1/effects", json={**TICKET, "url": "http://evil", "operation_id": "req-3/0"})
    assert extra.status_code == 422
    for op in ("req-1/0", "req-2/0", "req-3/0"):
        assert api.get(f"/ledger/effects/{op}").status_code == 404
    assert tickets(sim_http) == []


def test_concurrent_repeats_over_http_create_one_ticket(api: httpx.Client, sim_http: httpx.Client) -> None:
    def propose(_: int) -> httpx.Response:
        # The API's contract: 503 + Retry-After means "repeat the same request" (e.g. still in progress).
        for _attempt in range(20):
            answer = api.post("/v1/effects", json=TICKET)
            if answer.status_code != 503:
                return answer
            time.sleep(float(answer.headers["Retry-After"]))
        return answer

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(propose, range(16)))
    assert {a.status_code for a in answers} == {200}, [a.text for a in answers if a.status_code != 200][:2]
    assert len({a.json()["result"]["ticket"]["id"] for a in answers}) == 1
    assert len(tickets(sim_http)) == 1 and len(ticket_posts(sim_http)) == 1


def test_notify_is_declared_at_least_once_and_audit_shows_it(
    api: httpx.Client, sim_http: httpx.Client
) -> None:
    posted = api.post(
        "/v1/effects",
        json={
            "operation_id": "req-5/1",
            "kind": "notify.post",
            "target": "#incident",
            "params": {"text": "replica lost; replacement ETA 9 min"},
        },
    )
    assert posted.status_code == 200 and posted.json()["delivery"] == "at_least_once"
    assert [m["text"] for m in sim_http.get("/sim/v1/notify").json()] == [
        "replica lost; replacement ETA 9 min"
    ]
    listed = api.get("/ledger/effects", params={"kind": "notify.post"}).json()
    assert [(i["op_id"], i["delivery"]) for i in listed["items"]] == [("req-5/1", "at_least_once")]


def test_audit_over_http_filters_and_pages(api: httpx.Client) -> None:
    for i in range(5):
        assert api.post("/v1/effects", json={**TICKET, "operation_id": f"req-{i}/0"}).status_code == 200
    page = api.get("/ledger/effects", params={"limit": 2}).json()
    ops = [i["op_id"] for i in page["items"]]
    while page["next_cursor"]:
        page = api.get("/ledger/effects", params={"limit": 2, "cursor": page["next_cursor"]}).json()
        ops += [i["op_id"] for i in page["items"]]
    assert sorted(ops) == [f"req-{i}/0" for i in range(5)]
    assert api.get("/ledger/effects", params={"request_id": "req-3"}).json()["items"][0]["op_id"] == "req-3/0"
    assert api.get("/ledger/effects", params={"state": "bogus"}).status_code == 422
    assert api.get("/ledger/effects", params={"since": "2026-01-01T00:00:00"}).status_code == 422  # no zone
    assert api.get("/ledger/effects", params={"cursor": "garbage"}).status_code == 422


def test_ticket_landed_before_a_crash_is_found_by_probe_not_reposted(
    sim: RunningSim, sim_http: httpx.Client, ledger: EffectLedger, make_ledger: Any
) -> None:
    class CrashAfterPost(TicketCreate):
        def apply(self, attempt: Attempt) -> dict[str, Any]:
            super().apply(attempt)
            raise SimulatedCrash("worker died before recording")

    params = TicketParams(title="GPU node lost", body="gpu-node-2 NotReady")
    with httpx.Client(timeout=5) as http:
        crashed = make_ledger(owner="crashed", lease_seconds=0.2)
        with pytest.raises(SimulatedCrash):
            crashed.perform(
                "wf/ticket/gpu-node-2",
                "ticket.create",
                "oncall",
                params,
                CrashAfterPost(http, sim_jira(sim.base_url), params),
            )
        time.sleep(0.3)
        outcome = ledger.perform(
            "wf/ticket/gpu-node-2",
            "ticket.create",
            "oncall",
            params,
            TicketCreate(http, sim_jira(sim.base_url), params),
        )
    assert outcome.state == "applied" and outcome.replayed and outcome.fence == 2
    assert len(tickets(sim_http, "wf/ticket/gpu-node-2")) == 1 and len(ticket_posts(sim_http)) == 1

    # The sim's own action log agrees with the ledger; a ticket opened behind the ledger's back is an orphan.
    world = sim.base_url.split("//", 1)[1]
    assert reconcile(
        ledger.engine,
        world=world,
        actions=world_actions_from_sim(world, sim_http.get("/sim/v1/actions").json()),
    ).clean
    assert open_issue_by_hand(sim_http, "", "opened by hand").status_code == 201
    report = reconcile(
        ledger.engine,
        world=world,
        actions=world_actions_from_sim(world, sim_http.get("/sim/v1/actions").json()),
    )
    assert [(o.verb, o.path) for o in report.orphans] == [
        ("POST", JIRA_ISSUE_PATH)
    ] and report.duplicates == []


# -- authentication and the reserved operation-id namespace ----------------------------------------


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(
    ("headers", "case"),
    [
        ({}, "no Authorization header"),
        (bearer("not-the-token"), "wrong token"),
        (bearer(EFFECTS_TOKEN[:-1]), "token missing its last character"),
        (bearer(LEDGER_TOKEN), "the ledger's token"),
        ({"Authorization": f"Basic {EFFECTS_TOKEN}"}, "wrong scheme"),
    ],
)
def test_an_effect_without_the_effects_token_is_401_and_performs_nothing(
    anonymous: httpx.Client,
    api: httpx.Client,
    sim_http: httpx.Client,
    ledger: EffectLedger,
    headers: dict[str, str],
    case: str,
) -> None:
    refused = anonymous.post("/v1/effects", json=TICKET, headers=headers)

    assert refused.status_code == 401, case
    assert refused.headers["www-authenticate"] == "Bearer"
    assert "FLEETMEND_EFFECTS_TOKEN" in refused.json()["detail"]
    assert ledger.get(TICKET["operation_id"]) is None
    assert tickets(sim_http) == [] and ticket_posts(sim_http) == []
    # The same request with the token is performed: the refusal was about the credential only.
    assert api.post("/v1/effects", json=TICKET).status_code == 200


def test_an_unauthenticated_effect_with_a_bad_body_is_401_not_422(anonymous: httpx.Client) -> None:
    """Nothing about the API's validation is told to a caller without the token."""
    assert anonymous.post("/v1/effects", json={"nonsense": True}).status_code == 401


@pytest.mark.parametrize(
    ("headers", "case"),
    [
        ({}, "no Authorization header"),
        (bearer("not-the-token"), "wrong token"),
        (bearer(EFFECTS_TOKEN), "the effect API's token"),
    ],
)
def test_the_audit_routes_without_the_ledger_token_are_401(
    anonymous: httpx.Client, api: httpx.Client, headers: dict[str, str], case: str
) -> None:
    assert api.post("/v1/effects", json=TICKET).status_code == 200
    for path in ("/ledger/effects", f"/ledger/effects/{TICKET['operation_id']}"):
        refused = anonymous.get(path, headers=headers)
        assert refused.status_code == 401, (path, case)
        assert refused.headers["www-authenticate"] == "Bearer"
        assert "FLEETMEND_LEDGER_TOKEN" in refused.json()["detail"]
        assert "req-17" not in refused.text  # nothing of the ledger leaks into the refusal
        assert api.get(path).status_code == 200


@pytest.mark.parametrize(
    "operation_id",
    [
        "fleetmend:incident/inference/llama@0f1e/recovery/deroute/pod/inference/llama-abc12",
        "fleetmend:anything",
        "FLEETMEND:incident/inference/llama@0f1e/promote",  # looks the same in an audit listing
        " fleetmend:incident/x",
    ],
)
def test_an_operation_id_of_fleetmends_own_procedures_is_403_and_leaves_no_row(
    api: httpx.Client, sim_http: httpx.Client, ledger: EffectLedger, operation_id: str
) -> None:
    claim = api.post("/v1/effects", json={**TICKET, "operation_id": operation_id})

    assert claim.status_code == 403, claim.text
    detail = claim.json()["detail"]
    assert "reserved for fleetmend's own procedures" in detail and "nothing was recorded" in detail
    assert "<request id>/<effect slot>" in detail  # what to use instead
    assert ledger.get(operation_id) is None
    assert api.get("/ledger/effects").json()["items"] == []
    assert tickets(sim_http) == [] and ticket_posts(sim_http) == []


def test_an_id_that_only_contains_the_prefix_is_the_callers_own(api: httpx.Client) -> None:
    answer = api.post("/v1/effects", json={**TICKET, "operation_id": "req-9/fleetmend:0"})
    assert answer.status_code == 200 and answer.json()["state"] == "applied"


def test_routes_whose_token_is_not_configured_refuse_and_say_which_setting(
    sim: RunningSim, ledger: EffectLedger
) -> None:
    served, http = served_effects_api(sim.base_url, ledger, effects_token=None, ledger_token=None)
    try:
        with httpx.Client(base_url=served.base_url, timeout=30) as client:
            for headers in ({}, bearer(EFFECTS_TOKEN), {"Authorization": "Bearer"}):
                effect = client.post("/v1/effects", json=TICKET, headers=headers)
                audit = client.get("/ledger/effects", headers=headers)
                assert effect.status_code == 503 and "FLEETMEND_EFFECTS_TOKEN is not set" in effect.text
                assert audit.status_code == 503 and "FLEETMEND_LEDGER_TOKEN is not set" in audit.text
    finally:
        served.stop()
        http.close()
    assert ledger.get(TICKET["operation_id"]) is None


OPEN_PATHS = {"/healthz", "/readyz", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}


def test_every_route_of_the_worker_api_but_health_metrics_and_docs_needs_a_token(ledger_url: str) -> None:
    """The app as ``fleetmend webhook`` serves it: a route added later without a token fails here."""
    settings = Settings(
        webhook_token=SecretStr("w-" + secrets.token_hex(8)),
        effects_token=SecretStr(EFFECTS_TOKEN),
        ledger_token=SecretStr(LEDGER_TOKEN),
        database_url=SecretStr(ledger_url),
        tickets_url="http://127.0.0.1:9",
        tickets_token=SecretStr("jira-token"),
    )
    app = create_app(settings)
    served = ServedApp(app)
    try:
        with httpx.Client(base_url=served.base_url, timeout=30) as client:
            checked = []
            for path, operations in app.openapi()["paths"].items():
                if path in OPEN_PATHS:
                    continue
                concrete = path.replace("{op_id}", "req-1/0")
                for method in sorted(m.upper() for m in operations):
                    answer = client.request(method, concrete, json={})
                    assert answer.status_code == 401, (method, path, answer.status_code)
                    assert answer.headers["www-authenticate"] == "Bearer"
                    checked.append(f"{method} {path}")
            assert client.get("/healthz").status_code == 200
    finally:
        served.stop()
    assert sorted(checked) == [
        "GET /ledger/effects",
        "GET /ledger/effects/{op_id}",
        "POST /alerts/alertmanager",
        "POST /v1/effects",
    ]


async def test_the_simulated_model_proposes_effects_with_the_effects_token(ledger: EffectLedger) -> None:
    """sim/serving's engines post their requests' proposed effects to the real effect API: with the
    token they are performed once; without it (misconfigured) they are refused and nothing is recorded."""
    async with running_serving(scenario(), speed=10) as sim:
        served, http = served_effects_api(sim.base_url, ledger)
        try:
            (pod, *_) = await sim.wait_serving(1)
            for token, request_id in ((EFFECTS_TOKEN, "gw-1"), (None, "gw-2"), ("wrong", "gw-3")):
                config = {"url": f"{served.base_url}/v1/effects", "share": 1.0, "kind": "ticket.create"}
                if token:
                    config["token"] = token
                assert (await sim.http.put("/sim/v1/serving/effects", json=config)).status_code == 200
                body = {"model": MODEL, "max_tokens": 2, "request_id": request_id}
                completed = await sim.http.post(sim.pod_url(pod) + "/v1/completions", json=body)
                assert completed.status_code == 200, completed.text
        finally:
            served.stop()
            http.close()
        answers = sim.layer.effects.answers
    assert answers["gw-1/0"]["status"] == 200 and answers["gw-1/0"]["body"]["state"] == "applied"
    assert answers["gw-2/0"]["status"] == 401 and answers["gw-3/0"]["status"] == 401
    recorded = ledger.get("gw-1/0")
    assert recorded is not None and recorded.request_id == "gw-1"
    assert ledger.get("gw-2/0") is None and ledger.get("gw-3/0") is None
