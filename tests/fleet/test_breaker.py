"""The removal breaker's policy (fleet.breaker): dead capacity is never held, serving capacity is
capped per window, a trip holds every later serving removal, a reset releases the held to decide
again (never replays them)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet.breaker import BreakerLimits, BreakerState, RemovalRequest, Verdict, decide, node_cap, reset


def ask(
    node: str, *, answering: int = 2, unread: int = 0, fleet: int = 512, requester: str | None = None
) -> RemovalRequest:
    return RemovalRequest(
        unread=unread,
        node=node,
        action="cordon",
        signal="GpuXid=True",
        requester=requester or f"fence/{node}",
        engines=2,
        answering=answering,
        fleet_gpu_nodes=fleet,
    )


@pytest.mark.parametrize(
    ("fleet", "cap"), [(4, 1), (20, 1), (40, 2), (128, 6), (320, 16), (512, 16), (4000, 16)]
)
def test_the_cap_is_the_larger_of_one_node_and_5_percent_and_never_above_16(fleet: int, cap: int) -> None:
    assert node_cap(BreakerLimits(), fleet) == cap


def test_serving_nodes_beyond_the_cap_trip_the_breaker_and_everything_serving_after_is_held() -> None:
    state = BreakerState()
    verdicts = []
    for i in range(20):
        decision, state = decide(state, ask(f"n{i}", fleet=128), now=100.0 + i)
        verdicts.append(decision.verdict)
    assert verdicts[:6] == [Verdict.GRANTED] * 6
    assert verdicts[6:] == [Verdict.HELD] * 14
    assert state.trip is not None and "suspected bad signal" in state.trip.reason
    assert "7 nodes whose engines still answer" in state.trip.reason and "cap 6 of 128" in state.trip.reason
    assert [h.request.node for h in state.held] == [f"n{i}" for i in range(6, 20)]


def test_dead_capacity_is_never_held_even_while_tripped() -> None:
    state = BreakerState()
    for i in range(3):
        _, state = decide(state, ask(f"n{i}", fleet=4), now=float(i))
    assert state.trip is not None
    decision, state = decide(state, ask("dead", answering=0, fleet=4), now=10.0)
    assert decision.verdict is Verdict.DEAD and "dead capacity, never held" in decision.reason
    assert state.dead_passed == 1 and "dead" not in {h.request.node for h in state.held}


def test_an_engine_the_probe_did_not_reach_in_time_is_not_dead_capacity() -> None:
    """Under load a probe's deadline can pass before an engine answers: no answer yet is not death, so
    the node counts as serving (hundreds of fences probing at once can run past the look's time)."""
    state = BreakerState()
    _, state = decide(state, ask("n0", fleet=4), now=0.0)
    decision, state = decide(state, ask("slow", answering=0, unread=2, fleet=4), now=1.0)
    assert decision.verdict is Verdict.HELD and "2 not read in time" in decision.reason, decision
    assert state.dead_passed == 0 and [h.request.node for h in state.held] == ["slow"]


def test_a_node_is_counted_once_however_many_procedures_ask() -> None:
    state = BreakerState()
    for requester in ("fence/n1", "incident/a/recovery-1", "incident/b/recovery-1"):
        decision, state = decide(state, ask("n1", fleet=4, requester=requester), now=1.0)
        assert decision.verdict is Verdict.GRANTED and decision.counted == 1
    decision, state = decide(state, ask("n2", fleet=4), now=2.0)
    assert decision.verdict is Verdict.HELD


def test_the_window_slides() -> None:
    state = BreakerState(limits=BreakerLimits(window_s=600))
    decision, state = decide(state, ask("n1", fleet=4), now=0.0)
    assert decision.verdict is Verdict.GRANTED
    decision, state = decide(state, ask("n2", fleet=4), now=601.0)
    assert decision.verdict is Verdict.GRANTED and [g.node for g in state.granted] == ["n2"]


def test_a_reset_releases_each_held_requester_once_and_closes_the_breaker() -> None:
    state = BreakerState()
    for node in ("n1", "n2", "n3"):
        _, state = decide(state, ask(node, fleet=4), now=1.0)
    _, state = decide(state, ask("n3", fleet=4), now=2.0)  # the same holder asking again
    released, state = reset(state, "sre", "the GpuXid check was a bad driver probe, fixed", now=3.0)
    assert released == ["fence/n2", "fence/n3"]
    assert state.trip is None and state.held == [] and state.resets[-1].operator == "sre"
    decision, _ = decide(state, ask("n2", fleet=4), now=4.0)  # re-decided against the world now
    assert decision.verdict is Verdict.GRANTED


@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2), st.floats(0, 2000)), min_size=1, max_size=120),
    st.integers(1, 1000),
)
def test_never_more_serving_nodes_granted_in_any_window_than_the_cap(
    asks: list[tuple[int, int, float]], fleet: int
) -> None:
    state = BreakerState()
    cap = node_cap(state.limits, fleet)
    granted: list[tuple[float, str]] = []
    for node, answering, at in sorted(asks, key=lambda a: a[2]):
        decision, state = decide(state, ask(f"n{node}", answering=answering, fleet=fleet), now=at)
        if decision.verdict is Verdict.GRANTED:
            granted.append((at, f"n{node}"))
        if answering == 0:
            assert decision.verdict is Verdict.DEAD
    for at, _ in granted:
        in_window = {n for t, n in granted if at - state.limits.window_s < t <= at}
        assert len(in_window) <= cap


def test_the_askers_configured_limits_apply() -> None:
    """FLEETMEND_REMOVAL_BREAKER reaches the breaker with each ask; the newest ask's limits count."""
    state = BreakerState()
    tight = BreakerLimits(max_nodes=2, fleet_share=1.0)
    verdicts = []
    for i in range(3):
        decision, state = decide(state, ask(f"n{i}", fleet=512).model_copy(update={"limits": tight}), now=1.0)
        verdicts.append(decision.verdict)
    assert verdicts == [Verdict.GRANTED, Verdict.GRANTED, Verdict.HELD] and state.limits == tight
