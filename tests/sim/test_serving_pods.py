"""Engines listen on their pod IPs: real sockets on loopback, as Envoy, Prometheus and fleetmend reach them."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from typing import Any

import httpx
import pytest

from sim.k8s.podips import PodIpAllocator
from sim.serving.loadgen import GatewayTarget, LoadSpec, arrivals, start_load
from sim.world import SimWorld
from tests.sim.serving_fixtures import NAMESPACE, RunningServing, pod_node_and_gpu, running_serving, scenario

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def pod_ip(sim: RunningServing, pod: str) -> str:
    obj = sim.world.pod(NAMESPACE, pod)
    assert obj is not None
    return str(obj["status"]["podIP"])


async def open_stream(client: httpx.AsyncClient, url: str, output_tokens: int) -> tuple[httpx.Response, Any]:
    """Start a streamed completion; returns the response and its line iterator."""
    request = client.build_request(
        "POST",
        url + "/v1/completions",
        json={"model": MODEL, "max_tokens": output_tokens, "stream": True},
        headers={"x-request-id": "req-long"},
    )
    response = await client.send(request, stream=True)
    return response, response.aiter_lines()


async def read_until_text(lines: Any) -> list[str]:
    """Read SSE lines until the first chunk with tokens arrived."""
    seen: list[str] = []
    async for line in lines:
        seen.append(line)
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
            return seen
    raise AssertionError(f"the stream ended before its first token: {seen}")


async def drain(lines: Any) -> tuple[list[str], Exception | None]:
    """Read to the end; (lines, the error that ended the read, if any)."""
    seen: list[str] = []
    try:
        async for line in lines:
            seen.append(line)
    except httpx.HTTPError as exc:
        return seen, exc
    return seen, None


async def test_an_engine_answers_health_metrics_models_and_a_streamed_completion_on_its_pod_ip() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        pod, other = await sim.wait_serving(2)
        url = sim.pod_url(pod)
        assert url.startswith("http://127.") and url.endswith(":8000")
        assert pod_ip(sim, pod) != pod_ip(sim, other)
        async with httpx.AsyncClient(timeout=10) as client:
            health = await client.get(url + "/health", headers={"X-Request-ID": "probe-1"})
            assert health.status_code == 200 and health.headers["x-request-id"] == "probe-1"
            models = (await client.get(url + "/v1/models")).json()
            assert models["data"][0]["id"] == MODEL
            response, lines = await open_stream(client, url, 12)
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-request-id"] == "req-long"
            body, error = await drain(lines)
            assert error is None
            data = [line[6:] for line in body if line.startswith("data: ")]
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d) for d in data[:-1]]
            assert sum(c["choices"][0]["text"].count(" tok") for c in chunks) == 12
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert {c["id"] for c in chunks} == {"req-long"}
            # The request went to this engine only: its own /metrics counted it.
            metrics = await sim.metrics(pod)
            done = [s for s in metrics["vllm:request_success"].samples if s.name.endswith("_total")]
            assert sum(s.value for s in done) == 1
            assert (
                sum(
                    s.value
                    for s in (await sim.metrics(other))["vllm:request_success"].samples
                    if s.name.endswith("_total")
                )
                == 0
            )
            # Refusals as vLLM answers them.
            unknown = await client.post(url + "/v1/completions", json={"model": "gpt-9", "max_tokens": 4})
            assert unknown.status_code == 404 and "gpt-9" in unknown.json()["error"]["message"]
            bad = await client.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": 0})
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
            # A priority on an engine run first come first served: vLLM's 400, not a silent FIFO.
            prio = await client.post(
                url + "/v1/completions", json={"model": MODEL, "max_tokens": 4, "priority": 2}
            )
            assert prio.status_code == 400
            assert prio.json()["error"]["message"] == "Got priority 2 but Priority scheduling is not enabled."
            # Nothing but the engine's own API on its port.
            assert (await client.get(url + f"/pods/{NAMESPACE}/{pod}/metrics")).status_code == 404


async def test_a_lost_node_refuses_connections_and_cuts_an_in_flight_stream() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        pod, _ = await sim.wait_serving(2)
        url = sim.pod_url(pod)
        node = sim.world.pod(NAMESPACE, pod)["spec"]["nodeName"]  # type: ignore[index]
        async with httpx.AsyncClient(timeout=10) as client:
            response, lines = await open_stream(client, url, 600)  # 15 sim seconds at 40 tokens/s
            head = await read_until_text(lines)
            assert (await sim.fault("node-lost", node)).status_code == 202
            rest, error = await drain(lines)
            await response.aclose()
            # Cut like a dead process: the body ends mid-stream, no finish chunk, no [DONE].
            assert isinstance(error, httpx.RemoteProtocolError | httpx.ReadError), error
            assert "data: [DONE]" not in head + rest
            assert not any('"finish_reason": "length"' in line for line in head + rest)
            with pytest.raises(httpx.ConnectError):
                await client.get(url + "/health")


async def test_an_engine_that_dies_under_a_running_server_ends_its_stream_as_vllm_does_then_the_process_exits() -> (
    None
):
    """Xid 79: the engine core dies, the API server lingers (launcher watchdog) answering 503: the stream
    gets vLLM's error chunk and [DONE]; then the process exits and the address refuses connections."""
    async with running_serving(scenario(), speed=20) as sim:
        pod, _ = await sim.wait_serving(2)
        url = sim.pod_url(pod)
        node, gpu = pod_node_and_gpu(sim, pod)
        async with httpx.AsyncClient(timeout=10) as client:
            response, lines = await open_stream(client, url, 600)
            await read_until_text(lines)
            assert (await sim.fault("gpu-xid", node, code=79, gpu=gpu)).status_code == 202
            rest, error = await drain(lines)
            await response.aclose()
            assert error is None
            data = [line[6:] for line in rest if line.startswith("data: ")]
            assert data[-1] == "[DONE]"
            assert json.loads(data[-2])["error"]["type"] == "EngineDeadError"
            assert (await client.get(url + "/health")).status_code == 503
            refused = await client.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": 4})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "EngineDeadError"

            async def exited() -> bool:
                try:
                    await client.get(url + "/health")
                except httpx.ConnectError:
                    return True
                except httpx.TransportError:
                    return False
                return False

            await sim.wait_for(exited, 30, "the watchdog to end the process")


