"""Effects the simulated model proposes carry the request's operation id (also when the request is
sent again to another replica, as a gateway's retry does); notify sink and the simulated Jira."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request

from tests.sim.serving_fixtures import NAMESPACE, running_serving, scenario
from tests.sim.support import MODEL, SLOW, read_sse


@contextlib.asynccontextmanager
async def effect_recorder() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A stand-in for fleetmend's ``POST /v1/effects`` (the ledger's endpoint is tested in its own issue)."""
    calls: list[dict[str, Any]] = []
    app = FastAPI()

    @app.post("/v1/effects")
    async def effects(body: dict[str, Any], request: Request) -> dict[str, Any]:
        calls.append({**body, "authorization": request.headers.get("authorization")})
        return {"operation_id": body["operation_id"], "state": "applied"}

    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/effects", calls
    finally:
        server.should_exit = True
        await task


async def test_a_request_sent_again_to_another_replica_proposes_its_effect_under_the_same_operation_id() -> (
    None
):
    async with effect_recorder() as (url, calls), running_serving(scenario(load=SLOW), speed=10) as sim:
        first, second = await sim.wait_serving(2)
        bad = await sim.http.put("/sim/v1/serving/effects", json={"url": "ftp://x", "share": 1.0})
        assert bad.status_code == 422
        ok = await sim.http.put(
            "/sim/v1/serving/effects", json={"url": url, "share": 1.0, "token": "effects-secret"}
        )
        assert ok.status_code == 200 and ok.json()["token"] is None and ok.json()["token_set"] is True
        shown = (await sim.http.get("/sim/v1/serving/effects")).json()
        assert shown["token"] is None and shown["token_set"] is True  # the token is write-only
        assert (await sim.fault("wedged-engine", f"{NAMESPACE}/{first}")).status_code == 202
        body = {"model": MODEL, "max_tokens": 4, "stream": True}
        headers = {"x-request-id": "fx-1"}

        async def call(pod: str) -> tuple[int, list[dict[str, Any]], bool]:
            url = sim.pod_url(pod) + "/v1/completions"
            async with sim.http.stream("POST", url, json=body, headers=headers) as response:
                return await read_sse(response.aiter_lines())

        # The wedged replica takes the request and proposes its effect; its process then dies before a
        # token, and the request goes to the other replica, as a gateway retries it, under the same id.
        task = asyncio.create_task(call(first))
        await sim.wait_for(lambda: len(calls) == 1, 30, "the first proposal")
        assert (await sim.fault("pod-oomkilled", f"{NAMESPACE}/{first}")).status_code == 202
        try:
            await asyncio.wait_for(task, 30)
        except httpx.HTTPError:
            pass  # the dead process cut the connection
        tokens, errors, done = await call(second)
        assert done and not errors and tokens == 4
        assert [c["operation_id"] for c in calls] == ["fx-1/0", "fx-1/0"]
        assert calls[0] == calls[1]  # same parameters: the ledger sees a repeat, not a divergence
        assert calls[0]["authorization"] == "Bearer effects-secret"  # fleetmend's effect API token
        assert sim.layer.effects.answers["fx-1/0"]["body"]["state"] == "applied"


async def test_notify_sink_and_the_jira_issue_api() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        r = await sim.http.post("/sim/v1/notify", json={"text": "replica lost", "blocks": []})
        assert r.status_code == 200 and r.text == "ok"
        assert [m["text"] for m in (await sim.http.get("/sim/v1/notify")).json()] == ["replica lost"]
        assert (await sim.http.post("/sim/v1/notify", json={"txt": "typo"})).status_code == 422

        auth = {"Authorization": "Bearer any-token"}
        fields = {
            "project": {"key": "OPS"},
            "issuetype": {"name": "Task"},
            "summary": "node gpu-node-0 quarantined",
            "description": "Xid 79",
            "labels": ["fleetmend", "fleetmend-op-1"],
        }
        assert (await sim.http.post("/rest/api/2/issue", json={"fields": fields})).status_code == 401
        created = await sim.http.post("/rest/api/2/issue", json={"fields": fields}, headers=auth)
        assert created.status_code == 201 and created.json()["key"] == "OPS-1"
        assert created.json()["self"].endswith(f"/rest/api/2/issue/{created.json()['id']}")
        # Like Jira, no idempotency key: the same create again is a second issue (the ledger's job to prevent).
        again = await sim.http.post("/rest/api/2/issue", json={"fields": fields}, headers=auth)
        assert again.status_code == 201 and again.json()["key"] == "OPS-2"
        missing = await sim.http.post(
            "/rest/api/2/issue", json={"fields": {**fields, "summary": ""}}, headers=auth
        )
        assert missing.status_code == 400 and "summary" in missing.json()["errors"]
        one = await sim.http.get("/rest/api/2/issue/OPS-1", headers=auth)
        assert one.json()["fields"]["description"] == "Xid 79"
        assert (await sim.http.get("/rest/api/2/issue/OPS-9", headers=auth)).status_code == 404
        # JQL on project and labels, on both searches (Data Center's and Cloud's).
        jql = 'project = "OPS" AND labels = "fleetmend-op-1"'
        dc = (await sim.http.get("/rest/api/2/search", params={"jql": jql}, headers=auth)).json()
        assert dc["total"] == 2 and [i["key"] for i in dc["issues"]] == ["OPS-1", "OPS-2"]
        cloud = await sim.http.get("/rest/api/2/search/jql", params={"jql": 'labels = "other"'}, headers=auth)
        assert cloud.json() == {"issues": [], "isLast": True}
        bad = await sim.http.get("/rest/api/2/search", params={"jql": "summary ~ gpu"}, headers=auth)
        assert bad.status_code == 400 and "not supported" in bad.json()["errorMessages"][0]
        # Every POST reached the world's action log (the independent evidence the ledger is audited against).
        actions = (await sim.http.get("/sim/v1/actions")).json()
        assert sum(1 for a in actions if a["path"] == "/rest/api/2/issue" and a["verb"] == "POST") == 4
