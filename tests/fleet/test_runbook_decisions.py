"""The replica-loss runbook's decisions between its looks (``fleet.runbook``) and the one lift rule
(``fleet.shedding.lift_after_verification``), without a workflow."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fleet.loss import GroupVerdict, Verdict
from fleet.runbook import (
    PLACEMENT_LOOKS,
    judge_pending,
    nodes_to_triage,
    pod_faults,
    pods_to_deroute,
)
from fleet.shedding import PressureThresholds, SurvivorLoad, lift_after_verification, survivor_pressure
from tests.fleet.fleets import group, node, snapshot

CALM = [SurvivorLoad(group_id=f"g{i}", waiting=0, running=4, kv_usage=0.4) for i in range(3)]
SATURATED = SurvivorLoad(group_id="g9", waiting=12, running=8, kv_usage=0.95)


# ---------------------------------------------------------------- shedding lift (step 10)


def test_verification_passed_while_still_saturated_keeps_shedding() -> None:
    """A passed verification does not lift shedding on its own: a survivor still saturated keeps it on."""
    decision = lift_after_verification(True, warm_groups=6, warm_floor=6, survivors=[*CALM, SATURATED])
    assert not decision.lift
    assert "still saturated: g9" in decision.reason


def test_verification_passed_with_the_floor_restored_and_calm_survivors_lifts() -> None:
    decision = lift_after_verification(True, warm_groups=6, warm_floor=6, survivors=CALM)
    assert decision.lift and "warm floor restored" in decision.reason


def test_a_failed_or_skipped_verification_never_lifts() -> None:
    assert not lift_after_verification(False, warm_groups=6, warm_floor=6, survivors=CALM).lift


def test_a_short_warm_floor_keeps_shedding_even_after_a_pass() -> None:
    decision = lift_after_verification(True, warm_groups=5, warm_floor=6, survivors=CALM)
    assert not decision.lift and "warm floor not restored: 5 of 6" in decision.reason


loads = st.builds(
    SurvivorLoad,
    group_id=st.sampled_from(["g0", "g1", "g2", "g3"]),
    waiting=st.floats(0, 40),
    running=st.floats(0, 16),
    kv_usage=st.one_of(st.none(), st.floats(0, 1)),
    preemptions_per_s=st.floats(0, 5),
    waiting_delta=st.floats(-10, 10),
)


@given(
    passed=st.booleans(),
    warm=st.integers(0, 12),
    floor=st.integers(0, 12),
    survivors=st.lists(loads, max_size=6),
)
def test_shedding_is_lifted_exactly_when_verified_restored_and_calm(
    passed: bool, warm: int, floor: int, survivors: list[SurvivorLoad]
) -> None:
    """The one rule, both ways: lifted iff verification passed, the warm floor is back and no survivor is
    saturated or thrashing; and never lifted without a reason that says which condition held it."""
    t = PressureThresholds()
    calm = all((p := survivor_pressure(s, t)).saturation < 1.0 and not p.thrashing for s in survivors)
    decision = lift_after_verification(passed, warm_groups=warm, warm_floor=floor, survivors=survivors)
    assert decision.lift == (passed and warm >= floor and calm)
    if not decision.lift:
        assert any(
            w in decision.reason for w in ("warm floor not restored", "not yet warm", "still saturated")
        )


# ---------------------------------------------------------------- deroute (step 2)


def test_every_routed_pod_of_a_lost_group_and_every_dead_routed_pod_is_derouted() -> None:
    lost = [group("a", pods=2), group("b")]
    verdicts = [
        GroupVerdict(group_id="a", verdict=Verdict.LOST, reason="x", dead_but_routed=("a-1",)),
        GroupVerdict(group_id="c", verdict=Verdict.LOST, reason="not lost here", dead_but_routed=("c-0",)),
    ]
    # a-0 routed; a-1 only through the verdict (dead but routed); b-0 not routed; c is not a lost group.
    assert pods_to_deroute(lost, verdicts, routed_pods=["a-0", "z-0"]) == ["a-0", "a-1"]
    assert pods_to_deroute(lost, [], routed_pods=[]) == []


# ---------------------------------------------------------------- placement looks (step 7)


def test_a_pending_replacement_is_judged_only_after_enough_looks_and_reported_once() -> None:
    full = [node("n1", used=8), node("n2", used=8)]
    snap = snapshot([group("r", nodes=("n1",))], nodes=full)
    pending = {"r-0": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu"}
    looks: dict[str, int] = {}
    for _ in range(PLACEMENT_LOOKS - 1):
        judged = judge_pending(pending, looks, set(), snap, excluded_nodes=())
        assert judged.unplaceable == [] and not judged.stuck
        looks = judged.looks
    judged = judge_pending(pending, looks, set(), snap, excluded_nodes=())
    assert [u.pod for u in judged.unplaceable] == ["r-0"] and judged.stuck
    assert not judged.unplaceable[0].result.admissible and judged.unplaceable[0].result.reason
    # Reported already: not again, and still stuck (every pending pod is reported).
    again = judge_pending(pending, judged.looks, {"r-0"}, snap, excluded_nodes=())
    assert again.unplaceable == [] and again.stuck


def test_a_pending_replacement_with_room_or_not_yet_scheduled_is_given_time() -> None:
    roomy = snapshot([group("r", nodes=("n1",))], nodes=[node("n1", used=0)])
    many = {"r-0": PLACEMENT_LOOKS + 5}
    judged = judge_pending({"r-0": "0/1 nodes available"}, many, set(), roomy, excluded_nodes=())
    assert judged.unplaceable == [] and not judged.stuck
    full = snapshot([group("r", nodes=("n1",))], nodes=[node("n1", used=8)])
    unseen = judge_pending({"r-0": "Pending (no scheduling event yet)"}, many, set(), full, excluded_nodes=())
    assert unseen.unplaceable == []


def test_excluded_nodes_do_not_count_as_room() -> None:
    snap = snapshot([group("r", nodes=("n1",))], nodes=[node("n1", used=0)])
    judged = judge_pending({"r-0": "Pending"}, {"r-0": PLACEMENT_LOOKS}, set(), snap, excluded_nodes=["n1"])
    assert [u.pod for u in judged.unplaceable] == ["r-0"]


# ---------------------------------------------------------------- triage (step 8)


def test_pod_fault_reasons_are_sorted_into_what_triage_reads() -> None:
    faults = {
        f.pod: f for f in pod_faults({"a": "OOMKilled", "b": "CrashLoopBackOff", "c": "NodeLost", "d": "X"})
    }
    assert faults["a"].terminated_reason == "OOMKilled" and faults["a"].waiting_reason is None
    assert faults["b"].waiting_reason == "CrashLoopBackOff" and faults["b"].terminated_reason is None
    assert faults["c"].status_reason == "NodeLost"
    assert (faults["d"].terminated_reason, faults["d"].waiting_reason, faults["d"].status_reason) == (
        None,
    ) * 3


def test_failed_nodes_are_triaged_and_a_ready_node_only_hosting_a_crash_stays_in_service() -> None:
    lost = [group("a", nodes=("n1", "n2")), group("b", nodes=("n3",))]
    scope = nodes_to_triage(lost, failed=["n2"], hint=None)
    assert scope.triage == ("n2",) and scope.kept == ("n1", "n3")
    # A report's fault hint (e.g. an Xid alert) sends every node of the lost groups to triage.
    hinted = nodes_to_triage(lost, failed=[], hint="xid")
    assert hinted.triage == ("n1", "n2", "n3") and hinted.kept == ()