async def test_an_oom_killed_container_restarts_and_serves_again_on_the_same_pod_ip() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        pod, _ = await sim.wait_serving(2)
        url = sim.pod_url(pod)
        async with httpx.AsyncClient(timeout=10) as client:
            response, lines = await open_stream(client, url, 600)
            await read_until_text(lines)
            assert (await sim.fault("pod-oomkilled", f"{NAMESPACE}/{pod}")).status_code == 202
            rest, error = await drain(lines)
            await response.aclose()
            assert error is not None and "data: [DONE]" not in rest
            with pytest.raises(httpx.ConnectError):
                await client.get(url + "/metrics")

            async def listening() -> bool:
                try:
                    return (await client.get(url + "/health")).status_code == 200
                except httpx.TransportError:
                    return False

            await sim.wait_for(listening, 60, "the restarted engine on its pod IP")
            assert sim.pod_url(pod) == url
            # A new process: its counters start from zero.
            metrics = await sim.metrics(pod)
            aborted = [s for s in metrics["vllm:request_success"].samples if s.name.endswith("_total")]
            assert sum(s.value for s in aborted) == 0


async def test_a_draining_engine_finishes_its_streams_and_refuses_new_work() -> None:
    scn = scenario(model={"shutdown_timeout_s": 60, "termination_grace_s": 90})
    async with running_serving(scn, speed=20) as sim:
        pod, _ = await sim.wait_serving(2)
        url = sim.pod_url(pod)
        async with httpx.AsyncClient(timeout=10) as client:
            # 30 sim seconds (1.5 s of wall clock at speed 20): the drain outlasts a moment in which a
            # loaded machine runs nothing of this world, so the test sees the engine draining.
            response, lines = await open_stream(client, url, 1200)
            head = await read_until_text(lines)
            deleted = await sim.kube.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")
            assert deleted.status_code == 200
            engine = sim.layer.supervisor.get(f"{NAMESPACE}/{pod}")
            await sim.wait_for(lambda: engine is not None and engine.state.value == "draining", 10, "SIGTERM")
            refused = await client.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": 4})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "ServiceUnavailableError"
            rest, error = await drain(lines)
            await response.aclose()
            assert error is None and "data: [DONE]" in rest
            tokens = sum(
                json.loads(line[6:])["choices"][0]["text"].count(" tok")
                for line in head + rest
                if line.startswith("data: {")
            )
            assert tokens == 1200

            # Drained: the process exits, its address stops answering.
            async def gone() -> bool:
                try:
                    await client.get(url + "/health")
                except httpx.ConnectError:
                    return True
                except httpx.TransportError:  # a pooled connection the exiting process cut
                    return False
                return False

            await sim.wait_for(gone, 10, "the drained process to exit")


