"""A restarted replica is ready before it is fast: its measured rate climbs over the warm-up window,
and equal-share routing to it makes requests late where rate-proportional weights do not (through a
real Envoy whose weights fleetmend sets)."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

import pytest

from fleet.gateway import GatewayPolicy
from fleet.vocabulary import Tier
from gateway.resources import DataPlaneSettings
from sim.serving.loadgen import GatewayTarget, LoadReport, LoadSpec, arrivals, start_load
from tests.sim.serving_fixtures import NAMESPACE, RunningServing, running_serving, scenario

WARM_RATE = 200.0
# How long (sim seconds; 120 s of wall clock at 5x) a wait for replicas to route gives a loaded machine.
WAIT_SIM_S = 600.0
pytestmark = pytest.mark.timeout(300)


async def generation_tokens(sim: RunningServing, pod: str) -> float:
    families = await sim.metrics(pod)
    return sum(s.value for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total"))


async def test_a_cold_replicas_measured_rate_climbs_to_warm_over_its_warm_up_window() -> None:
    scn = scenario(
        workloads=[{"name": "llama", "model": "llama-8b", "replicas": 1}],
        # A long window (in sim seconds, speed 5: the engines keep their rate on a machine shared with three other test processes): a slow start on a loaded machine (the first reading
        # as late as 35 s into the engine's life) still sees it cold.
        model={"warm_up_s": 120, "cold_rate_fraction": 0.25, "warm_rate_tokens_per_s": WARM_RATE},
        load={"engine": {"prefill_cost": 0.0}},
    )
    async with running_serving(scn, speed=5) as sim:
        (pod,) = await sim.wait_serving(1, timeout_sim_s=WAIT_SIM_S)
        engine = sim.layer.supervisor.get(f"{NAMESPACE}/{pod}")
        assert engine is not None
        # Saturate it (at its pod IP: one replica, nothing to route): 12 req/s x ~20 tokens is above
        # even the warm rate.
        target = GatewayTarget(sim.pod_url(pod), speed=sim.world.clock.speed)
        run = start_load(target, 12.0, duration_s=180.0, seed=5, tiers={Tier.STANDARD: 1.0})
        rates: list[tuple[float, float]] = []  # (engine age at window end, tokens/s over the window)
        previous_tokens, previous_at = await generation_tokens(sim, pod), sim.world.clock.now()
        for _ in range(30):
            await sim.sim_sleep(5.0)
            tokens, at = await generation_tokens(sim, pod), sim.world.clock.now()
            rates.append((at - engine.started_at, (tokens - previous_tokens) / (at - previous_at)))
            previous_tokens, previous_at = tokens, at
        await run.stop()
    early = [rate for age, rate in rates if age <= 45]
    middle = [rate for age, rate in rates if 60 <= age <= 100]
    late = [rate for age, rate in rates if age >= 130]
    assert early and middle and late, rates
    mean = statistics.fmean
    assert mean(early) < 0.6 * WARM_RATE, rates  # cold: a fraction of the warm rate
    assert mean(early) < mean(middle) < mean(late), rates  # it climbs...
    assert mean(late) > 0.85 * WARM_RATE, rates  # ...to warm once the window has passed


async def run_with_one_cold_replica(
    weighting: str, spec: LoadSpec, gateway_db: str
) -> tuple[LoadReport, dict[str, Any]]:
    scn = scenario(model={"warm_up_s": 600, "cold_rate_fraction": 0.25, "warm_rate_tokens_per_s": WARM_RATE})
    # Equal share is round robin: Envoy's least request would already send the cold replica less.
    balancing = "round-robin" if weighting == "equal" else "least-request"
    async with running_serving(
        scn, speed=5, gateway_db=gateway_db, data_plane=DataPlaneSettings(balancing=balancing)
    ) as sim:
        warm, cold = await sim.wait_serving(2, timeout_sim_s=WAIT_SIM_S)
        # Let both warm up fully, then restart one: it comes back Ready but cold.
        advance = await sim.http.post("/sim/v1/clock/advance", json={"seconds": 600})
        assert advance.status_code == 200
        await sim.sim_sleep(0.5)
        assert (await sim.fault("pod-oomkilled", f"{NAMESPACE}/{cold}")).status_code == 202
        old = sim.layer.supervisor.get(f"{NAMESPACE}/{cold}")

        def restarted() -> bool:
            engine = sim.layer.supervisor.get(f"{NAMESPACE}/{cold}")
            return engine is not None and engine is not old and engine.alive

        await sim.wait_for(restarted, WAIT_SIM_S, "the OOM-killed replica to restart")
        await sim.wait_serving(2, timeout_sim_s=WAIT_SIM_S)
        now = sim.world.clock.now()
        rates = {pod: sim.layer.supervisor.get(f"{NAMESPACE}/{pod}").rate(now) for pod in (warm, cold)}  # type: ignore[union-attr]
        assert rates[cold] < 0.3 * rates[warm]
        weights = {} if weighting == "equal" else rates
        await sim.set_policy(GatewayPolicy(weights=weights))
        run = start_load(sim.world, spec)  # through Envoy
        report = await run.wait()
        late_on = Counter(r.replica for r in run.results if r.outcome == "late")
        return report, {"warm": warm, "cold": cold, "rates": rates, "late_on": late_on}


async def test_equal_share_to_a_cold_replica_makes_requests_late_and_rate_weights_do_not(
    ledger_url: str,
) -> None:
    spec = LoadSpec(rate=6.0, duration_s=40.0, seed=11, tiers={Tier.STANDARD: 1.0}, prompt_tokens=(128, 1024))
    equal, info_e = await run_with_one_cold_replica("equal", spec, ledger_url)
    weighted, info_w = await run_with_one_cold_replica("rate", spec, ledger_url)
    assert equal.sent == weighted.sent == len(arrivals(spec))  # same seed, same arrivals
    assert equal.late >= 5, equal
    assert weighted.late == 0, weighted
    assert weighted.goodput == weighted.sent
    # The lateness is the cold replica's (it decodes at a quarter of the warm rate).
    late_on = info_e["late_on"]
    assert late_on[info_e["cold"]] > 5 * late_on[info_e["warm"]], late_on
    assert weighted.per_replica[info_w["cold"]].requests < weighted.per_replica[info_w["warm"]].requests
