"""Bounded remediation, fleet-wide: one slot rule for qualification Jobs and for recoveries rebuilding."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fleet.recovery import Phase
from fleet.slots import REBUILD_PHASES, Slots, rebuild_slot


def test_a_recovery_rebuilds_below_the_cap_and_queues_at_it_naming_the_recoveries_that_hold_the_slots() -> (
    None
):
    free = rebuild_slot("inference/llama", Slots(running=["recovery-a"], cap=2))
    assert (
        free.free
        and free.reason == "1 of 2 recoveries rebuilding capacity fleet-wide: inference/llama rebuilds now"
    )
    queued = rebuild_slot("inference/llama", Slots(running=["recovery-b", "recovery-a"], cap=2))
    assert not queued.free
    assert queued.reason == (
        "inference/llama queued for rebuilding: 2 of 2 recoveries already rebuild capacity fleet-wide "
        "(recovery-a, recovery-b); it rebuilds when one has ramped back"
    )


@given(running=st.integers(0, 40), cap=st.integers(1, 32))
def test_a_slot_is_free_exactly_below_the_cap(running: int, cap: int) -> None:
    decision = rebuild_slot("p", Slots(running=[f"r{i}" for i in range(running)], cap=cap))
    assert decision.free == (running < cap)


def test_the_steps_that_never_wait_hold_no_slot() -> None:
    # Deroute, shedding, in-flight and promotion run before the slot is asked for, and a recovery waiting
    # on an operator or queued itself holds none.
    for phase in (
        Phase.DEROUTING,
        Phase.PROTECTING,
        Phase.IN_FLIGHT,
        Phase.PROMOTING,
        Phase.AWAITING_OPERATOR,
    ):
        assert phase not in REBUILD_PHASES
    assert Phase.QUEUED_FOR_REBUILD not in REBUILD_PHASES
