"""The load generator through a real Envoy, scheduled faults and the baseline deroute."""

from __future__ import annotations

import asyncio

import pytest

from fleet.gateway import Admission, GatewayPolicy
from fleet.vocabulary import FaultKind, Tier
from sim.control import FaultRequest
from sim.serving.baselines import measure_deroute
from sim.serving.loadgen import DEFAULT_DEADLINES, GatewayTarget, LoadRun, LoadSpec, arrivals, start_load
from sim.serving.telemetry import gpu_assignment
from tests.sim.serving_fixtures import NAMESPACE, POOL, POOL_REF, running_serving, scenario

pytestmark = pytest.mark.timeout(180)


def test_arrivals_are_a_pure_function_of_the_seed() -> None:
    spec = LoadSpec(rate=5.0, duration_s=30.0, seed=42)
    assert arrivals(spec) == arrivals(spec)
    assert arrivals(spec) != arrivals(spec.model_copy(update={"seed": 43}))
    tiers = {a.tier for a in arrivals(spec)}
    assert tiers == {Tier.CRITICAL, Tier.STANDARD, Tier.SHEDDABLE}
    assert 100 < len(arrivals(spec)) < 200  # ~150 at 5/s over 30 s


def test_a_request_carries_its_tier_or_its_deadline_as_its_vllm_priority() -> None:
    """``tier_priority`` sends the tier's number; ``deadline_priority`` the deadline in milliseconds from
    the run's start, so an engine scheduling by priority serves earliest deadline first. Not both."""
    target = GatewayTarget("http://127.0.0.1:9")
    by_deadline = LoadSpec(rate=5.0, duration_s=10.0, seed=3, deadline_priority=True)
    arrival = arrivals(by_deadline)[7]
    _, body = LoadRun(target, by_deadline)._http_request(arrival, "m")
    assert body["priority"] == round((arrival.offset_s + DEFAULT_DEADLINES[arrival.tier]) * 1000)
    by_tier = by_deadline.model_copy(update={"deadline_priority": False, "tier_priority": {arrival.tier: 4}})
    assert LoadRun(target, by_tier)._http_request(arrival, "m")[1]["priority"] == 4
    assert "priority" not in LoadRun(target, LoadSpec(rate=5.0))._http_request(arrival, "m")[1]
    with pytest.raises(ValueError, match="give one"):
        LoadSpec(rate=5.0, deadline_priority=True, tier_priority={Tier.CRITICAL: 0})


async def test_load_through_envoy_reports_goodput_shed_and_per_replica_ttft(ledger_url: str) -> None:
    # Latency is measured on the world's clock around real HTTP: a low speed keeps client-side jitter small.
    async with running_serving(scenario(), speed=5, gateway_db=ledger_url) as sim:
        pods = await sim.wait_serving(2)
        await sim.set_policy(GatewayPolicy(admission=Admission(shed_tiers=[Tier.SHEDDABLE])))
        spec = LoadSpec(rate=4.0, duration_s=10.0, seed=9)
        run = start_load(sim.world, spec)  # through the gateway the simulator was given
        report = await run.wait()
        expected = arrivals(spec)
        assert report.sent == report.finished == len(expected)
        # The tier travels in the x-fleetmend-tier header; Envoy's shed answers carry Retry-After.
        assert report.shed == sum(1 for a in expected if a.tier == Tier.SHEDDABLE)
        assert {r.retry_after_s for r in run.results if r.outcome == "shed"} == {2.0}
        assert report.goodput == report.sent - report.shed
        assert report.late == report.terminal_errors == report.truncated_streams == 0
        # Envoy names the upstream; the load generator names its pod.
        assert set(report.per_replica) == set(pods)
        assert all(r.ttft_p50_s is not None and r.ttft_p50_s < 2.0 for r in report.per_replica.values())
        # Graded by the world: two replicas at a fraction of their capacity could have served every
        # arrival, so every refusal of the sheddable tier is over-shed.
        graded = run.grade(sim.layer.capacity, sim.layer.engine_spec_for_model(run.model))
        assert graded.optimum == graded.arrivals == report.sent
        assert graded.over_shed == report.shed > 0 and graded.goodput == report.goodput
        assert not graded.bound_beaten and graded.min_capacity_tokens_s > 0


