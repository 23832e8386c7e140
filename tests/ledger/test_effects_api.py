"""The inference effect API over real HTTP, against the real simulator's ticket and notify endpoints."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from activities.effects import TicketCreate, TicketParams, default_registry
from ledger import Attempt, EffectLedger
from ledger.reconcile import reconcile, world_actions_from_sim
from sim.runner import RunningSim, start_sim
from sim.scenario import shipped_scenarios
from tests.ledger.world import SimulatedCrash
from worker.webhook.effects_api import effects_router


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


@pytest.fixture
def api(sim: RunningSim, ledger: EffectLedger) -> Iterator[httpx.Client]:
    http = httpx.Client(timeout=5)
    registry = default_registry(http, tickets_url=sim.base_url, notifier_url=f"{sim.base_url}/sim/v1/notify")
    app = FastAPI()
    app.include_router(effects_router(lambda: ledger, registry))
    served = ServedApp(app)
    with httpx.Client(base_url=served.base_url, timeout=30) as client:
        yield client
    served.stop()
    http.close()


TICKET = {
    "operation_id": "req-17/0",
    "kind": "ticket.create",
    "target": "sim-tickets",
    "params": {"title": "inference request req-17", "body": "proposed by req-17"},
}


def tickets(sim_http: httpx.Client, key: str | None = None) -> list[dict[str, Any]]:
    params = {"idempotency_key": key} if key else {}
    return list(sim_http.get("/sim/v1/tickets", params=params).json())


def ticket_posts(sim_http: httpx.Client) -> list[dict[str, Any]]:
    return [
        a
        for a in sim_http.get("/sim/v1/actions").json()
        if a["verb"] == "POST" and a["path"] == "/sim/v1/tickets"
    ]


def test_first_call_and_every_repeat_get_the_same_answer_and_one_ticket(
    api: httpx.Client, sim_http: httpx.Client
) -> None:
    first = api.post("/v1/effects", json=TICKET)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["state"] == "applied" and body["replayed"] is False and body["request_id"] == "req-17"
    ticket = body["result"]["ticket"]
    assert ticket["idempotency_key"] == "req-17/0"

    for _ in range(3):
        again = api.post("/v1/effects", json=TICKET)
        assert again.status_code == 200
        assert again.json()["result"] == body["result"] and again.json()["replayed"] is True
    assert tickets(sim_http, "req-17/0") == [ticket]
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
                CrashAfterPost(http, sim.base_url, params),
            )
        time.sleep(0.3)
        outcome = ledger.perform(
            "wf/ticket/gpu-node-2",
            "ticket.create",
            "oncall",
            params,
            TicketCreate(http, sim.base_url, params),
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
    sim_http.post("/sim/v1/tickets", json={"title": "opened by hand"})
    report = reconcile(
        ledger.engine,
        world=world,
        actions=world_actions_from_sim(world, sim_http.get("/sim/v1/actions").json()),
    )
    assert [(o.verb, o.path) for o in report.orphans] == [
        ("POST", "/sim/v1/tickets")
    ] and report.duplicates == []
