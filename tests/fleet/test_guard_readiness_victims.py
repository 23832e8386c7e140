"""Safety rails and scale-down: capacity guard, readiness with hysteresis, victims, verification."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.capacity import Demand, GroupCapacity, check_capacity
from fleet.pool import GroupRole
from fleet.readiness import EngineSample, ReadinessState, ReadinessThresholds, next_readiness
from fleet.recovery import ServingObjectives
from fleet.verification import (
    LedgerReconcile,
    NodeQuarantine,
    RecoveryObservations,
    ReplicaObservation,
    verify_recovery,
    verify_scale_down,
)
from fleet.victims import GroupLoad, choose_victims

from .fleets import group, snapshot

CAP = {f"g{i}": GroupCapacity(tokens_per_s=1000, requests_per_s=10) for i in range(4)}


def test_guard_allows_when_the_rest_carries_demand() -> None:
    d = check_capacity("scale down g3", CAP, ["g3"], Demand(tokens_per_s=2500, requests_per_s=20))
    assert d.allowed and d.remaining_groups == 3 and d.remaining_tokens_per_s == 3000
    assert d.reason.startswith("allow scale down g3")


def test_guard_refuses_with_the_reason_when_tokens_fall_short() -> None:
    d = check_capacity("scale down g2, g3", CAP, ["g2", "g3"], Demand(tokens_per_s=2500))
    assert not d.allowed
    assert "remaining 2,000 tokens/s < demand 2,500 x 1.1 = 2,750" in d.reason
    assert "an operator must approve" in d.reason


def test_guard_counts_dead_groups_as_nothing_and_is_never_off() -> None:
    cap = {**CAP, "g0": GroupCapacity(tokens_per_s=0)}  # g0 is the lost replica
    d = check_capacity("force-delete g0", cap, ["g0"], Demand(tokens_per_s=2000))
    assert d.allowed and d.remaining_groups == 3
    # Even with min_groups=0 and no demand, the pool is never taken to zero serving groups.
    d = check_capacity("scale to zero", {"g0": CAP["g0"]}, ["g0"], Demand(tokens_per_s=0), min_groups=0)
    assert not d.allowed and "0 serving group(s) would remain, the floor is 1" in d.reason


def test_guard_bad_input() -> None:
    with pytest.raises(ValueError, match="not in the capacity map"):
        check_capacity("x", CAP, ["nope"], Demand(tokens_per_s=1))
    with pytest.raises(ValueError):
        check_capacity("x", CAP, [], Demand(tokens_per_s=1), headroom=0.5)


def sample(
    kv: float | None, waiting: float | None, live: bool = True, accepting: bool = True
) -> EngineSample:
    return EngineSample(live=live, accepting=accepting, kv_usage=kv, waiting=waiting)


def test_a_replica_at_98_percent_kv_is_live_but_not_ready() -> None:
    s = next_readiness(None, sample(0.98, 0))
    assert s.live and not s.ready and s.changed
    assert "KV 98% >= ceiling 80%" in s.reason


def test_queue_bound_and_liveness() -> None:
    assert not next_readiness(None, sample(0.1, 5)).ready
    assert next_readiness(None, sample(0.79, 4)).ready
    dead = next_readiness(None, sample(0.1, 0, live=False))
    assert not dead.ready and not dead.live
    draining = next_readiness(None, sample(0.1, 0, accepting=False))
    assert draining.live and not draining.ready


def test_hysteresis_does_not_flap() -> None:
    t = ReadinessThresholds()
    s = next_readiness(None, sample(0.5, 0), t)
    assert s.ready
    s = next_readiness(s, sample(0.85, 0), t)
    assert not s.ready and s.changed
    # Back under the ceiling but above the release band: stays not ready.
    s = next_readiness(s, sample(0.75, 0), t)
    assert not s.ready and not s.changed
    # Calm, but only for one sample: still not ready.
    s = next_readiness(s, sample(0.5, 1), t)
    assert not s.ready and "calm for 1 of 2" in s.reason
    s = next_readiness(s, sample(0.5, 1), t)
    assert s.ready and s.changed


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=2, max_size=60))
def test_gate_changes_only_when_crossing_the_bands(kvs: list[float]) -> None:
    t = ReadinessThresholds()
    state: ReadinessState | None = None
    for kv in kvs:
        new = next_readiness(state, sample(kv, 0), t)
        if state is not None and new.ready != state.ready:
            if new.ready:
                assert kv < t.kv_release  # only ever re-admitted well below the ceiling
            else:
                assert kv >= t.kv_ceiling
        if kv >= t.kv_ceiling:
            assert not new.ready
        state = new


def test_missing_metrics_keep_the_previous_verdict() -> None:
    ready = next_readiness(None, sample(0.2, 0))
    kept = next_readiness(ready, sample(None, None))
    assert kept.ready and not kept.changed and "unavailable" in kept.reason
    assert not next_readiness(None, sample(None, None)).ready


def test_bad_thresholds() -> None:
    with pytest.raises(ValueError, match="kv_release"):
        ReadinessThresholds(kv_ceiling=0.8, kv_release=0.9)
    with pytest.raises(ValueError, match="queue_release"):
        ReadinessThresholds(queue_bound=3, queue_release=3)


def test_victims_prefer_unready_then_least_loaded_then_coldest() -> None:
    snap = snapshot([group(f"g{i}") for i in range(6)] + [group("dead", ready=False)])
    loads = {
        "g0": GroupLoad(running=10, waiting=2, kv_usage=0.6),
        "g1": GroupLoad(running=1, kv_usage=0.5),
        "g2": GroupLoad(running=1, kv_usage=0.2),
        "g3": GroupLoad(running=30),
        "g4": GroupLoad(running=5),
        "g5": GroupLoad(running=5),
    }
    c = choose_victims(snap, target_groups=4, loads=loads, warm_floor=1)
    assert c.victims == ("dead", "g2", "g1")
    assert c.complete and c.remaining_serving == 4


def test_a_saturated_replica_is_warm_and_busy_not_a_cheap_victim() -> None:
    # The serving-ready gate holds g0 not-ready because its KV cache is full: it is warm, with work to drain.
    snap = snapshot([group("g0", ready=False, engine_up=True), group("g1"), group("b", revision="r2")])
    loads = {"g0": GroupLoad(running=40, waiting=6, kv_usage=0.98), "g1": GroupLoad(running=3)}
    c = choose_victims(snap, target_groups=2, loads=loads, warm_floor=1)
    assert c.victims == ("g1",)
    assert snap.group("g0").warm and snap.warm_copies("llama-70b", "r1") == [
        snap.group("g0"),
        snap.group("g1"),
    ]


def test_never_the_last_warm_copy_of_a_revision() -> None:
    snap = snapshot([group("a1", revision="r1"), group("a2", revision="r1"), group("b1", revision="r2")])
    c = choose_victims(snap, target_groups=1, loads={"b1": GroupLoad()}, warm_floor=0)
    assert "b1" not in c.victims
    assert c.blocked["b1"] == "last warm copy of llama-70b@r2"
    assert c.victims == ("a1",) and not c.complete


def test_a_spare_of_the_revision_keeps_the_last_serving_copy_removable() -> None:
    snap = snapshot(
        [group("a1"), group("b1", revision="r2"), group("s", revision="r2", role=GroupRole.SPARE)]
    )
    c = choose_victims(snap, explicit=["b1-0"], warm_floor=1)  # named by pod
    assert c.victims == ("b1",)


def test_never_below_the_warm_floor() -> None:
    snap = snapshot([group(f"g{i}") for i in range(4)])
    c = choose_victims(snap, target_groups=1, warm_floor=3)
    assert len(c.victims) == 1 and not c.complete
    assert "below the warm floor of 3" in next(iter(c.blocked.values()))


def test_explicit_victims_validation() -> None:
    snap = snapshot([group("g0"), group("g1")])
    with pytest.raises(ValueError, match="'zz' is neither a replica group nor a pod"):
        choose_victims(snap, explicit=["zz"])
    with pytest.raises(ValueError, match="either a target"):
        choose_victims(snap, target_groups=1, explicit=["g0"])
    assert choose_victims(snap, target_groups=5).reason.startswith("nothing to remove")


@st.composite
def fleets(draw):  # type: ignore[no-untyped-def]
    n = draw(st.integers(min_value=1, max_value=12))
    groups = []
    for i in range(n):
        groups.append(
            group(
                f"g{i}",
                revision=draw(st.sampled_from(["r1", "r2", "r3"])),
                model=draw(st.sampled_from(["llama", "mistral"])),
                role=draw(st.sampled_from([GroupRole.SERVING, GroupRole.SERVING, GroupRole.SPARE])),
                ready=draw(st.booleans() | st.just(True)),
                engine_up=draw(st.none() | st.booleans()),
                pods=draw(st.integers(min_value=1, max_value=3)),
            )
        )
    loads = {
        g.id: GroupLoad(
            running=draw(st.integers(0, 50)), waiting=draw(st.integers(0, 10)), kv_usage=draw(st.floats(0, 1))
        )
        for g in groups
    }
    return snapshot(groups), loads


@settings(max_examples=300, deadline=None)
@given(
    fleet=fleets(), target=st.integers(min_value=0, max_value=12), floor=st.integers(min_value=0, max_value=8)
)
def test_victim_selection_is_always_safe(fleet, target: int, floor: int) -> None:  # type: ignore[no-untyped-def]
    snap, loads = fleet
    c = choose_victims(snap, target_groups=target, loads=loads, warm_floor=floor)
    victims = set(c.victims)
    serving_ids = {g.id for g in snap.serving}
    assert victims <= serving_ids  # whole serving groups only, by group id
    assert len(victims) == len(c.victims) <= max(0, len(serving_ids) - target)
    remaining = [g for g in snap.groups if g.id not in victims]
    # Never the last warm copy of a revision.
    for g in snap.groups:
        if g.warm:
            assert any(r.warm and r.model == g.model and r.revision == g.revision for r in remaining)
    # Never below the warm floor (nor lower than it already was).
    warm_before = sum(g.warm for g in snap.groups)
    warm_after = sum(g.warm for g in remaining)
    assert warm_after >= min(floor, warm_before)
    # Groups that are not warm go before any warm one.
    if any(snap.group(v).warm for v in victims):
        assert all(g.id in victims for g in snap.serving if not g.warm)


def good_observations(**kw: object) -> RecoveryObservations:
    base: dict[str, object] = dict(
        target_groups=4,
        workload_ready_groups=4,
        endpoint_serving_groups=4,
        replicas=(ReplicaObservation(group_id="g0", waiting=1, baseline_waiting=1, ttft_p99_s=0.4),),
        warm_groups=5,
        failed_nodes={"gpu-7": NodeQuarantine(cordoned=True, tainted=True, labelled=True)},
    )
    base.update(kw)
    return RecoveryObservations(**base)  # type: ignore[arg-type]


def test_verification_passes_with_every_check_named() -> None:
    report = verify_recovery(good_observations(), ServingObjectives.model_validate({"warm_floor": 1}))
    assert report.passed
    assert [c.name for c in report.checks] == [
        "ready replica groups (workload status)",
        "ready replica groups (EndpointSlice serving)",
        "survivor queues back to baseline",
        "preemption rate zero",
        "TTFT p99 under SLO per replica",
        "ledger reconciliation",
        "warm floor restored",
        "failed nodes quarantined",
        "no replacement in the wrong pool",
    ]


@pytest.mark.parametrize(
    "change,failing",
    [
        ({"endpoint_serving_groups": 3}, "ready replica groups (EndpointSlice serving)"),
        ({"replicas": (ReplicaObservation(group_id="new", ttft_p99_s=9.0),)}, "TTFT p99 under SLO per replica"),
        ({"replicas": (ReplicaObservation(group_id="g1", preemptions_per_s=0.5),)}, "preemption rate zero"),
        ({"replicas": (ReplicaObservation(group_id="g1", waiting=9, baseline_waiting=1),)}, "survivor queues back to baseline"),
        ({"ledger": LedgerReconcile(duplicates=1)}, "ledger reconciliation"),
        ({"warm_groups": 4}, "warm floor restored"),
        ({"failed_nodes": {"gpu-7": NodeQuarantine(cordoned=True)}}, "failed nodes quarantined"),
        ({"wrong_pool_pods": ("p-9",)}, "no replacement in the wrong pool"),
    ],
)  # fmt: skip
def test_each_failing_check_is_reported_with_observed_and_expected(
    change: dict[str, object], failing: str
) -> None:
    report = verify_recovery(good_observations(**change), ServingObjectives.model_validate({"warm_floor": 1}))
    assert not report.passed
    failed = [c for c in report.checks if not c.passed]
    assert [c.name for c in failed] == [failing]
    assert failed[0].observed is not None and failed[0].expected is not None


def test_with_engines_serving_by_deadline_preemptions_are_recorded_and_ttft_is_held_to_the_wait_budget() -> (
    None
):
    """vLLM's priority scheduler preempts for sooner deadlines by design, and the lowest tier waits up
    to its deadline: under steady load neither says the pool is unwell. Judged as in arrival order, a
    recovery in such a pool never passed verification while the load ran, and waited for an operator."""
    by_deadline = ServingObjectives.model_validate(
        {
            "warm_floor": 1,
            "engine_queue_order": "deadline",
            "tier_deadlines_s": {"critical": 5, "standard": 10, "sheddable": 20},
        }
    )
    busy = (ReplicaObservation(group_id="g1", preemptions_per_s=0.5, ttft_p99_s=9.0),)
    report = verify_recovery(good_observations(replicas=busy), by_deadline)
    assert report.passed, report.checks
    preempt = next(c for c in report.checks if c.name == "preemption rate zero")
    assert preempt.observed == {"g1": 0.5} and "recorded, not judged" in str(preempt.expected)
    arrival = by_deadline.model_copy(update={"engine_queue_order": "arrival"})
    failed = [
        c.name for c in verify_recovery(good_observations(replicas=busy), arrival).checks if not c.passed
    ]
    assert failed == ["preemption rate zero", "TTFT p99 under SLO per replica"]
    # Past the wait budget, or a queue that has not come back, still fails.
    late = (ReplicaObservation(group_id="g1", ttft_p99_s=25.0, waiting=9, baseline_waiting=1),)
    failed = [
        c.name for c in verify_recovery(good_observations(replicas=late), by_deadline).checks if not c.passed
    ]
    assert failed == ["survivor queues back to baseline", "TTFT p99 under SLO per replica"]


def test_scale_down_verification() -> None:
    ok = verify_scale_down(6, 6, cut_streams=0, victims_in_flight=0, ledger=LedgerReconcile())
    assert ok.passed
    cut = verify_scale_down(6, 6, cut_streams=3, victims_in_flight=3, ledger=LedgerReconcile())
    assert not cut.passed
    accepted = verify_scale_down(
        6, 6, cut_streams=3, victims_in_flight=3, ledger=LedgerReconcile(), accepted_cut=True
    )
    assert accepted.passed
    assert next(c for c in accepted.checks if c.name == "no cut stream").observed == 3
