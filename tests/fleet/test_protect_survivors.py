"""Steps 3-6: shedding by the arithmetic of lost capacity, retry budget, spare choice, lead time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.gateway import Admission
from fleet.leadtime import LeadTimeConfig, PastRecovery, estimate_lead_time
from fleet.pool import GroupRole
from fleet.retry_budget import decide_retry_policy
from fleet.shedding import (
    PressureThresholds,
    ShedLevel,
    SurvivorLoad,
    account_shedding,
    admission_changed,
    can_lift_shedding,
    decide_readmission,
    decide_shedding,
    estimate_arrivals,
    normalised_mix,
    pool_capacity_rps,
    refused_fraction,
)
from fleet.spares import pick_spares
from fleet.vocabulary import SHED_ORDER, Tier

from .fleets import CALM, group, node, snapshot


def test_no_shedding_when_survivors_carry_the_load() -> None:
    d = decide_shedding(arrival_rps=45, survivors=CALM, lost_capacity_rps=20, per_group_capacity_rps=20)
    assert d.shed_tiers == () and d.admission.shed_tiers == [] and d.admission.queue_bound is None
    assert "no shedding needed" in d.reason


def test_lost_capacity_refuses_exactly_the_gap_from_the_lowest_tier_with_the_arithmetic_in_the_reason() -> (
    None
):
    # 3 survivors x 20 = 60 req/s at 90 % = 54; arrivals 70 -> 22.9 % cannot be carried; sheddable is 30 %,
    # so 76.2 % of sheddable requests are refused (22.9 % of arrivals), not all of them.
    d = decide_shedding(arrival_rps=70, survivors=CALM, lost_capacity_rps=20, per_group_capacity_rps=20)
    assert d.shed_tiers == () and d.tiers_touched == (Tier.SHEDDABLE,)
    assert d.partial_shed == {Tier.SHEDDABLE: pytest.approx((1 - 54 / 70) / 0.3, abs=1e-4)}
    assert d.admission.partial_shed == d.partial_shed and d.admission.shed_tiers == []
    assert d.admission.queue_bound == 5
    assert d.deficit_fraction == pytest.approx(1 - 54 / 70)
    assert d.shed_fraction == pytest.approx(d.deficit_fraction, abs=1e-4)
    assert refused_fraction(d.admission) == pytest.approx(d.deficit_fraction, abs=1e-4)
    assert "arrivals 70.0 req/s" in d.reason and "capacity 60.0 req/s at 90%" in d.reason
    assert "76.2% of sheddable (30% of arrivals) = 22.9% of arrivals" in d.reason, d.reason
    assert d.residual_shortfall_rps == pytest.approx(0.0, abs=1e-3)


def test_a_gap_past_the_lowest_tier_refuses_it_whole_and_part_of_the_next() -> None:
    # The figure: 32 % of arrivals cannot be carried -> sheddable 30 % whole + 4 % of standard (2 %).
    survivors = [SurvivorLoad(group_id=f"g{i}", waiting=0, kv_usage=0.4) for i in range(3)]
    d = decide_shedding(
        arrival_rps=100, survivors=survivors, lost_capacity_rps=20, per_group_capacity_rps=68 / 2.7
    )
    assert d.deficit_fraction == pytest.approx(0.32)
    assert d.shed_tiers == (Tier.SHEDDABLE,) and d.partial_shed == {Tier.STANDARD: pytest.approx(0.04)}
    assert d.shed_fraction == pytest.approx(0.32)
    assert "sheddable 30% whole + 4.0% of standard (50% of arrivals) = 32.0% of arrivals" in d.reason, (
        d.reason
    )


def test_bigger_loss_sheds_standard_too_but_never_critical() -> None:
    survivors = CALM[:1]
    d = decide_shedding(arrival_rps=100, survivors=survivors, lost_capacity_rps=60, per_group_capacity_rps=20)
    assert d.shed_tiers == (Tier.SHEDDABLE, Tier.STANDARD) and d.partial_shed == {}
    assert Tier.CRITICAL not in d.shed_tiers
    assert d.residual_shortfall_rps == pytest.approx(100 * 0.2 - 18)  # critical 20 req/s vs 18 usable
    assert "critical traffic is not shed" in d.reason


def test_thrash_arms_the_queue_bound_but_refuses_nothing_when_the_arithmetic_says_it_fits() -> None:
    thrashing = [
        SurvivorLoad(
            group_id="g0", waiting=9, running=30, kv_usage=0.97, preemptions_per_s=3, waiting_delta=4
        ),
        *CALM[1:],
    ]
    d = decide_shedding(arrival_rps=30, survivors=thrashing, lost_capacity_rps=20, per_group_capacity_rps=20)
    assert d.thrashing == ("g0",)
    assert not d.shedding and d.admission.queue_bound == 5
    assert "thrashing: g0" in d.reason and "queue bound 5 stays armed" in d.reason


def test_a_recovery_keeps_the_queue_bound_armed_at_zero_gap() -> None:
    d = decide_shedding(45, CALM, lost_capacity_rps=20, per_group_capacity_rps=20, keep_armed=True)
    assert not d.shedding and d.admission == Admission(queue_bound=5)
    assert "warm floor is not restored" in d.reason


def test_readmission_follows_the_capacity_back_and_keeps_protection_until_the_floor_is_restored() -> None:
    gap = decide_readmission(100, 75.0, "spare not yet promoted", warm_floor_restored=False)
    assert gap.shedding and gap.shed_fraction == pytest.approx(1 - 67.5 / 100, abs=1e-4)
    covered = decide_readmission(100, 120.0, "spare promoted", warm_floor_restored=False)
    assert not covered.shedding and covered.admission == Admission(queue_bound=5)
    assert covered.reason.startswith("spare promoted; arrivals 100.0 req/s vs capacity 120.0 req/s")
    restored = decide_readmission(100, 120.0, "replacement warm", warm_floor_restored=True)
    assert restored.admission == Admission() and "no shedding needed" in restored.reason


def test_admission_is_re_applied_only_when_the_level_moves_or_protection_changes() -> None:
    armed = Admission(queue_bound=5)
    a = Admission(partial_shed={Tier.SHEDDABLE: 0.5}, queue_bound=5)  # 15 % of arrivals
    b = Admission(partial_shed={Tier.SHEDDABLE: 0.52}, queue_bound=5)  # 15.6 %: a wobble
    c = Admission(partial_shed={Tier.SHEDDABLE: 0.54}, queue_bound=5)  # 16.2 %
    assert not admission_changed(a, b)
    assert admission_changed(a, c)
    assert admission_changed(a, armed) and admission_changed(armed, a)
    assert admission_changed(armed, Admission()) and not admission_changed(armed, armed)


def test_pool_capacity_counts_new_replicas_at_their_warmth() -> None:
    assert pool_capacity_rps(20, 4) == 80
    assert pool_capacity_rps(20, 4, {"new-a": 0.5, "new-b": 1.7}) == pytest.approx(110)
    with pytest.raises(ValueError):
        pool_capacity_rps(-1, 4)


_mixes = st.fixed_dictionaries(
    {
        Tier.CRITICAL: st.floats(min_value=0.0, max_value=1.0),
        Tier.STANDARD: st.floats(min_value=0.01, max_value=1.0),
        Tier.SHEDDABLE: st.floats(min_value=0.01, max_value=1.0),
    }
)


@settings(max_examples=300, deadline=None)
@given(
    arrival=st.floats(min_value=0.1, max_value=1000),
    capacity=st.floats(min_value=0, max_value=1500),
    mix=_mixes,
)
def test_refused_share_of_arrivals_is_the_gap_lowest_tiers_first(
    arrival: float, capacity: float, mix: dict[Tier, float]
) -> None:
    d = decide_readmission(arrival, capacity, "capacity change", warm_floor_restored=False, tier_mix=mix)
    shares = normalised_mix(mix)
    coverable = sum(shares[t] for t in SHED_ORDER)
    gap = max(0.0, (arrival - 0.9 * capacity) / arrival)
    assert d.deficit_fraction == pytest.approx(gap, abs=1e-9)
    refused = refused_fraction(d.admission, mix)
    # Exactly the gap (up to the gateway's share rounding) when non-critical tiers can cover it.
    assert refused == pytest.approx(min(gap, coverable), abs=1e-4)
    assert d.admission.shed_share(Tier.CRITICAL) == 0.0
    # Lowest tiers first: a tier is touched only when every lower one is refused whole.
    touched = [t for t in SHED_ORDER if d.admission.shed_share(t) > 0]
    assert touched == list(SHED_ORDER[: len(touched)])
    for lower in touched[:-1]:
        assert d.admission.shed_share(lower) == 1.0
    assert len(d.partial_shed) <= 1
    if gap == 0:
        assert not d.shedding and refused == 0.0 and d.admission.queue_bound == 5


@settings(max_examples=200, deadline=None)
@given(
    arrival=st.floats(min_value=0.1, max_value=1000),
    capacity=st.floats(min_value=0, max_value=1500),
    more=st.floats(min_value=0, max_value=500),
    mix=_mixes,
)
def test_refused_share_never_rises_when_capacity_rises(
    arrival: float, capacity: float, more: float, mix: dict[Tier, float]
) -> None:
    low = decide_readmission(arrival, capacity, "before", warm_floor_restored=False, tier_mix=mix)
    high = decide_readmission(arrival, capacity + more, "after", warm_floor_restored=False, tier_mix=mix)
    assert refused_fraction(high.admission, mix) <= refused_fraction(low.admission, mix) + 1e-9
    for tier in SHED_ORDER:
        assert high.admission.shed_share(tier) <= low.admission.shed_share(tier) + 1e-9


@settings(max_examples=200, deadline=None)
@given(
    arrival=st.floats(min_value=0, max_value=1000),
    n=st.integers(min_value=0, max_value=8),
    cap=st.floats(min_value=1, max_value=100),
)
def test_shedding_covers_the_deficit_in_order_and_never_sheds_critical(
    arrival: float, n: int, cap: float
) -> None:
    survivors = [SurvivorLoad(group_id=f"g{i}", waiting=0, kv_usage=0.1) for i in range(n)]
    d = decide_shedding(
        arrival_rps=arrival, survivors=survivors, lost_capacity_rps=cap, per_group_capacity_rps=cap
    )
    assert Tier.CRITICAL not in d.shed_tiers and Tier.CRITICAL not in d.partial_shed
    assert d.shed_tiers == SHED_ORDER[: len(d.shed_tiers)]  # lowest tiers first, no gaps
    if d.shed_fraction < d.deficit_fraction - 1e-4:
        assert d.shed_tiers == SHED_ORDER  # only short when everything sheddable is already shed
    if d.deficit_fraction == 0:
        assert not d.shedding and d.admission == Admission()


def test_bad_shedding_inputs() -> None:
    with pytest.raises(ValueError):
        decide_shedding(arrival_rps=-1, survivors=CALM, lost_capacity_rps=0, per_group_capacity_rps=1)
    with pytest.raises(ValueError):
        decide_shedding(10, CALM, 0, 1, tier_mix={Tier.CRITICAL: 0.0})


def test_shedding_is_lifted_only_when_floor_restored_replacement_warm_and_survivors_calm() -> None:
    assert not can_lift_shedding(3, 4, True, CALM).lift
    assert "warm floor not restored: 3 of 4" in can_lift_shedding(3, 4, True, CALM).reason
    assert not can_lift_shedding(4, 4, False, CALM).lift
    hot = [SurvivorLoad(group_id="g9", waiting=12, kv_usage=0.5)]
    assert not can_lift_shedding(4, 4, True, hot).lift
    assert can_lift_shedding(4, 4, True, CALM).lift


def test_retry_budget_from_queue_headroom_before_first_byte_only() -> None:
    survivors = [
        SurvivorLoad(group_id="g0", waiting=1, running=10, kv_usage=0.5),
        SurvivorLoad(group_id="g1", waiting=2, running=10, kv_usage=0.6),
        SurvivorLoad(group_id="g2", waiting=0, running=10, kv_usage=0.85),  # at the KV ceiling: no headroom
    ]
    d = decide_retry_policy(survivors, lost_in_flight=12)
    assert d.headroom_slots == 7  # (5-1) + (5-2) + 0
    assert d.active_requests == 45
    assert d.policy.retry_before_first_byte is True
    assert d.policy.budget_fraction == pytest.approx(7 / 45, abs=1e-4)
    assert d.policy.jitter and d.policy.max_attempts == 2
    assert "g2 0 (KV 85% >= 80%)" in d.reason


def test_retry_budget_is_capped_and_disabled_without_headroom() -> None:
    idle = [SurvivorLoad(group_id="g0", waiting=0, running=1, kv_usage=0.1)]
    assert decide_retry_policy(idle, lost_in_flight=1).policy.budget_fraction == 0.2
    full = [SurvivorLoad(group_id="g0", waiting=7, running=30, kv_usage=0.5)]
    d = decide_retry_policy(full, lost_in_flight=5)
    assert d.policy.retry_before_first_byte is False and d.policy.budget_fraction == 0.0
    assert "retries disabled" in d.reason
    with pytest.raises(ValueError):
        decide_retry_policy(full, queue_bound=0)


def _spare_pool():  # type: ignore[no-untyped-def]
    return snapshot(
        [
            group("g1", ("n1",)),
            group("g2", ("n2",)),
            group("s-old", ("n3",), role=GroupRole.SPARE, revision="r0"),
            group("s-same-domain", ("n4",), role=GroupRole.SPARE),
            group("s-other-domain", ("n5",), role=GroupRole.SPARE),
            group("s-cold", ("n6",), role=GroupRole.SPARE, ready=False),
            group("s-other-model", ("n7",), role=GroupRole.SPARE, model="mistral-7b"),
        ],
        [node("n1", "nvl-a"), node("n2", "nvl-b"), node("n3", "nvl-b"), node("n4", "nvl-a"), node("n5", "nvl-c"),
         node("n6", "nvl-c"), node("n7", "nvl-c")],
    )  # fmt: skip


def test_spare_of_same_model_and_revision_outside_the_failed_domain_is_promoted() -> None:
    pick = pick_spares(_spare_pool(), ["g1"])
    assert pick.promotions == {"g1": "s-other-domain"}
    assert pick.rejected == {"s-cold": "not Ready (not warm)"}  # spares merely not needed are not listed
    assert pick.unmatched == ()


def test_another_revision_is_never_a_substitute() -> None:
    snap = snapshot([group("g1", ("n1",), revision="r2"), group("s-old", ("n3",), role=GroupRole.SPARE)])
    pick = pick_spares(snap, ["g1"])
    assert pick.promotions == {} and pick.unmatched == ("g1",)
    assert pick.rejected == {"s-old": "serves llama-70b@r1, not a lost group's model and revision"}
    assert "no warm spare of the same model and revision for g1 (llama-70b@r2)" in pick.reason


def test_spares_on_bad_nodes_are_not_warm_capacity() -> None:
    snap = snapshot(
        [
            group("g1", ("n1",)),
            group("s1", ("n2",), role=GroupRole.SPARE),
            group("s2", ("n3",), role=GroupRole.SPARE),
            group("s3", ("n4",), role=GroupRole.SPARE),
        ],
        [node("n1"), node("n2", unschedulable=True), node("n3", ready=False), node("n4", labels={"fleetmend.io/quarantine": "xid"})],
    )  # fmt: skip
    pick = pick_spares(snap, ["g1"])
    assert pick.promotions == {}
    assert pick.rejected == {
        "s1": "node n2 is cordoned",
        "s2": "node n3 is not Ready",
        "s3": "node n4 is quarantined",
    }


def test_a_spare_lost_with_the_serving_group_is_never_promoted() -> None:
    """Engines on a lost node stop answering seconds before the node turns NotReady: the spare beside
    the lost group is reported lost with it while its pod and node still look Ready. Promoting it would
    route to a dead engine and leave the pool a replica short (found by bench/fleet_scale.py on the
    4-node demo: the spare on the lost node was promoted, verification then saw 4 of 5)."""
    snap = snapshot(
        [group("g1", ("n1",)), group("s-beside", ("n1",), role=GroupRole.SPARE), group("s-far", ("n2",), role=GroupRole.SPARE)],
        [node("n1"), node("n2")],
    )  # fmt: skip
    pick = pick_spares(snap, ["g1"], excluded_nodes=[], lost_spares=["s-beside"])
    assert pick.promotions == {"g1": "s-far"}
    assert pick.rejected == {"s-beside": "lost itself (its engine stopped answering with the loss)"}
    alone = snapshot([group("g1", ("n1",)), group("s-beside", ("n1",), role=GroupRole.SPARE)], [node("n1")])
    pick = pick_spares(alone, ["g1"], excluded_nodes=[], lost_spares=["s-beside"])
    assert pick.promotions == {} and pick.unmatched == ("g1",)


def test_two_lost_groups_get_two_different_spares() -> None:
    snap = _spare_pool()
    pick = pick_spares(snap, ["g1", "g2"])
    assert set(pick.promotions.values()) == {"s-other-domain", "s-same-domain"}


def test_lead_time_from_config_is_the_sum_of_phases() -> None:
    est = estimate_lead_time("llama-70b")
    assert est.total_s == 600 + 180 + 300 + 120  # single-pod: no distributed init
    assert "Expected lead time for new llama-70b capacity: 20 min (1200 s)" in est.text
    multi = estimate_lead_time("llama-70b", multi_node=True, needs_new_node=False, image_cached=True)
    assert multi.total_s == 300 + 60 + 120
    assert [p.source for p in multi.phases][:2] == [
        "not needed: a node with room exists",
        "not needed: image cached on the target node",
    ]


def test_lead_time_blends_earlier_recoveries_of_the_same_model_only() -> None:
    history = [
        PastRecovery(model="llama-70b", weight_load_s=900),
        PastRecovery(model="llama-70b", weight_load_s=1000, warmup_s=60),
        PastRecovery(model="llama-70b", weight_load_s=1100),
        PastRecovery(model="mistral-7b", weight_load_s=10, provisioning_s=1),
    ]
    cfg = LeadTimeConfig(weight_load_s=300)
    est = estimate_lead_time("llama-70b", cfg, history)
    phases = {p.name: p for p in est.phases}
    assert phases["weight_load"].seconds == pytest.approx((3 * 1000 + 300) / 4)
    assert phases["weight_load"].samples == 3
    assert phases["warmup"].seconds == pytest.approx((60 + 120) / 2)
    assert phases["provisioning"].seconds == 600 and phases["provisioning"].source == "config"
    assert "blended with 3 earlier recoveries" in phases["weight_load"].source


def test_thresholds_validation() -> None:
    with pytest.raises(ValueError):
        PressureThresholds(kv_ceiling=0)


def test_arrivals_are_estimated_from_what_admission_let_through() -> None:
    half_sheddable = Admission(partial_shed={Tier.SHEDDABLE: 0.5}, queue_bound=5)  # refuses 15 %
    assert estimate_arrivals(85.0, half_sheddable, None) == pytest.approx(100.0)
    assert estimate_arrivals(85.0, half_sheddable, 80.0) == pytest.approx(90.0)
    assert estimate_arrivals(40.0, Admission(), 60.0, smoothing=1.0) == pytest.approx(40.0)
    with pytest.raises(ValueError):
        estimate_arrivals(-1.0, Admission(), None)


def test_shedding_account_compares_users_shed_with_the_recorded_gap() -> None:
    levels = [
        ShedLevel(at=10.0, gap=0.25, refused=0.25),
        ShedLevel(at=12.0, gap=0.0, refused=0.0),
        ShedLevel(at=11.0, gap=0.05, refused=0.05),  # out of order: sorted by time
    ]
    # 50 req/s: 2 s... 10-11 s at 25 % (12.5) + 11-12 s at 5 % (2.5) = 15 refusals called for, of 1000.
    a = account_shedding(levels, arrivals=1000, shed=20, arrival_rps=50, until=40.0)
    assert a.gap_share == pytest.approx(0.015)
    assert a.refused_share == pytest.approx(0.02) and a.over_shed_share == pytest.approx(0.005)
    under = account_shedding(levels, arrivals=1000, shed=5, arrival_rps=50, until=40.0)
    assert under.over_shed_share == 0.0
    with pytest.raises(ValueError):
        account_shedding(levels, arrivals=-1, shed=0, arrival_rps=1, until=1)
