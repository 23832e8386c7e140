"""The gateway's in-flight contract, admission and admin API, over real HTTP (SSE via httpx)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from sim.serving.engine import EngineRefused, EngineRequest
from sim.serving.router import admission_draw
from tests.sim.serving_fixtures import NAMESPACE, POOL, RunningServing, running_serving, scenario

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Slow sequences (2 tokens/s) so a test can act while a stream is open.
SLOW = {"engine": {"max_tokens_per_seq_s": 2.0}}


class _NullSink:
    def on_tokens(self, count: int, now: float) -> None: ...
    def on_finished(self, reason: str, now: float) -> None: ...
    def on_aborted(self, reason: str, now: float) -> None: ...


async def read_sse(response: httpx.Response) -> tuple[int, list[dict[str, Any]], bool]:
    """(tokens, error events, saw [DONE]) of a streamed completion."""
    tokens, errors, done = 0, [], False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        event = json.loads(line[6:])
        if "error" in event:
            errors.append(event["error"])
        else:
            tokens += event["choices"][0]["text"].count(" tok")
    return tokens, errors, done


async def journal(sim: RunningServing, **params: Any) -> list[dict[str, Any]]:
    r = await sim.http.get("/router/v1/journal", params=params)
    r.raise_for_status()
    return list(r.json()["entries"])


async def test_a_stream_cut_after_its_first_token_ends_with_a_terminal_error_and_is_never_retried() -> None:
    async with running_serving(scenario(load=SLOW), speed=10) as sim:
        await sim.wait_serving(2)
        body = {"model": MODEL, "max_tokens": 32, "stream": True, "request_id": "cut-1", "deadline_s": 120}
        async with sim.http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            replica = response.headers["x-fleetmend-replica"]
            lines = response.aiter_lines()
            first = await anext(lines)
            assert " tok" in first  # a token reached the caller
            fault = await sim.fault("pod-oomkilled", f"{NAMESPACE}/{replica}")
            assert fault.status_code == 202, fault.text
            tokens = 1
            errors: list[dict[str, Any]] = []
            done = False
            async for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        errors.append(event["error"])
                    else:
                        tokens += 1
        assert not done, "a cut stream must not end as if it completed"
        assert len(errors) == 1 and errors[0]["type"] == "terminal_stream_error"
        entries = await journal(sim, pool=POOL, request_id="cut-1")
        assert [e["outcome"] for e in entries] == ["terminal_error"]
        (entry,) = entries
        assert entry["replica"] == replica and entry["attempt"] == 1
        assert entry["truncated"] is True and 1 <= entry["tokens_streamed"] < 32
        assert entry["ttft_s"] is not None
        # queryable per replica and per time window
        by_replica = await journal(sim, replica=replica, since=entry["ended_at"], until=entry["ended_at"])
        assert [e["request_id"] for e in by_replica] == ["cut-1"]


async def test_a_request_that_streamed_nothing_is_retried_once_on_a_survivor() -> None:
    async with running_serving(scenario(load=SLOW), speed=10) as sim:
        first, second = await sim.wait_serving(2)
        # Route (almost) everything to `first`, and wedge it so the request waits there without a token.
        await sim.set_state("weights", "weights", {first: 1.0, second: 1e-9})
        assert (await sim.fault("wedged-engine", f"{NAMESPACE}/{first}")).status_code == 202
        body = {"model": MODEL, "max_tokens": 4, "stream": True, "request_id": "retry-1", "deadline_s": 120}

        async def call() -> tuple[int, str, str, tuple[int, list[dict[str, Any]], bool]]:
            async with sim.http.stream("POST", "/v1/completions", json=body) as response:
                return (
                    response.status_code,
                    response.headers["x-fleetmend-replica"],
                    response.headers["x-fleetmend-attempt"],
                    await read_sse(response),
                )

        task = asyncio.create_task(call())
        wedged = sim.layer.supervisor.get(f"{NAMESPACE}/{first}")
        assert wedged is not None
        await sim.wait_for(lambda: wedged.num_waiting == 1, 30, "queued")
        assert (await sim.fault("pod-oomkilled", f"{NAMESPACE}/{first}")).status_code == 202
        status, replica, attempt, (tokens, errors, done) = await asyncio.wait_for(task, 30)
        assert status == 200 and replica == second and attempt == "2"
        assert done and not errors and tokens == 4
        entries = await journal(sim, pool=POOL, request_id="retry-1")
        assert [(e["outcome"], e["replica"], e["attempt"]) for e in entries] == [
            ("retried", first, 1),
            ("completed", second, 2),
        ]
        assert entries[0]["tokens_streamed"] == 0


async def test_shedding_refuses_sheddable_requests_and_serves_the_others() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        await sim.wait_serving(2)
        state = await sim.set_state(
            "admission", "admission", {"shed_tiers": ["sheddable"], "queue_bound": None}
        )
        assert state["admission"]["shed_tiers"] == ["sheddable"]
        # A change naming a stale version is refused and changes nothing.
        stale = await sim.http.put(
            f"/router/v1/pools/{POOL}/admission",
            json={"replaces_version": state["version"] - 1, "admission": {"shed_tiers": []}},
        )
        assert stale.status_code == 409 and stale.json()["current_version"] == state["version"]
        assert (await sim.http.get(f"/router/v1/pools/{POOL}/state")).json()["admission"]["shed_tiers"] == [
            "sheddable"
        ]

        outcomes: dict[str, list[int]] = {"critical": [], "standard": [], "sheddable": []}
        for i in range(12):
            tier = ("critical", "standard", "sheddable")[i % 3]
            body = {"model": MODEL, "max_tokens": 4, "stream": True, "tier": tier, "request_id": f"shed-{i}"}
            async with sim.http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code == 200:
                    tokens, errors, done = await read_sse(response)
                    assert done and tokens == 4 and not errors
                else:
                    error = json.loads(await response.aread())["error"]
                    assert response.status_code == 429 and error["type"] == "shed"
                    assert response.headers["retry-after"] == "1"
                outcomes[tier].append(response.status_code)
        assert outcomes["sheddable"] == [429] * 4
        assert outcomes["critical"] == [200] * 4 and outcomes["standard"] == [200] * 4
        shed = await journal(sim, pool=POOL, outcome="shed")
        assert sorted(e["request_id"] for e in shed) == ["shed-11", "shed-2", "shed-5", "shed-8"]


async def test_a_partially_shed_tier_refuses_that_share_of_its_requests_by_request_id() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        await sim.wait_serving(2)
        state = await sim.set_state(
            "admission", "admission", {"partial_shed": {"sheddable": 0.25}, "queue_bound": None}
        )
        assert state["admission"]["partial_shed"] == {"sheddable": 0.25}
        ids = [f"part-{i}" for i in range(80)]
        expected = {rid for rid in ids if admission_draw(rid) < 0.25}
        assert 10 <= len(expected) <= 30  # the hash spreads ids evenly enough to test a share
        codes: dict[str, int] = {}
        for rid in [*ids, *ids[:20]]:  # the same id gets the same answer again
            body = {"model": MODEL, "max_tokens": 2, "tier": "sheddable", "request_id": rid}
            response = await sim.http.post("/v1/completions", json=body)
            assert codes.setdefault(rid, response.status_code) == response.status_code
        assert {rid for rid, code in codes.items() if code == 429} == expected
        assert all(codes[rid] == 200 for rid in ids if rid not in expected)
        shed = await journal(sim, pool=POOL, outcome="shed")
        assert {e["request_id"] for e in shed} == expected
        assert all(e["detail"] == "25.0% of tier sheddable is shed by admission control" for e in shed)
        # A whole tier is only ever listed in shed_tiers: a share of 1 is a clear 422.
        bad = await sim.http.put(
            f"/router/v1/pools/{POOL}/admission",
            json={"replaces_version": state["version"], "admission": {"partial_shed": {"standard": 1.0}}},
        )
        assert bad.status_code == 422 and "strictly between 0 and 1" in bad.text


async def test_admin_api_rejects_bad_input_with_a_clear_error_and_changes_nothing() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        await sim.wait_serving(2)
        before = (await sim.http.get(f"/router/v1/pools/{POOL}/state")).json()
        bad = await sim.http.put(
            f"/router/v1/pools/{POOL}/weights",
            json={"replaces_version": before["version"], "weights": {"x": -1}},
        )
        assert bad.status_code == 422 and ">= 0" in bad.json()["detail"]
        missing = await sim.http.get("/router/v1/pools/inference/nope/state")
        assert missing.status_code == 404 and "no Service 'nope'" in missing.json()["detail"]
        assert (await sim.http.get(f"/router/v1/pools/{POOL}/state")).json() == before
        unknown = await sim.http.post("/v1/completions", json={"model": "gpt-9", "max_tokens": 4})
        assert unknown.status_code == 404 and "known models" in unknown.json()["error"]["message"]


async def test_deleting_a_pod_drains_with_a_shutdown_timeout_and_cuts_streams_without_one() -> None:
    """``kubectl delete pod`` over the Kubernetes API: vLLM's --shutdown-timeout decides the streams' fate."""
    for timeout_s, expect_done in ((30.0, True), (0.0, False)):
        scn = scenario(load=SLOW, model={"shutdown_timeout_s": timeout_s})
        async with running_serving(scn, speed=10) as sim:
            await sim.wait_serving(2)
            body = {"model": MODEL, "max_tokens": 16, "stream": True, "deadline_s": 120}
            async with sim.http.stream("POST", "/v1/completions", json=body) as response:
                replica = response.headers["x-fleetmend-replica"]
                lines = response.aiter_lines()
                assert " tok" in await anext(lines)
                deleted = await sim.kube.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{replica}")
                assert deleted.status_code == 200, deleted.text
                engine = sim.layer.supervisor.get(f"{NAMESPACE}/{replica}")
                assert engine is not None
                if expect_done:
                    # Draining: new requests are refused, the running stream goes on.
                    await sim.wait_for(lambda: engine.state.value == "draining", 10, "drain")  # noqa: B023

                    async def derouted() -> bool:
                        routed = (await sim.http.get(f"/router/v1/pools/{POOL}/routing-set")).json()[
                            "endpoints"
                        ]
                        return replica not in {e["pod"] for e in routed}  # noqa: B023  (terminating: not ready)

                    await sim.wait_for(derouted, 10, "the terminating pod to leave the routing set")
                    with pytest.raises(EngineRefused) as refused:
                        engine.submit(
                            EngineRequest("late-comer", 10, 4, 4, _NullSink()), sim.world.clock.now()
                        )
                    assert refused.value.status == 503
                rest = [line async for line in lines if line.startswith("data: ")]
            done = rest[-1] == "data: [DONE]"
            assert done is expect_done, (timeout_s, rest[-2:])
            if not expect_done:
                assert "terminal_stream_error" in rest[-1]
            await sim.wait_for(
                lambda: sim.layer.kube.pod(NAMESPACE, replica) is None,  # noqa: B023
                60,
                "the pod to go once its engine exited",
            )
