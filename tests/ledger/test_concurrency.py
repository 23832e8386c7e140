"""Concurrent duplicates and zombies: exactly one application, and a paused holder cannot record."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import text

from ledger import Attempt, EffectLedger, EffectOutcome, FencedOut
from ledger.metrics import FENCE_REJECTIONS
from tests.ledger.world import SimulatedCrash, World, WorldEffect

CALLERS = 64
WORKERS = 4  # separate ledger instances (own pools, own lease owner ids), 16 threads each


def test_64_concurrent_calls_with_one_op_id_apply_exactly_once(
    make_ledger: Callable[..., EffectLedger], world: World
) -> None:
    ledgers = [make_ledger(owner=f"worker-{i}", wait_seconds=30) for i in range(WORKERS)]
    with ledgers[0].engine.connect() as conn:
        assert conn.execute(text("SHOW transaction_isolation")).scalar_one() == "read committed"

    def slow_enough_to_overlap(attempt: Attempt) -> None:
        time.sleep(0.2)  # every other caller arrives while the winner is applying

    effect = WorldEffect(world, before_land=slow_enough_to_overlap)
    start = threading.Barrier(CALLERS)

    def call(i: int) -> EffectOutcome:
        start.wait()
        return ledgers[i % WORKERS].perform(
            "req-42/0", "ticket.create", "oncall", {"title": "GPU 3 Xid 79"}, effect
        )

    with ThreadPoolExecutor(CALLERS) as pool:
        outcomes = list(pool.map(call, range(CALLERS)))

    assert effect.applies == 1
    assert world.count("req-42/0") == 1
    assert all(o.state == "applied" for o in outcomes)
    assert len({o.result["seq"] for o in outcomes if o.result}) == 1
    assert sum(not o.replayed for o in outcomes) == 1  # one caller applied; 63 got its recorded result


def test_concurrent_distinct_ops_each_apply_once(
    make_ledger: Callable[..., EffectLedger], world: World
) -> None:
    ledger = make_ledger(owner="w", wait_seconds=30)
    effect = WorldEffect(world)
    ops = [f"wf/scale/replica-{i % 16}" for i in range(CALLERS)]  # 16 ops, 4 callers each
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda op: ledger.perform(op, "k8s.scale", op, {"replicas": 3}, effect), ops))
    assert world.counts() == {f"wf/scale/replica-{i}": 1 for i in range(16)}


def test_paused_lease_holder_is_fenced_out(make_ledger: Callable[..., EffectLedger], world: World) -> None:
    """A holder lands the effect, then stalls (GC pause, partition) past its lease. Another worker takes the
    op over, finds the effect by probing and records it. The stalled holder wakes up: its write is refused."""
    paused = threading.Event()
    resume = threading.Event()

    def stall_after_landing(attempt: Attempt) -> None:
        paused.set()
        resume.wait(10)

    zombie = make_ledger(owner="zombie", lease_seconds=1.0)
    rejections_before = FENCE_REJECTIONS.labels("router.weights")._value.get()
    holder_error: list[BaseException] = []

    def run_zombie() -> None:
        try:
            zombie.perform(
                "wf/ramp/pool",
                "router.weights",
                "pool",
                {"w": 50},
                WorldEffect(world, after_land=stall_after_landing),
            )
        except BaseException as exc:
            holder_error.append(exc)

    thread = threading.Thread(target=run_zombie)
    thread.start()
    assert paused.wait(10)
    # The zombie's lease runs out while it is stalled: time passing its lease, not a state to watch.
    time.sleep(1.2)

    successor_effect = WorldEffect(world)
    successor = make_ledger(owner="successor").perform(
        "wf/ramp/pool", "router.weights", "pool", {"w": 50}, successor_effect
    )
    assert successor.state == "applied" and successor.fence == 2 and successor.replayed
    assert successor_effect.applies == 0 and successor_effect.probes == 1

    resume.set()
    thread.join(10)
    assert len(holder_error) == 1 and isinstance(holder_error[0], FencedOut)
    assert FENCE_REJECTIONS.labels("router.weights")._value.get() == rejections_before + 1

    final = make_ledger(owner="reader").get("wf/ramp/pool")
    assert final is not None and final.state == "applied" and final.fence == 2
    assert final.result == successor.result
    assert world.count("wf/ramp/pool") == 1


def test_stalled_holder_does_not_apply_after_its_lease_ran_out(
    make_ledger: Callable[..., EffectLedger], world: World
) -> None:
    """A takeover whose probe stalls past the lease must not go on to apply: a newer holder may be applying."""
    first = make_ledger(owner="w1", lease_seconds=0.2)
    with pytest.raises(SimulatedCrash):
        first.perform("op-stall", "k", "t", {}, WorldEffect(world, before_land=_crash))
    time.sleep(0.3)

    class SlowProbe(WorldEffect):
        def probe(self, attempt: Attempt) -> dict[str, int] | None:
            found = super().probe(attempt)
            time.sleep(0.3)  # longer than the lease
            return found

    slow = SlowProbe(world)
    with pytest.raises(FencedOut, match="ran out"):
        make_ledger(owner="w2", lease_seconds=0.2).perform("op-stall", "k", "t", {}, slow)
    assert slow.applies == 0 and world.count("op-stall") == 0
    assert make_ledger(owner="w3").perform("op-stall", "k", "t", {}, WorldEffect(world)).state == "applied"
    assert world.count("op-stall") == 1


def _crash(attempt: Attempt) -> None:
    raise SimulatedCrash("worker died")


def test_retry_in_the_same_worker_resolves_at_once_instead_of_waiting_out_its_own_lease(
    make_ledger: Callable[..., EffectLedger], world: World
) -> None:
    """An activity attempt died after landing (its worker lives on); Temporal retries it on the same worker.
    The lease is the worker's own and no call of it is in flight, so the retry probes right away."""
    worker = make_ledger(owner="same-worker", lease_seconds=600, wait_seconds=0.5)
    with pytest.raises(SimulatedCrash):
        worker.perform("wf/label/pod-3", "k8s.label", "pod-3", {}, WorldEffect(world, after_land=_crash))
    retry = WorldEffect(world)
    outcome = worker.perform("wf/label/pod-3", "k8s.label", "pod-3", {}, retry)
    assert outcome.state == "applied" and outcome.replayed and (retry.applies, retry.probes) == (0, 1)
    assert world.count("wf/label/pod-3") == 1
