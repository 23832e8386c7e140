"""Arrivals during a loss: counted by the gateway where it keeps a count, never read off a backlog."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet.arrivals import (
    PRE_LOSS_GAP_S,
    PRE_LOSS_WINDOW_S,
    ArrivalTally,
    CounterReading,
    arrival_rate,
    arrivals_before,
    planned_arrivals,
)
from fleet.engine_metrics import EngineSnapshot
from fleet.gateway import Admission, RouterState
from fleet.incident import LossReport, PoolRef, PreLossArrivals
from fleet.observation import PoolObservation
from fleet.vocabulary import Tier
from tests.fleet.fleets import group, snapshot


def _obs(at: float, engines: dict[str, EngineSnapshot], admitted: int | None) -> PoolObservation:
    return PoolObservation(
        snapshot=snapshot([group("a"), group("b")]).model_copy(update={"observed_at": at}),
        engines=engines,
        gateway_admitted_total=admitted,
        router_label="fleetmend.io/serving",
    )


# The lost group's 8 streams were retried onto the survivor in the second between two scrapes.
BEFORE = {"a": EngineSnapshot(request_success_total=100, running=4, waiting=0)}
AFTER = {"a": EngineSnapshot(request_success_total=120, running=4, waiting=8)}


def test_a_backlog_of_retried_requests_reads_as_arrivals_from_the_engines_but_not_from_the_gateway() -> None:
    from_engines, how = arrival_rate(_obs(0.0, BEFORE, None), _obs(1.0, AFTER, None), 1.0, ["b"])
    assert (
        from_engines == 28.0 and "queue growth" in how
    )  # 20 completions + 8 queued: a one-off, read as a rate
    counted, how = arrival_rate(_obs(0.0, BEFORE, 1000), _obs(1.0, AFTER, 1020), 1.0, ["b"])
    assert counted == 20.0 and how == "counted by the gateway"


def test_what_admission_refused_is_added_back_to_the_gateways_count() -> None:
    counted, _ = arrival_rate(_obs(0.0, {}, 0), _obs(4.0, {}, 60), 4.0, [], refused_share=0.25)
    assert counted == 20.0  # 15 req/s admitted while a quarter was refused


def test_one_side_without_a_count_falls_back_to_the_engines() -> None:
    rate, how = arrival_rate(_obs(0.0, BEFORE, 1000), _obs(1.0, AFTER, None), 1.0, ["b"])
    assert rate == 28.0 and "gateway keeps no count" in how


@given(
    rate=st.floats(0.0, 500.0),
    seconds=st.floats(0.5, 30.0),
    refused=st.floats(0.0, 0.95),
)
def test_the_counted_rate_is_the_offered_rate_whatever_was_refused(
    rate: float, seconds: float, refused: float
) -> None:
    admitted = round(rate * (1 - refused) * seconds)
    counted, _ = arrival_rate(
        _obs(0.0, {}, 0), _obs(seconds, {}, admitted), seconds, [], refused_share=refused
    )
    assert abs(counted - rate) <= 1.0 / (seconds * (1 - refused)) + 1e-9  # one request of rounding


def test_the_window_is_between_the_two_readings_of_the_counter_not_the_two_observations() -> None:
    # The first look read the gateway at t=0 and then spent 1.5 s probing engines; the second read it at t=3.
    first = _obs(1.5, {}, 0).model_copy(update={"gateway_counted_at": 0.0})
    second = _obs(3.2, {}, 60).model_copy(update={"gateway_counted_at": 3.0})
    counted, _ = arrival_rate(first, second, 1.7, [])
    assert counted == 20.0


def test_a_count_from_the_first_look_wins_and_a_counter_that_went_backwards_is_not_a_rate() -> None:
    first = _obs(0.0, {}, 0)
    before, after = _obs(4.0, BEFORE, 80), _obs(5.0, AFTER, 100)
    assert arrival_rate(before, after, 1.0, ["b"], counted_since=first)[0] == 20.0  # 100 over 5 s
    # Envoy restarted between the first look and now: its counter starts again from 0.
    restarted_before, restarted_after = _obs(4.0, BEFORE, 3), _obs(5.0, AFTER, 23)
    rate, how = arrival_rate(restarted_before, restarted_after, 1.0, ["b"], counted_since=_obs(0.0, {}, 900))
    assert (rate, how) == (20.0, "counted by the gateway")  # the window since the restart
    rate, how = arrival_rate(_obs(0.0, BEFORE, 50), _obs(1.0, AFTER, 2), 1.0, ["b"])
    assert rate == 28.0 and "queue growth" in how  # restarted between the two scrapes: the engines say


def test_the_tally_scales_each_stretch_by_the_share_refused_during_it_and_skips_a_restart() -> None:
    tally = ArrivalTally().add(_obs(0.0, {}, 100), 0.0)
    tally = tally.add(_obs(2.0, {}, 140), 0.0)  # 20 req/s, nothing refused
    tally = tally.add(_obs(4.0, {}, 170), 0.25)  # 15 admitted/s while a quarter was refused: 20 arrived/s
    assert tally.rate(min_seconds=5.0) is None  # 4 s counted: not long enough yet
    assert tally.rate(min_seconds=4.0) == 20.0
    # The gateway restarted (its counter went back to 0): the stretch across the restart counts nothing.
    tally = tally.add(_obs(6.0, {}, 5), 0.25)
    tally = tally.add(_obs(8.0, {}, 35), 0.25)  # 15 admitted/s at a quarter refused: 20/s again
    assert tally.seconds == 6.0 and tally.rate(min_seconds=5.0) == 20.0
    # An observation without a count changes nothing.
    assert tally.add(_obs(9.0, {}, None), 0.0) == tally


@given(
    rate=st.floats(1.0, 500.0),
    refused=st.lists(st.floats(0.0, 0.9), min_size=1, max_size=20),
)
def test_a_steady_arrival_rate_is_counted_whatever_admission_refused(
    rate: float, refused: list[float]
) -> None:
    tally = ArrivalTally().add(_obs(0.0, {}, 0), 0.0)
    total = 0.0
    for i, share in enumerate(refused, start=1):
        total += rate * 1.0 * (1.0 - share)  # what the gateway let through in that second
        tally = tally.add(_obs(float(i), {}, round(total * 1000)), share)
    measured = tally.rate(min_seconds=1.0)
    assert measured is not None and abs(measured / 1000 - rate) <= 0.01 * rate + 0.01


def test_the_keeper_counts_on_what_the_replicas_served_only_when_it_is_more_than_the_estimate() -> None:
    from fleet.service_rate import capacity_to_count_on, smoothed

    assert capacity_to_count_on(15.0, None) == (15.0, "")
    assert capacity_to_count_on(15.0, 12.0) == (15.0, "")  # idle replicas serve less than they can
    capacity, note = capacity_to_count_on(15.0, 20.0)
    assert capacity == 20.0 and note == "they served 20.0 req/s (more than the 15.0 estimated)"
    assert smoothed(None, 8.0) == 8.0 and smoothed(10.0, 20.0) == 15.0


@given(
    st.floats(0.5, 60.0),
    st.floats(0.5, 5.0),
    st.floats(0.5, 120.0),
    st.booleans(),
    st.floats(0.0, 50.0),
)
def test_the_keeper_backs_off_only_while_steady_and_never_past_its_cap(
    current: float, base: float, cap: float, moved: bool, backlog: float
) -> None:
    from fleet.survivor_load import next_admission_look

    wait = next_admission_look(current, base, cap, admission_moved=moved, backlog=backlog)
    if moved or backlog >= 1.0:
        assert wait == base  # the queues are moving: look again soon
    else:
        assert base <= wait <= max(base, cap)
        assert wait <= max(base, 2 * current)  # at most doubles per steady look
        if base <= current <= cap:
            assert wait >= current  # a steady look never shortens the wait


def test_steady_looks_double_the_wait_to_the_cap_and_movement_resets_it() -> None:
    from fleet.survivor_load import next_admission_look

    waits, wait = [], 2.0
    for _ in range(6):
        wait = next_admission_look(wait, 2.0, 30.0, admission_moved=False, backlog=0.0)
        waits.append(wait)
    assert waits == [4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert next_admission_look(30.0, 2.0, 30.0, admission_moved=False, backlog=3.0) == 2.0
    assert next_admission_look(30.0, 2.0, 30.0, admission_moved=True, backlog=0.0) == 2.0


def test_a_recovery_waiting_for_an_operator_or_with_a_long_history_looks_less_often() -> None:
    """A recovery stuck at an operator gate under load must not fill its history with looks every 2 s."""
    from fleet.survivor_load import PARKED_FACTOR, next_admission_look

    # Waiting requests keep the base interval while the procedure acts, not while it waits for a human.
    assert next_admission_look(2.0, 2.0, 30.0, admission_moved=False, backlog=4.0) == 2.0
    assert (
        next_admission_look(2.0, 2.0, 30.0, admission_moved=False, backlog=4.0, awaiting_operator=True) == 4.0
    )
    # A moving admission is still followed closely while waiting.
    assert (
        next_admission_look(16.0, 2.0, 30.0, admission_moved=True, backlog=4.0, awaiting_operator=True) == 2.0
    )
    # Temporal suggests continuing as new: parked, whatever moves (about 130 history events an hour).
    for moved in (False, True):
        parked = next_admission_look(2.0, 2.0, 30.0, admission_moved=moved, backlog=9.0, history_large=True)
        assert parked == PARKED_FACTOR * 30.0
    events_per_look = 11  # activity 3, timer 2, two workflow tasks 6
    assert 3600 / (PARKED_FACTOR * 30.0) * events_per_look * 24 * 4 < 51_200 - 4_096  # four days of waiting


def test_the_keepers_looks_carry_the_count_and_the_served_rate_from_one_look_to_the_next() -> None:
    """One look after another (in the workflow or inside a watch): the same fold of ``keeper_look``."""
    from fleet.admission_look import KeeperMemory, keeper_look, keeper_queue_room, keeper_readmission

    looks = [
        _obs(0.0, {"a": EngineSnapshot(request_success_total=0, running=4, waiting=0)}, 0),
        _obs(3.0, {"a": EngineSnapshot(request_success_total=60, running=4, waiting=5)}, 90),
        _obs(6.0, {"a": EngineSnapshot(request_success_total=120, running=4, waiting=9)}, 180),
    ]
    memory = KeeperMemory()
    seen = []
    for obs in looks:
        look = keeper_look(memory, obs, ["b"], refused_share=0.0, planned_capacity_rps=10.0)
        memory = look.memory
        seen.append(look)
    first, second, third = seen
    # One look: no served rate yet, and too short a count for arrivals: the plan's capacity.
    assert first.arrival_rps is None and first.capacity_rps == 10.0
    # Two: the survivor served 20 req/s, more than planned, so that is the capacity counted on.
    assert second.capacity_rps == 20.0 and "served" in second.change
    # Six seconds counted by the gateway: 30 req/s arrive, 9 wait; with a 0.5 s wait budget the queues are
    # nearly full, and the gap they cannot absorb is refused.
    assert third.arrival_rps == 30.0 and third.backlog == 9.0
    decision = keeper_readmission(
        third.arrival_rps,
        third.capacity_rps,
        third.change,
        backlog=third.backlog,
        wait_budget_s=0.5,
        look_s=1.0,
        target_utilization=0.9,
    )
    assert decision.shed_fraction > 0, decision.reason
    # A wait budget of 0 gives the queues no room at all.
    assert keeper_queue_room(0.0, 9.0, 1.0) is None


# -- the rate before the loss (the fast path's readings of the gateway's counter) ------------------


def _steady(rate: float, until: float, every: float = 1.0) -> list[CounterReading]:
    return [
        CounterReading(at=t * every, total=round(rate * t * every)) for t in range(int(until / every) + 1)
    ]


def test_the_rate_before_the_loss_leaves_out_the_burst_of_cut_streams_sent_again() -> None:
    # 67.5 req/s for 20 s; the fault at 20 s cuts 64 streams whose clients send them again at once,
    # and the loss is detected at 21 s. The count since the fault reads them as a rate; the window
    # that ended 2 s before the detection does not hold them.
    readings = [*_steady(67.5, 20.0), CounterReading(at=21.0, total=round(67.5 * 21) + 64)]
    pre = arrivals_before(readings, detected_at=21.0)
    assert pre is not None
    assert pre.rps == pytest.approx(67.5, rel=0.01) and pre.seconds == pytest.approx(PRE_LOSS_WINDOW_S)
    assert pre.ended_before_s == pytest.approx(2.0)
    since_the_fault = (readings[-1].total - readings[-2].total) / 1.0
    assert since_the_fault > 1.9 * 67.5  # what a one-second count after the loss would plan on


def test_too_short_a_count_before_the_loss_is_no_rate_and_a_restart_starts_the_window_anew() -> None:
    assert arrivals_before(_steady(50.0, 4.0), detected_at=4.5) is None  # 2 s counted, under PRE_LOSS_MIN_S
    assert arrivals_before([], detected_at=100.0) is None
    # The gateway restarted at 6 s (its counter fell to 0): only the readings after count.
    restarted = [*_steady(50.0, 5.0), *(CounterReading(at=6.0 + t, total=40 * t) for t in range(8))]
    pre = arrivals_before(restarted, detected_at=15.0)
    assert pre is not None and pre.rps == pytest.approx(40.0) and pre.seconds == pytest.approx(7.0)


@given(
    rate=st.floats(min_value=1.0, max_value=500.0),
    burst=st.integers(min_value=0, max_value=5000),
    detect_after=st.floats(min_value=0.1, max_value=PRE_LOSS_GAP_S - 0.01),
)
def test_no_burst_after_the_fault_moves_the_rate_before_it(
    rate: float, burst: int, detect_after: float
) -> None:
    # The fault at 30 s; the cut streams come back at 30.1 s and the fast path keeps reading (every
    # 0.5 s) until the loss's first sign, up to 2 s later.
    fault = 30.0
    after = [
        CounterReading(at=at, total=round(rate * at) + burst)
        for at in (fault + 0.1, fault + 0.6, fault + 1.1, fault + 1.6)
        if at <= fault + detect_after
    ]
    pre = arrivals_before([*_steady(rate, fault), *after], detected_at=fault + detect_after)
    assert pre is not None and pre.rps == pytest.approx(rate, rel=0.05, abs=0.2)


def _report(at: float, pre: PreLossArrivals | None) -> LossReport:
    return LossReport(
        pool=PoolRef(namespace="inference", service="llama"),
        fingerprint=f"fp-{at}",
        alert_name="FleetmendFastPathLoss",
        observed_at=at,
        source="fastpath",
        arrivals_before=pre,
    )


def test_the_first_shed_plans_on_the_earliest_reports_count_unless_the_gateway_was_already_refusing() -> None:
    early, late = (
        PreLossArrivals(rps=r, seconds=8.0, ended_at=t, ended_before_s=2.0)
        for r, t in ((60.0, 8.0), (90.0, 10.0))
    )
    reports = [_report(12.0, late), _report(10.0, early), _report(11.0, None)]
    assert planned_arrivals(reports, None, looked_at=13.0) == early
    assert (
        planned_arrivals([_report(10.0, None)], None, looked_at=13.0) is None
    )  # the alert path's carry none
    calm = RouterState(pool="inference/llama", version=0)
    assert planned_arrivals(reports, calm, looked_at=13.0) == early
    # A report that waited in the incident behind another recovery: its count is too old to plan on.
    assert planned_arrivals(reports, calm, looked_at=39.0) == late
    assert planned_arrivals(reports, calm, looked_at=41.0) is None
    shedding = RouterState(
        pool="inference/llama", version=0, admission=Admission(partial_shed={Tier.SHEDDABLE: 0.3})
    )
    assert planned_arrivals(reports, shedding, looked_at=13.0) is None  # it let through less than arrived


def test_a_load_that_began_inside_the_window_is_counted_from_its_start_and_stale_readings_are_none() -> None:
    # Idle until 4 s, then 60 req/s; the window (up to 8 s, ending 2 s before the first sign at 12 s)
    # would reach back to 2 s: the idle readings are left out, not averaged in.
    readings = [CounterReading(at=float(t), total=max(0, 60 * (t - 4))) for t in range(13)]
    pre = arrivals_before(readings, detected_at=12.0)
    assert pre is not None and pre.rps == pytest.approx(60.0) and pre.seconds == pytest.approx(6.0)
    # The fast path stopped reading 30 s before the loss (no Envoy answered): nothing to plan on.
    assert arrivals_before(readings, detected_at=42.0) is None
