"""The ramp-back model: the runbook's stated properties, checked over a grid with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fleet.engine_metrics import EngineSnapshot, Histogram, HistogramBucket
from fleet.ramp import RampParams, RampPolicy, rate_weights, simulate_ramp, simulate_ramp_trace
from fleet.shedding import ramp_capacity_rps
from fleet.warmth import RampPlan, plan_weights

cold_fractions = st.floats(min_value=0.1, max_value=0.9)
warmups = st.floats(min_value=30.0, max_value=600.0)


def both(params: RampParams):  # type: ignore[no-untyped-def]
    return simulate_ramp(params, RampPolicy.EQUAL), simulate_ramp(params, RampPolicy.RATE)


def test_default_case_figures() -> None:
    equal, rate = both(RampParams())
    assert equal.late == pytest.approx(313.25)
    assert equal.peak_wait_new == pytest.approx(31.181818, rel=1e-6)
    assert equal.served == pytest.approx(35995.0)
    assert rate.late == 0.0
    assert rate.served == pytest.approx(36000.0)
    assert rate.goodput == rate.served - rate.late
    assert equal.goodput == equal.served - equal.late


@settings(max_examples=60, deadline=None)
@given(c=cold_fractions, t=warmups)
def test_rate_policy_leaves_no_late_request_when_the_replacement_is_headroom(c: float, t: float) -> None:
    rate = simulate_ramp(RampParams(cold_fraction=c, warmup_s=t), RampPolicy.RATE)
    assert rate.late == 0.0
    assert rate.peak_wait_new < 1e-9


@settings(max_examples=20, deadline=None)
@given(w=st.integers(min_value=1, max_value=8), r=st.floats(min_value=1.0, max_value=100.0))
def test_a_replica_that_starts_warm_makes_both_policies_identical(w: int, r: float) -> None:
    equal, rate = both(RampParams(cold_fraction=1.0, warmup_s=0.0, warm_replicas=w, warm_rate=r))
    assert equal.late == rate.late == 0.0
    assert equal.served == pytest.approx(rate.served)
    assert equal.peak_wait_new == pytest.approx(rate.peak_wait_new, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(colder=cold_fractions, warmer=cold_fractions, t=warmups)
def test_equal_policy_peak_wait_grows_as_the_start_gets_colder(
    colder: float, warmer: float, t: float
) -> None:
    colder, warmer = min(colder, warmer), max(colder, warmer)
    p_cold = simulate_ramp(RampParams(cold_fraction=colder, warmup_s=t), RampPolicy.EQUAL).peak_wait_new
    p_warm = simulate_ramp(RampParams(cold_fraction=warmer, warmup_s=t), RampPolicy.EQUAL).peak_wait_new
    assert p_cold >= p_warm
    # Strictly, once the cold replacement cannot carry its equal share: c*R < A/(W+1) = 60/4 = 15 req/s.
    if colder * 20.0 < 15.0:
        assert p_cold > 0.0
        if colder < warmer - 1e-6:
            assert p_cold > p_warm


@settings(max_examples=40, deadline=None)
@given(c=cold_fractions, t=warmups)
def test_routing_cannot_replace_admission_when_arrivals_need_the_warm_replacement(c: float, t: float) -> None:
    # A = (W+1) x R: the pool is short while the replacement warms, and neither policy ever drains the
    # backlog that builds up: only admission control (shedding) can.
    params = RampParams(cold_fraction=c, warmup_s=t, arrival=4 * 20.0)
    equal, rate = both(params)
    assert equal.final_depth_new > 0.0
    assert rate.final_depth_new > 0.0


@settings(max_examples=40, deadline=None)
@given(c=cold_fractions, t=warmups)
def test_both_policies_are_late_once_arrivals_exceed_the_warm_pool(c: float, t: float) -> None:
    equal, rate = both(RampParams(cold_fraction=c, warmup_s=t, arrival=1.1 * 4 * 20.0))
    assert equal.late > 0.0
    assert rate.late > 0.0


def test_runbook_case_with_arrivals_at_the_warm_capacity() -> None:
    # What the model actually says for the runbook's defaults at A = (W+1)R: the equal policy is late,
    # the rate policy keeps waits under D but carries a standing queue; a long cold warm-up makes both late.
    equal, rate = both(RampParams(arrival=80.0))
    assert equal.late > 0.0 and rate.late == 0.0 and rate.final_depth_new > 100.0
    equal, rate = both(RampParams(arrival=80.0, warmup_s=300.0))
    assert equal.late > 0.0 and rate.late > 0.0


def test_trace_has_one_wait_per_second_and_its_peak_is_the_reported_peak() -> None:
    trace = simulate_ramp_trace(RampParams(seconds=300), RampPolicy.EQUAL)
    assert len(trace.wait_new) == 300
    assert max(trace.wait_new) == trace.result.peak_wait_new


def test_replacement_rate_ramps_linearly_from_cold_to_warm() -> None:
    p = RampParams(warm_rate=20, cold_fraction=0.25, warmup_s=120)
    assert p.replacement_rate(0) == 5.0
    assert p.replacement_rate(60) == 12.5
    assert p.replacement_rate(120) == p.replacement_rate(500) == 20.0
    assert RampParams(warmup_s=0).replacement_rate(0) == 20.0


@pytest.mark.parametrize(
    "bad",
    [
        {"warm_rate": 0},
        {"warm_rate": -1},
        {"cold_fraction": 0},
        {"cold_fraction": 1.5},
        {"warmup_s": -1},
        {"deadline_s": 0},
        {"warm_replicas": 0},
        {"seconds": 0},
        {"arrival": -5},
        {"warm_rate": float("nan")},
    ],
)
def test_invalid_inputs_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        RampParams(**bad)  # type: ignore[arg-type]


@given(st.dictionaries(st.text(min_size=1, max_size=4), st.floats(min_value=0, max_value=1e6), min_size=1))
def test_rate_weights_are_proportional_and_sum_to_one(rates: dict[str, float]) -> None:
    weights = rate_weights(rates)
    assert set(weights) == set(rates)
    assert sum(weights.values()) == pytest.approx(1.0)
    total = sum(rates.values())
    if total > 0:
        for key, rate in rates.items():
            assert weights[key] == pytest.approx(rate / total, abs=1e-12)


def test_rate_weights_floor_gives_an_unmeasured_replacement_a_trickle() -> None:
    weights = rate_weights({"a": 20.0, "b": 20.0, "new": 0.0}, floor=0.05)
    assert weights["new"] == pytest.approx(0.05)
    assert weights["a"] == pytest.approx(0.475)
    assert sum(weights.values()) == pytest.approx(1.0)
    assert rate_weights({"a": 0.0, "b": 0.0}) == {"a": 0.5, "b": 0.5}
    assert rate_weights({}) == {}


@pytest.mark.parametrize(
    "rates,floor", [({"a": -1.0}, 0.0), ({"a": float("nan")}, 0.0), ({"a": 1.0, "b": 1.0}, 0.5)]
)
def test_rate_weights_refuse_nonsense(rates: dict[str, float], floor: float) -> None:
    with pytest.raises(ValueError):
        rate_weights(rates, floor=floor)


# --- plan_weights: one ramp step from two scrapes -------------------------------------------------


def _scrape(tokens: float) -> EngineSnapshot:
    return EngineSnapshot(generation_tokens_total=tokens)


def _step(established_tokens: float, new_tokens: float) -> RampPlan:
    before = {"old-a": _scrape(0), "old-b": _scrape(0), "new": _scrape(0)}
    after = {
        "old-a": _scrape(established_tokens),
        "old-b": _scrape(established_tokens),
        "new": _scrape(new_tokens),
    }
    return plan_weights(before, after, 10.0, ["new"], ttft_slo_s=2.0, warm_fraction=0.9)


def test_a_cold_replacement_in_a_busy_pool_gets_a_share_by_its_measured_rate() -> None:
    plan = _step(established_tokens=1000, new_tokens=200)  # 20 tok/s against 100 established
    assert not plan.all_warm
    assert plan.weights["new"] < plan.weights["old-a"] == plan.weights["old-b"]
    assert "20% warm" in plan.reason


def test_a_replacement_at_the_established_rate_is_warm_and_weights_return_to_equal() -> None:
    plan = _step(established_tokens=1000, new_tokens=950)
    assert plan.all_warm
    assert set(plan.weights.values()) == {1.0}


def test_an_idle_pool_has_nothing_to_ramp_so_its_replacement_counts_as_warm() -> None:
    """No traffic on the established replicas: there is no rate to match, and waiting for one would
    hold the recovery in its ramp until the ramp window ends."""
    plan = _step(established_tokens=0, new_tokens=0)
    assert plan.all_warm
    assert "idle pool" in plan.reason


def test_an_established_replica_missing_from_the_last_scrape_is_unknown_not_idle() -> None:
    """On a busy node one established engine's scrape failed at the interval's start: its rate is
    unknown. The other one serves 100 tok/s, so the cold replacement (20) keeps a small share; with
    only the unknown one read, nothing is called warm and the pool is not called idle."""
    before = {"old-b": _scrape(0), "new": _scrape(0)}
    after = {"old-a": _scrape(5000), "old-b": _scrape(1000), "new": _scrape(200)}
    plan = plan_weights(before, after, 10.0, ["new"], ttft_slo_s=2.0, warm_fraction=0.9)
    assert not plan.all_warm and "idle pool" not in plan.reason
    assert plan.weights["new"] < plan.weights["old-b"]
    only_unknown = plan_weights({"new": _scrape(0)}, after, 10.0, ["new"], ttft_slo_s=2.0, warm_fraction=0.9)
    assert not only_unknown.all_warm and "idle pool" not in only_unknown.reason


def test_without_an_established_replica_there_is_no_reference_and_nothing_is_called_warm() -> None:
    before, after = {"new": _scrape(0)}, {"new": _scrape(0)}
    plan = plan_weights(before, after, 10.0, ["new"], ttft_slo_s=2.0, warm_fraction=0.9)
    assert not plan.all_warm


def test_a_ramp_step_that_missed_an_established_engine_plans_on_no_less_than_the_warm_groups() -> None:
    # Four groups served warm (three survivors, the promoted spare); a ramp step read only two of them.
    measured, note = ramp_capacity_rps(15.0, 4, {"replacement": 0.5}, serving_groups=4)
    assert measured == pytest.approx(67.5) and note == ""
    missed, note = ramp_capacity_rps(15.0, 2, {"replacement": 0.0}, serving_groups=4)
    assert missed == pytest.approx(60.0) and "4 group(s)" in note


TTFT_BUCKETS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def _timed(tokens: float, ttft_s: float, requests: int = 100) -> EngineSnapshot:
    """A scrape whose TTFT histogram holds ``requests`` first tokens, all at about ``ttft_s``."""
    buckets = tuple(HistogramBucket(le=le, count=requests if ttft_s <= le else 0) for le in TTFT_BUCKETS)
    ttft = Histogram(buckets=buckets, sum=ttft_s * requests, count=requests)
    return EngineSnapshot(generation_tokens_total=tokens, ttft=ttft)


def test_a_replacement_slower_than_its_peers_is_backed_off_one_as_late_as_an_overloaded_pool_is_not() -> None:
    """The SLO is 2 s. A replacement at ~6 s while the established replicas answer within 1 s is
    cold: its share halves. The same 6 s while the established replicas are at ~12 s (the survivors
    hold a gap's backlog) is the pool overloaded: backing the replacement off would hand its share to
    replicas later than it, so its weight stays by its rate."""
    before = {"old-a": EngineSnapshot(), "old-b": EngineSnapshot(), "new": EngineSnapshot()}

    def step(peer_ttft_s: float) -> RampPlan:
        after = {
            "old-a": _timed(1000, peer_ttft_s),
            "old-b": _timed(1000, peer_ttft_s),
            "new": _timed(500, 6.0),
        }
        return plan_weights(before, after, 10.0, ["new"], ttft_slo_s=2.0, warm_fraction=0.9)

    cold = step(peer_ttft_s=1.0)
    assert cold.backoff["new"] == pytest.approx(0.5) and "backing off" in cold.reason
    overloaded = step(peer_ttft_s=12.0)
    assert overloaded.backoff["new"] == pytest.approx(1.0) and "backing off" not in overloaded.reason
    assert "the pool is overloaded" in overloaded.reason
    assert overloaded.weights["new"] > cold.weights["new"]


def test_by_deadline_a_replacement_no_slower_than_overloaded_peers_takes_their_share() -> None:
    """After a gap the established replicas hold its backlog, over the 2 s SLO. In engines that serve
    by deadline, a replacement whose cache is still cold (it served 300 tokens/s against their 1,000)
    but that answers no slower than them is handed their share: weighting it by its rate would keep
    the backlog on the replicas that are later. With peers within the SLO, or engines serving in
    arrival order, the same replacement is weighted by its rate, as the ramp always did."""
    before = {"old-a": EngineSnapshot(), "old-b": EngineSnapshot(), "new": EngineSnapshot()}

    def step(peer_ttft_s: float, by_deadline: bool = True) -> RampPlan:
        after = {
            "old-a": _timed(1000, peer_ttft_s),
            "old-b": _timed(1000, peer_ttft_s),
            "new": _timed(300, 1.5),
        }
        return plan_weights(
            before, after, 10.0, ["new"], ttft_slo_s=2.0, warm_fraction=0.9, by_deadline=by_deadline
        )

    arrival_order = step(peer_ttft_s=12.0, by_deadline=False)
    assert arrival_order.weights["new"] == pytest.approx(0.3 * arrival_order.weights["old-a"], rel=0.05)
    backlog = step(peer_ttft_s=12.0)
    assert backlog.weights["new"] == pytest.approx(backlog.weights["old-a"]), backlog.weights
    assert not backlog.all_warm and "weighted at the established rate" in backlog.reason, backlog.reason
    calm = step(peer_ttft_s=1.0)
    assert calm.weights["new"] == pytest.approx(0.3 * calm.weights["old-a"], rel=0.05), calm.weights