def test_two_worlds_at_once_get_disjoint_pod_ips() -> None:
    first, second = SimWorld(scenario()), SimWorld(scenario())  # the same scenario, the same seed
    # Every pod, the node agents' DaemonSet pods too, gets an address from its own world's block.
    ips = [{p["status"]["podIP"] for p in w.pods() if p["status"].get("podIP")} for w in (first, second)]
    assert len(first.pods(NAMESPACE)) == 2
    assert len(ips[0]) == len(first.pods()) and len(ips[1]) == len(second.pods())
    assert not ips[0] & ips[1]
    assert first.control.pod_ips.blocks != second.control.pod_ips.blocks


def test_a_pod_ip_another_process_listens_on_is_skipped() -> None:
    taken = PodIpAllocator(port=0, rng=random.Random(7)).allocate()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind((taken, 0))
    port = holder.getsockname()[1]
    holder.listen()
    try:
        # Same draw, checked on the port the other process holds: that address is not handed out.
        allocator = PodIpAllocator(port=port, rng=random.Random(7))
        got = allocator.allocate()
        assert got != taken
    finally:
        holder.close()


async def test_the_http_load_generator_against_one_pod_ip_reports_every_request() -> None:
    async with running_serving(scenario(), speed=5) as sim:
        pod, _ = await sim.wait_serving(2)
        url = sim.pod_url(pod)
        spec = LoadSpec(rate=3.0, duration_s=6.0, seed=4, model=MODEL)
        run = start_load(GatewayTarget(url, speed=5.0), spec)
        report = await asyncio.wait_for(run.wait(), timeout=60)
        expected = arrivals(spec)
        # No gateway: no shedding, every request streamed to the end by the one engine.
        assert report.sent == report.finished == len(expected) > 5
        assert report.goodput + report.late == report.sent
        assert report.shed == report.rejected == report.terminal_errors == report.truncated_streams == 0
        assert list(report.per_replica) == [url.removeprefix("http://")]
        assert report.per_replica[url.removeprefix("http://")].requests == report.sent
        by_id = {r.request_id: r for r in run.results}
        for arrival in expected:
            result = by_id[arrival.request_id]
            assert result.status == 200 and not result.truncated
            assert result.tokens == arrival.output_tokens and result.ttft_s is not None
        # The engine saw exactly these requests.
        metrics = await sim.metrics(pod)
        success = [s for s in metrics["vllm:request_success"].samples if s.name.endswith("_total")]
        assert sum(s.value for s in success) == report.sent