async def test_clients_retry_a_refusal_after_its_retry_after_and_are_served_once_it_is_lifted(
    ledger_url: str,
) -> None:
    """``client_retries``: a 429 is retried after its Retry-After with the same request id, as the
    OpenAI SDKs do; a request refused on every try stays shed, one let in on a retry is served."""
    async with running_serving(scenario(), speed=5, gateway_db=ledger_url) as sim:
        await sim.wait_serving(2)
        await sim.set_policy(GatewayPolicy(admission=Admission(shed_tiers=[Tier.SHEDDABLE])))
        spec = LoadSpec(rate=4.0, duration_s=20.0, seed=9, client_retries=2)
        run = start_load(sim.world, spec)
        while not any(r.outcome == "shed" for r in run.results):  # refused on all three tries
            await asyncio.sleep(0.05)
        await sim.set_policy(GatewayPolicy())  # shedding lifted: the next retries are let in
        report = await run.wait()
        sheddable = [r for r in run.results if r.tier == Tier.SHEDDABLE]
        refused_for_good = [r for r in sheddable if r.outcome == "shed"]
        served_on_retry = [r for r in sheddable if r.outcome in ("goodput", "late") and r.client_calls > 1]
        assert refused_for_good and all(r.client_calls == 3 for r in refused_for_good)
        assert all(r.retry_after_s == 2.0 for r in refused_for_good)
        assert served_on_retry, "no request refused before the lift was served on a retry"
        # The deadline's clock ran from the arrival: a served retry waited at least one Retry-After.
        assert all(r.e2e_s is not None and r.e2e_s >= 2.0 for r in served_on_retry)
        assert report.shed == len(refused_for_good)
        assert report.served_after_refusal == len(served_on_retry)
        # Graded by the world: only the requests refused for good count as refused.
        graded = run.grade(sim.layer.capacity, sim.layer.engine_spec_for_model(run.model))
        assert graded.refused == len(refused_for_good)


async def test_a_client_that_gives_up_at_its_deadline_closes_the_stream_and_the_engine_aborts_it(
    ledger_url: str,
) -> None:
    """``give_up_at_deadline``: on wedged engines nothing finishes; each client stops waiting at its
    deadline (the report says late, after exactly the deadline) and the engines hold nothing after."""
    async with running_serving(scenario(), speed=5, gateway_db=ledger_url) as sim:
        pods = await sim.wait_serving(2)
        engines = [sim.layer.supervisor.get(f"{NAMESPACE}/{pod}") for pod in pods]
        for engine in engines:
            assert engine is not None
            engine.wedged = True
        deadlines = {Tier.CRITICAL: 2.0, Tier.STANDARD: 2.0, Tier.SHEDDABLE: 2.0}
        spec = LoadSpec(rate=4.0, duration_s=3.0, seed=5, deadlines_s=deadlines, give_up_at_deadline=True)
        run = start_load(sim.world, spec)
        report = await run.wait()
        assert report.sent == len(run.results) > 0
        assert {r.outcome for r in run.results} == {"late"} and {r.e2e_s for r in run.results} == {2.0}
        await sim.wait_for(
            lambda: all(e is not None and not e.running and not e.waiting for e in engines),
            10,
            "the engines to abort the requests their clients gave up on",
        )


async def test_a_fault_scheduled_for_later_applies_at_its_sim_time() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        pod, _ = await sim.wait_serving(2)
        at = sim.world.clock.now() + 5.0
        r = await sim.http.post(
            "/sim/v1/faults", json={"kind": "wedged-engine", "target": f"{NAMESPACE}/{pod}", "at": at}
        )
        assert r.status_code == 202 and r.json()["scheduled_at"] == at
        engine = sim.layer.supervisor.get(f"{NAMESPACE}/{pod}")
        assert engine is not None and not engine.wedged
        await sim.wait_for(lambda: engine.wedged, 30, "the scheduled fault")
        assert sim.world.clock.now() >= at


async def test_kubernetes_default_path_needs_failure_threshold_probes_to_deroute_a_dead_replica() -> None:
    """The fault lands at a random phase of the probe period, so the deroute comes after the
    ``failureThreshold``-th failed probe: in ((threshold - 1) x period, threshold x period], give or
    take one probe the loaded machine ran late. (At speed 40 a 650 ms stall of the simulator's loop
    on a busy CI machine was 26 sim seconds; at speed 10 the same stall is a quarter of that.)"""
    async with running_serving(scenario(), speed=10) as sim:
        pod, _ = await sim.wait_serving(2)
        obj = sim.layer.kube.pod(NAMESPACE, pod)
        assert obj is not None
        probe = sim.layer.prober.settings_for(obj)
        node = obj["spec"]["nodeName"]
        gpu = next(i for i, p in gpu_assignment(sim.layer.kube, node).items() if p["metadata"]["name"] == pod)
        fault = FaultRequest(
            kind=FaultKind.GPU_XID, target=node, params={"code": 79, "gpu": gpu, "keep_alive": True}
        )
        measured = await measure_deroute(sim.layer, POOL, pod, fault, timeout_s=120)
        assert measured.sim_seconds_to_deroute is not None
        assert measured.sim_seconds_to_deroute > probe.period_s * (probe.failure_threshold - 1)
        assert measured.sim_seconds_to_deroute <= probe.period_s * (probe.failure_threshold + 1)


async def test_prometheus_http_service_discovery_lists_every_engine_at_its_pod_ip_and_every_node() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        pods = await sim.wait_serving(2)
        targets = (await sim.http.get("/sim/v1/prometheus/targets")).json()
        engines = {t["labels"]["pod"]: t for t in targets if t["labels"]["job"] == "vllm"}
        assert set(pods) <= set(engines)
        for pod in pods:
            # The engine's own address, as kubernetes_sd would find it; Prometheus' default path.
            (target,) = engines[pod]["targets"]
            assert f"http://{target}" == sim.pod_url(pod)
            assert "__metrics_path__" not in engines[pod]["labels"]
            page = await sim.http.get(f"http://{target}/metrics")
            assert page.status_code == 200 and "vllm:num_requests_running" in page.text
        nodes = {t["labels"]["__metrics_path__"] for t in targets if t["labels"]["job"] == "dcgm-exporter"}
        assert nodes == {"/nodes/gpu-node-0/metrics", "/nodes/gpu-node-1/metrics"}
        for path in nodes:
            assert (await sim.http.get(path)).status_code == 200


