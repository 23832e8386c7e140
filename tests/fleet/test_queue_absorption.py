"""Step 3: the survivors' queues absorb what they can of a capacity gap before anything is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.recovery import ServingObjectives
from fleet.shedding import QueueRoom, decide_readmission, decide_shedding
from fleet.vocabulary import Tier

from .fleets import CALM


def _room(backlog: float, budget: float = 2.0, horizon: float = 4.0) -> QueueRoom:
    return QueueRoom(wait_budget_s=budget, backlog=backlog, horizon_s=horizon)


def test_empty_queues_absorb_a_small_gap_and_nothing_is_refused() -> None:
    # 3 x 20 = 60 req/s at 90 % = 54; arrivals 70: a 16 req/s gap. Empty queues hold 54 x 2 s = 108
    # requests, 27 req/s over the 4 s until the next look: the whole gap queues, nothing is refused.
    d = decide_shedding(
        arrival_rps=70,
        survivors=CALM,
        lost_capacity_rps=20,
        per_group_capacity_rps=20,
        keep_armed=True,
        queues=_room(0),
    )
    assert d.deficit_fraction == pytest.approx(1 - 54 / 70)
    assert d.shed_fraction == 0 and not d.shedding
    assert d.absorbed_rps == pytest.approx(16.0)
    assert d.admission.queue_bound == 5  # protection stays armed
    assert "room for 108 more within the 2 s wait budget" in d.reason, d.reason
    assert "nothing refused (the queues absorb the gap)" in d.reason, d.reason


def test_as_the_queues_fill_the_refused_share_rises_to_the_gap() -> None:
    # Room 108 - 80 = 28 requests = 7 req/s of the 16 req/s gap: 9 req/s (12.9 % of arrivals) refused.
    partly = decide_readmission(70, 60, "queues re-read", warm_floor_restored=False, queues=_room(80))
    assert partly.absorbed_rps == pytest.approx(7.0)
    assert partly.shed_fraction == pytest.approx(9 / 70, abs=1e-3)
    assert partly.tiers_touched == (Tier.SHEDDABLE,)
    assert "the gap the queues cannot absorb" in partly.reason, partly.reason
    full = decide_readmission(70, 60, "queues re-read", warm_floor_restored=False, queues=_room(150))
    assert full.absorbed_rps == 0
    assert full.shed_fraction == pytest.approx(full.deficit_fraction, abs=1e-4)
    assert "(the gap, lowest tiers first)" in full.reason, full.reason


def test_without_a_queue_room_the_gap_is_refused_at_once() -> None:
    d = decide_readmission(70, 60, "spare promoted", warm_floor_restored=False)
    assert d.absorbed_rps == 0 and d.shed_fraction == pytest.approx(d.deficit_fraction, abs=1e-4)


def test_the_wait_budget_defaults_to_the_ttft_slo_and_zero_turns_absorption_off() -> None:
    assert ServingObjectives(ttft_p99_slo_s=1.5).wait_budget_s == 1.5
    assert ServingObjectives(ttft_p99_slo_s=1.5, queue_wait_budget_s=4).wait_budget_s == 4
    assert ServingObjectives(queue_wait_budget_s=0).wait_budget_s == 0
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        ServingObjectives(queue_wait_budget_s=-1)
    with pytest.raises(ValueError, match="greater than 0"):
        QueueRoom(wait_budget_s=2, backlog=0, horizon_s=0)


def test_engines_that_serve_by_deadline_let_the_queues_hold_the_lowest_tier_until_its_deadline() -> None:
    """In arrival order a queued request delays every later one, so the queues may hold a gap for the
    TTFT SLO; in deadline order (vLLM's priority scheduling, the deadline as priority) a request waits
    only behind those due sooner, so they may hold it for the longest tier deadline. A gap that arrival
    order must refuse is then absorbed: in a world serving by deadline, the world's grade counted such
    refusals as over-shed (README "Graded by the world")."""
    deadlines = {Tier.CRITICAL: 5.0, Tier.STANDARD: 10.0, Tier.SHEDDABLE: 20.0}
    arrival = ServingObjectives(ttft_p99_slo_s=2.0, tier_deadlines_s=deadlines)
    deadline = ServingObjectives(
        ttft_p99_slo_s=2.0, engine_queue_order="deadline", tier_deadlines_s=deadlines
    )
    assert arrival.wait_budget_s == 2.0 and deadline.wait_budget_s == 20.0
    explicit = deadline.model_copy(update={"queue_wait_budget_s": 15.0})
    assert explicit.wait_budget_s == 15.0  # an operator's own budget still wins

    # 60 req/s at 90 % = 54 usable against 70 arriving: 16 req/s over. 200 requests already queued.
    def decided(objectives: ServingObjectives) -> float:
        room = _room(200, budget=objectives.wait_budget_s, horizon=4.0)
        return decide_readmission(
            70, 60, "queues re-read", warm_floor_restored=False, queues=room
        ).shed_fraction

    assert decided(arrival) == pytest.approx(1 - 54 / 70, abs=1e-3)  # 54 x 2 s < 200 queued: the whole gap
    assert decided(deadline) == 0  # 54 x 20 s - 200 = 880 more: 220 req/s of room over the next 4 s

    with pytest.raises(ValueError, match="needs tier_deadlines_s"):
        ServingObjectives(engine_queue_order="deadline")
    with pytest.raises(ValueError, match="must be positive seconds"):
        ServingObjectives(tier_deadlines_s={Tier.SHEDDABLE: 0})


@settings(max_examples=300, deadline=None)
@given(
    arrivals=st.floats(1, 500),
    capacity=st.floats(0, 500),
    backlog=st.floats(0, 2000),
    budget=st.floats(0, 30),
    horizon=st.floats(0.1, 60),
)
def test_absorption_never_refuses_more_than_the_gap_and_refuses_less_with_more_room(
    arrivals: float, capacity: float, backlog: float, budget: float, horizon: float
) -> None:
    plain = decide_readmission(arrivals, capacity, "x", warm_floor_restored=False)
    room = _room(backlog, budget, horizon)
    absorbing = decide_readmission(arrivals, capacity, "x", warm_floor_restored=False, queues=room)
    assert absorbing.deficit_fraction == plain.deficit_fraction
    assert absorbing.shed_fraction <= plain.shed_fraction + 1e-9
    assert absorbing.absorbed_rps <= arrivals * plain.deficit_fraction + 1e-9
    # What is absorbed is at most the queues' room over the horizon.
    assert absorbing.absorbed_rps <= room.absorbable_rps(capacity * 0.9) + 1e-9
    # A fuller queue never refuses less.
    fuller = decide_readmission(
        arrivals, capacity, "x", warm_floor_restored=False, queues=_room(backlog + 10, budget, horizon)
    )
    assert fuller.shed_fraction >= absorbing.shed_fraction - 1e-9
    # Critical is never refused, absorbing or not.
    assert absorbing.admission.shed_share(Tier.CRITICAL) == 0
    assert absorbing.admission.queue_bound is not None  # armed until the warm floor is restored
