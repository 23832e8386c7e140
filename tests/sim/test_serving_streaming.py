"""Streams from the simulated engines through a real Envoy: a fault or a pod deletion cuts a started
stream (never replayed), and vLLM's --shutdown-timeout lets a deleted pod finish its streams.

Routing, weights, shedding and retries are Envoy's, tested in ``tests/gateway/test_envoy_gateway.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleet.gateway import Outcome
from sim.serving.engine import EngineRefused, EngineRequest
from tests.sim.serving_fixtures import NAMESPACE, POOL_REF, running_serving, scenario
from tests.sim.support import MODEL, SLOW, read_sse

pytestmark = pytest.mark.timeout(180)


class _NullSink:
    def on_tokens(self, count: int, now: float) -> None: ...
    def on_finished(self, reason: str, now: float) -> None: ...
    def on_aborted(self, reason: str, now: float) -> None: ...


async def test_a_stream_cut_after_its_first_token_is_cut_for_the_user_and_never_retried(
    ledger_url: str,
) -> None:
    async with running_serving(scenario(load=SLOW), speed=10, gateway_db=ledger_url) as sim:
        await sim.wait_serving(2)
        body = {"model": MODEL, "max_tokens": 32, "stream": True}
        async with sim.gateway_client() as users:
            headers = {"x-request-id": "cut-1"}
            async with users.stream("POST", "/v1/completions", json=body, headers=headers) as response:
                assert response.status_code == 200
                replica = sim.replica_of(response)
                assert replica is not None
                lines = response.aiter_lines()
                first = await anext(lines)
                assert " tok" in first  # a token reached the caller
                fault = await sim.fault("pod-oomkilled", f"{NAMESPACE}/{replica}")
                assert fault.status_code == 202, fault.text
                tokens, _, done = await read_sse(lines)
        assert not done, "a cut stream must not end as if it completed"
        assert 1 + tokens < 32

        def reported() -> list[Any]:
            assert sim.adapter is not None
            return [e for e in sim.adapter.request_outcomes(POOL_REF, replica=replica) if e.bytes_sent > 0]

        await sim.wait_for(reported, 30, "Envoy's record of the cut request")
        (entry,) = reported()
        assert entry.outcome == Outcome.TERMINAL_ERROR and entry.truncated and entry.attempt == 1


async def test_deleting_a_pod_drains_with_a_shutdown_timeout_and_cuts_streams_without_one(
    ledger_url: str,
) -> None:
    """``kubectl delete pod`` over the Kubernetes API: vLLM's --shutdown-timeout decides the streams' fate."""
    for timeout_s, expect_done in ((30.0, True), (0.0, False)):
        scn = scenario(load=SLOW, model={"shutdown_timeout_s": timeout_s})
        async with running_serving(scn, speed=10, gateway_db=ledger_url) as sim:
            await sim.wait_serving(2)
            body = {"model": MODEL, "max_tokens": 16, "stream": True}
            async with (
                sim.gateway_client() as users,
                users.stream("POST", "/v1/completions", json=body) as response,
            ):
                replica = sim.replica_of(response)
                assert replica is not None
                lines = response.aiter_lines()
                first = json.loads((await anext(lines)).removeprefix("data: "))
                # A chunk carries every token decoded since the last one: one, or more on a busy loop.
                before = first["choices"][0]["text"].count(" tok")
                assert before >= 1, first
                # The engine before the deletion: without a shutdown timeout it may be gone at once.
                engine = sim.layer.supervisor.get(f"{NAMESPACE}/{replica}")
                assert engine is not None
                deleted = await sim.kube.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{replica}")
                assert deleted.status_code == 200, deleted.text
                if expect_done:
                    # Draining: the terminating pod leaves the routing set, new requests are refused,
                    # the running stream goes on.
                    await sim.wait_for(lambda: engine.state.value == "draining", 10, "drain")  # noqa: B023
                    await sim.wait_for(
                        lambda: replica not in sim.routed(),  # noqa: B023  (terminating: not ready)
                        10,
                        "the terminating pod to leave the routing set",
                    )
                    with pytest.raises(EngineRefused) as refused:
                        engine.submit(
                            EngineRequest("late-comer", 10, 4, 4, _NullSink()), sim.world.clock.now()
                        )
                    assert refused.value.status == 503
                tokens, errors, done = await read_sse(lines)
            # Cut: the connection ends without [DONE], or vLLM's error chunk ends the stream.
            completed = done and not errors
            assert completed is expect_done, (timeout_s, tokens, errors, done)
            assert (before + tokens == 16) is expect_done
            await sim.wait_for(
                lambda: sim.layer.kube.pod(NAMESPACE, replica) is None,  # noqa: B023
                60,
                "the pod to go once its engine exited",
            )