async def test_scenario_traffic_starts_once_a_gateway_is_set_and_waits_for_the_pool(ledger_url: str) -> None:
    scn = scenario(load={"traffic": {"rate": 5.0, "seed": 2}})
    async with running_serving(scn, speed=20, gateway_db=ledger_url) as sim:
        run = sim.layer.background_load
        assert run is not None
        await sim.wait_serving(2)
        await sim.wait_for(lambda: len(run.results) >= 10, 60, "background requests")
        report = run.report()
        # Served (in time, or late: at 20x a second the host's CPU is starved is 20 sim seconds) or shed
        # with an answer; none cut.
        assert report.goodput + report.late + report.shed >= 10, report
        assert report.terminal_errors == 0 and report.truncated_streams == 0, report
        assert sim.adapter is not None
        await sim.wait_for(
            lambda: len(sim.adapter.request_outcomes(POOL_REF)) >= 10,  # type: ignore[union-attr]
            30,
            "Envoy's record of the requests",
        )


async def test_load_control_api_starts_reports_and_stops_a_run(ledger_url: str) -> None:
    async with running_serving(scenario(), speed=20, gateway_db=ledger_url) as sim:
        await sim.wait_serving(2)
        # With no gateway set the simulator refuses load: it routes nothing itself.
        assert sim.gateway is not None
        assert (await sim.http.put("/sim/v1/gateway", json={"url": None})).status_code == 200
        refused = await sim.http.post("/sim/v1/load", json={"rate": 5.0})
        assert refused.status_code == 409 and "PUT /sim/v1/gateway" in refused.text
        gateway = {"url": sim.gateway.url, "upstream_header": "x-fleetmend-upstream"}
        assert (await sim.http.put("/sim/v1/gateway", json=gateway)).status_code == 200
        bad = await sim.http.post("/sim/v1/load", json={"rate": 5, "tiers": {"critical": -1}})
        assert bad.status_code == 422
        started = await sim.http.post("/sim/v1/load", json={"rate": 5.0, "duration_s": 600.0, "seed": 4})
        assert started.status_code == 202
        run_id = started.json()["id"]

        async def some_done() -> bool:
            return (await sim.http.get(f"/sim/v1/load/{run_id}")).json()["finished"] >= 5

        await sim.wait_for(some_done, 60, "requests to finish")
        window = (await sim.http.get(f"/sim/v1/load/{run_id}", params={"since_s": 0, "until_s": 1})).json()
        early = await sim.http.get(f"/sim/v1/load/{run_id}/grade")  # graded once every request is done
        assert early.status_code == 409 and "in_flight 0" in early.text

        # A run still going is graded on its settled arrivals: those whose deadlines (20 s at most) passed.
        async def some_settled() -> bool:
            got = await sim.http.get(f"/sim/v1/load/{run_id}/grade", params={"settled": "true"})
            return got.status_code == 200 and got.json()["arrivals"] > 0

        await sim.wait_for(some_settled, 60, "arrivals past their deadlines")
        settled = (await sim.http.get(f"/sim/v1/load/{run_id}/grade", params={"settled": "true"})).json()
        sent = (await sim.http.get(f"/sim/v1/load/{run_id}")).json()["sent"]
        assert 0 < settled["arrivals"] < sent and not settled["bound_beaten"], (settled, sent)
        assert settled["optimum"] >= settled["goodput"] and settled["capacity_samples"] >= 1, settled
        # An until_s whose arrivals' deadlines are still to come is refused with what to ask instead.
        future = await sim.http.get(f"/sim/v1/load/{run_id}/grade", params={"until_s": 10_000})
        assert future.status_code == 409 and "not all past their deadlines" in future.text
        assert (await sim.http.get("/sim/v1/load/nope/grade")).status_code == 404
        assert window["window_s"] == [0.0, 1.0]
        stopped = await sim.http.delete(f"/sim/v1/load/{run_id}")
        assert stopped.status_code == 200 and stopped.json()["sent"] >= 5
        assert (await sim.http.get(f"/sim/v1/load/{run_id}")).status_code == 404


async def test_scenario_timed_faults_reach_the_serving_layer() -> None:
    faults = [{"kind": "thermal", "target": "gpu-node-1", "at_s": 2.0, "params": {"temp_c": 91}}]
    async with running_serving(scenario(faults=faults), speed=20) as sim:

        async def hot() -> bool:
            page = (await sim.http.get("/nodes/gpu-node-1/metrics")).text
            return 'DCGM_FI_DEV_GPU_TEMP{gpu="0"' in page and "} 91.0" in page

        await sim.wait_for(hot, 30, "the scheduled thermal fault")
        assert sim.world.clock.now() - sim.world.started_at >= 2.0
