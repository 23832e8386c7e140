"""Steps 3-6: shedding by the arithmetic of lost capacity, retry budget, spare choice, lead time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.leadtime import LeadTimeConfig, PastRecovery, estimate_lead_time
from fleet.pool import GroupRole
from fleet.retry_budget import decide_retry_policy
from fleet.shedding import PressureThresholds, SurvivorLoad, can_lift_shedding, decide_shedding
from fleet.spares import pick_spares
from fleet.vocabulary import SHED_ORDER, Tier

from .fleets import group, node, snapshot

CALM = [SurvivorLoad(group_id=f"g{i}", waiting=0, running=4, kv_usage=0.4, capacity_rps=20) for i in range(3)]


def test_no_shedding_when_survivors_carry_the_load() -> None:
    d = decide_shedding(arrival_rps=45, survivors=CALM, lost_capacity_rps=20, per_group_capacity_rps=20)
    assert d.shed_tiers == () and d.admission.shed_tiers == [] and d.admission.queue_bound is None
    assert "no shedding needed" in d.reason


def test_lost_capacity_sheds_the_lowest_tier_with_the_arithmetic_in_the_reason() -> None:
    # 3 survivors x 20 = 60 req/s at 90 % = 54; arrivals 70 -> 22.9 % cannot be carried; sheddable is 30 %.
    d = decide_shedding(arrival_rps=70, survivors=CALM, lost_capacity_rps=20, per_group_capacity_rps=20)
    assert d.shed_tiers == (Tier.SHEDDABLE,)
    assert d.admission.queue_bound == 5
    assert d.deficit_fraction == pytest.approx(1 - 54 / 70)
    assert (
        "arrivals 70.0 req/s" in d.reason and "60.0 req/s at 90%" in d.reason and "sheddable 30%" in d.reason
    )
    assert d.residual_shortfall_rps == 0.0


def test_bigger_loss_sheds_standard_too_but_never_critical() -> None:
    survivors = CALM[:1]
    d = decide_shedding(arrival_rps=100, survivors=survivors, lost_capacity_rps=60, per_group_capacity_rps=20)
    assert d.shed_tiers == (Tier.SHEDDABLE, Tier.STANDARD)
    assert Tier.CRITICAL not in d.shed_tiers
    assert d.residual_shortfall_rps == pytest.approx(100 * 0.2 - 18)  # critical 20 req/s vs 18 usable
    assert "critical traffic is not shed" in d.reason


def test_thrash_sheds_even_when_the_arithmetic_says_it_fits() -> None:
    thrashing = [
        SurvivorLoad(
            group_id="g0", waiting=9, running=30, kv_usage=0.97, preemptions_per_s=3, waiting_delta=4
        ),
        *CALM[1:],
    ]
    d = decide_shedding(arrival_rps=30, survivors=thrashing, lost_capacity_rps=20, per_group_capacity_rps=20)
    assert d.thrashing == ("g0",)
    assert d.shed_tiers == (Tier.SHEDDABLE,)
    assert "thrashing: g0" in d.reason


def test_thrash_on_most_survivors_sheds_one_tier_more() -> None:
    hot = [
        SurvivorLoad(group_id=f"g{i}", waiting=8, kv_usage=0.95, preemptions_per_s=1, waiting_delta=2)
        for i in range(3)
    ]
    d = decide_shedding(arrival_rps=10, survivors=hot, lost_capacity_rps=20, per_group_capacity_rps=20)
    assert d.shed_tiers == (Tier.SHEDDABLE, Tier.STANDARD)


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
    assert Tier.CRITICAL not in d.shed_tiers
    assert d.shed_tiers == SHED_ORDER[: len(d.shed_tiers)]  # lowest tiers first, no gaps
    if d.shed_fraction < d.deficit_fraction:
        assert d.shed_tiers == SHED_ORDER  # only short when everything sheddable is already shed
    if d.deficit_fraction == 0:
        assert d.shed_tiers == ()


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
