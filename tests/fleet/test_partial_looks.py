"""A partial look: some engines answered the scrape, some were too slow. What each decider does with it.

The rule (fleet/observation.py): an unread engine is neither idle nor dead. A step proceeds on what
it read and names the rest; a look that read nothing it needs is taken again for as long as the step
can wait, then an operator is asked.
"""

from __future__ import annotations

import pytest

from fleet.capacity import recovery_guard
from fleet.engine_metrics import EngineSnapshot
from fleet.observation import LookVerdict, PoolObservation, judge_partial_look
from fleet.retry_budget import decide_retry_policy
from fleet.scale_down import drain_progress
from fleet.shedding import SurvivorLoad, decide_shedding
from fleet.survivor_load import survivors_look, survivors_read

from .fleets import group, snapshot

SLOW = "GET /metrics answered nothing within 3 s"


def _look(at: float, engines: dict[str, EngineSnapshot], unread: dict[str, str]) -> PoolObservation:
    groups = [group("lost"), group("g1"), group("g2"), group("g3")]
    snap = snapshot(groups).model_copy(update={"observed_at": at})
    return PoolObservation(snapshot=snap, engines=engines, unread_engines=unread, router_label="r")


def _busy(waiting: float, done: float = 0.0) -> EngineSnapshot:
    return EngineSnapshot(running=4, waiting=waiting, kv_usage=0.5, request_success_total=done)


def test_a_whole_look_proceeds_without_a_note() -> None:
    judged = judge_partial_look(["g1", "g2"], {}, waited_s=0, patience_s=60, what="survivors")
    assert judged.verdict is LookVerdict.PROCEED and judged.read == ("g1", "g2") and judged.unread == {}


def test_a_partial_look_proceeds_on_those_read_and_names_the_rest() -> None:
    judged = judge_partial_look(["g1", "g2", "g3"], {"g2": SLOW}, waited_s=0, patience_s=60, what="survivors")
    assert judged.verdict is LookVerdict.PROCEED
    assert judged.read == ("g1", "g3") and judged.unread == {"g2": SLOW}
    assert "2 of 3 read" in judged.reason and f"g2: {SLOW}" in judged.reason
    assert "neither idle nor dead" in judged.reason


def test_a_look_that_read_nothing_looks_again_until_the_patience_then_asks_with_every_reason() -> None:
    unread = {"g1": SLOW, "g2": "not read within the look's time"}
    early = judge_partial_look(["g1", "g2"], unread, waited_s=10, patience_s=60, what="survivors")
    assert early.verdict is LookVerdict.LOOK_AGAIN and "looking again" in early.reason
    late = judge_partial_look(["g1", "g2"], unread, waited_s=60, patience_s=60, what="survivors")
    assert late.verdict is LookVerdict.ASK_OPERATOR and late.read == ()
    assert f"g1: {SLOW}" in late.reason and "g2: not read within the look's time" in late.reason
    assert "in 60 s" in late.reason


def test_nothing_wanted_is_a_whole_look_and_bad_times_are_refused() -> None:
    assert (
        judge_partial_look([], {"gx": SLOW}, waited_s=0, patience_s=0, what="x").verdict
        is LookVerdict.PROCEED
    )
    with pytest.raises(ValueError, match="must be >= 0"):
        judge_partial_look(["g1"], {}, waited_s=-1, patience_s=5, what="x")


def test_survivors_read_wants_both_looks_of_every_routed_survivor_but_not_the_lost() -> None:
    before = _look(1000, {"g1": _busy(1), "g3": _busy(0)}, {"g2": SLOW, "lost": SLOW})
    after = _look(1002, {"g1": _busy(2), "g2": _busy(0)}, {"g3": "not read within the look's time"})
    judged = survivors_read(before, after, {"lost"}, waited_s=0, patience_s=60)
    assert judged.verdict is LookVerdict.PROCEED and judged.read == ("g1",)
    assert judged.unread == {
        "g2": SLOW,
        "g3": "not read within the look's time",
    }  # the lost one is not wanted
    none_read = _look(1002, {}, {"g1": SLOW, "g2": SLOW, "g3": SLOW})
    assert survivors_read(none_read, none_read, {"lost"}, waited_s=5, patience_s=60).verdict is (
        LookVerdict.LOOK_AGAIN
    )


def test_survivors_look_gives_loads_of_those_read_and_names_the_unread() -> None:
    before = _look(1000, {"g1": _busy(1), "g2": _busy(0)}, {})
    after = _look(1002, {"g1": _busy(3), "g2": _busy(0)}, {"g3": SLOW})
    look = survivors_look(before, after, {"lost"})
    assert [s.group_id for s in look.loads] == ["g1", "g2"] and look.loads[0].waiting_delta == 2
    assert look.unread == {"g3": SLOW}
    assert "1 survivor(s) not read, judged on the 2 read: g3" in look.note and "no headroom" in look.note
    assert survivors_look(before, before, {"lost"}).note == ""


def test_shedding_counts_an_unread_survivor_for_its_capacity_never_as_dead() -> None:
    read = [SurvivorLoad(group_id=f"g{i}", waiting=0, running=4, kv_usage=0.4) for i in (1, 2)]
    # Two read + one unread survivor at 20 req/s each = 60 req/s: arrivals of 50 fit (54 at 90 %).
    with_unread = decide_shedding(
        arrival_rps=50,
        survivors=read,
        lost_capacity_rps=20,
        per_group_capacity_rps=20,
        unread_survivors={"g3": SLOW},
    )
    assert with_unread.survivor_capacity_rps == pytest.approx(60)
    assert with_unread.deficit_fraction == pytest.approx(0.0)
    assert (
        "3 survivor(s) (1 not read: g3" in with_unread.reason and "judged on the 2 read" in with_unread.reason
    )
    # Counted dead (left out) it would have refused a share of arrivals the pool can carry.
    as_dead = decide_shedding(arrival_rps=50, survivors=read, lost_capacity_rps=20, per_group_capacity_rps=20)
    assert as_dead.survivor_capacity_rps == pytest.approx(40) and as_dead.deficit_fraction > 0


def test_shedding_judges_pressure_on_those_read_never_counts_an_unread_survivor_idle() -> None:
    saturated = [SurvivorLoad(group_id=f"g{i}", waiting=9, running=8, kv_usage=0.95) for i in (1, 2)]
    d = decide_shedding(
        arrival_rps=10,
        survivors=saturated,
        lost_capacity_rps=20,
        per_group_capacity_rps=20,
        unread_survivors={"g3": SLOW, "g4": SLOW},
    )
    # Two unread survivors do not dilute the read ones' saturation to "calm": the queue bound is armed.
    assert d.admission.queue_bound is not None and "saturated" in d.reason, d.reason


def test_a_survivor_is_read_or_unread_not_both() -> None:
    with pytest.raises(ValueError, match="either read or unread"):
        decide_shedding(
            arrival_rps=10,
            survivors=[SurvivorLoad(group_id="g1", waiting=0)],
            lost_capacity_rps=0,
            per_group_capacity_rps=20,
            unread_survivors={"g1": SLOW},
        )


def test_the_retry_budget_counts_no_headroom_on_an_unread_survivor() -> None:
    # One read survivor with an empty queue (5 slots) and one unread: the unread adds no slot.
    after = _look(1002, {"g1": _busy(0)}, {"g2": SLOW})
    look = survivors_look(after, after, {"lost"})
    decision = decide_retry_policy(look.loads)
    assert decision.headroom_slots == 5 and look.unread == {"g2": SLOW}


def test_a_drain_never_counts_a_victim_it_could_not_read_as_drained() -> None:
    scrapes = {"v1": EngineSnapshot(running=0, waiting=0)}
    progress = drain_progress(["v1", "v2", "v3"], scrapes, {"v2": SLOW})
    assert progress.in_flight == 0 and not progress.drained  # v2 may still hold requests
    assert progress.unread == {"v2": SLOW} and progress.unreachable == ("v3",)  # v3's process is gone
    assert f"not read: v2 ({SLOW}) (not counted as drained" in progress.summary()
    assert drain_progress(["v1", "v3"], scrapes, {}).drained  # read empty, or gone: drained


def test_the_capacity_guard_names_a_group_it_could_not_read_and_keeps_it_in_the_floor() -> None:
    def tokens(n: float) -> EngineSnapshot:
        return EngineSnapshot(generation_tokens_total=n)

    before = _look(1000, {"lost": tokens(0), "g1": tokens(0), "g2": tokens(0)}, {"g3": SLOW})
    after = _look(1010, {"lost": tokens(0), "g1": tokens(1000), "g2": tokens(1000)}, {"g3": SLOW})
    decision = recovery_guard("retire lost", before, after, ["lost"], min_groups=3)
    assert decision.allowed and decision.remaining_groups == 3, decision.reason  # g3 is in the floor
    assert f"not read: g3 ({SLOW}) - each counted in the group floor at the 100 tokens/s" in decision.reason
    # Removing the unread group itself: the others carry its estimated load (200 >= 300 is false).
    taking_it = recovery_guard("retire g3", before, after, ["g3"], min_groups=1)
    assert not taking_it.allowed and "remaining 200 tokens/s < demand 300" in taking_it.reason, (
        taking_it.reason
    )
    whole = recovery_guard(
        "retire lost",
        before.model_copy(update={"unread_engines": {}}),
        after.model_copy(update={"unread_engines": {}}),
        ["lost"],
        min_groups=3,
    )
    assert "not read" not in whole.reason


def test_a_survivor_out_of_envoys_rotation_whose_engine_answered_is_still_a_survivor() -> None:
    # A busy node: Envoy's health check timed out on g1 and g2 (out of its routing set), while their
    # engines answered fleetmend's own look. They are capacity; g3, unrouted and unread, is not judged.
    groups = [group("lost"), *(group(g).model_copy(update={"routed": False}) for g in ("g1", "g2", "g3"))]
    snap = snapshot(groups)
    before = PoolObservation(snapshot=snap, engines={"g1": _busy(1), "g2": _busy(0)}, router_label="r")
    after = PoolObservation(
        snapshot=snap.model_copy(update={"observed_at": snap.observed_at + 2}),
        engines={"g1": _busy(2), "g2": _busy(0)},
        unread_engines={"g3": SLOW},
        router_label="r",
    )
    look = survivors_look(before, after, {"lost"})
    assert [s.group_id for s in look.loads] == ["g1", "g2"] and look.unread == {}
    not_ready = snapshot([g.model_copy(update={"ready": False}) for g in groups])
    assert survivors_look(before, after.model_copy(update={"snapshot": not_ready}), {"lost"}).loads == ()
