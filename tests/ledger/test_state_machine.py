"""Hypothesis stateful test of the ledger's state machine.

Random interleavings of attempts (each a fresh worker) that crash after the claim, crash after landing,
fail transiently before or after landing, crash inside the probe, fail for good, reuse the op id with
different params, or run dry; leases expiring; retries. Invariants after every step: applications per op
id ≤ 1; an applied row has exactly its one application; a landed effect always has its ledger row; fences
never go back. At the end, retrying every op resolves it (applied, failed, or flagged for an operator).
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any, ClassVar

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from sqlalchemy import Engine, text

from ledger import (
    Attempt,
    Delivery,
    DivergentOperation,
    EffectFailed,
    EffectLedger,
    NeedsOperator,
    PermanentEffectError,
    RetryableLedgerError,
)
from ledger.store import make_engine
from tests.ledger.world import SimulatedCrash, World, WorldEffect

OPS = {"a": Delivery.EXACTLY_ONCE, "b": Delivery.EXACTLY_ONCE, "c": Delivery.AT_MOST_ONCE}
FAULTS = [
    "none",
    "crash_after_claim",
    "crash_after_landing",
    "transient_before_landing",
    "transient_after_landing",
    "crash_in_probe",
    "permanent",
]


class FaultyEffect(WorldEffect):
    def __init__(self, world: World, fault: str) -> None:
        super().__init__(world)
        self.fault = fault

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        if self.fault == "crash_after_claim":
            raise SimulatedCrash()
        if self.fault == "transient_before_landing":
            raise ConnectionResetError("connection reset before the request was sent")
        if self.fault == "permanent":
            raise PermanentEffectError("target refused")
        result = super().apply(attempt)
        if self.fault == "crash_after_landing":
            raise SimulatedCrash()
        if self.fault == "transient_after_landing":
            raise TimeoutError("response lost")
        return result

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        if self.fault == "crash_in_probe":
            raise SimulatedCrash()
        return super().probe(attempt)


class FaultyNoProbeEffect(FaultyEffect):
    def __init__(self, world: World, fault: str, delivery: Delivery) -> None:
        super().__init__(world, fault)
        self.delivery = delivery

    def has_probe(self) -> bool:
        return False


class LedgerMachine(RuleBasedStateMachine):
    engine: ClassVar[Engine]
    world: ClassVar[World]
    endings: ClassVar[Counter[str]] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.prefix = uuid.uuid4().hex[:10]
        self.fences: dict[str, int] = {}
        self.workers = 0

    def op_id(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def new_worker(self) -> EffectLedger:
        # Every attempt is a different worker (a crashed process never comes back with the same identity).
        self.workers += 1
        return EffectLedger(self.engine, owner=f"w{self.workers}", lease_seconds=30, wait_seconds=0)

    def effect(self, name: str, fault: str) -> FaultyEffect:
        delivery = OPS[name]
        if delivery == Delivery.EXACTLY_ONCE:
            return FaultyEffect(self.world, fault)
        return FaultyNoProbeEffect(self.world, fault, delivery)

    def row(self, name: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            found = (
                conn.execute(
                    text("SELECT state, fence, params FROM ledger_effects WHERE op_id = :op"),
                    {"op": self.op_id(name)},
                )
                .mappings()
                .first()
            )
        return dict(found) if found else None

    @rule(name=st.sampled_from(sorted(OPS)), fault=st.sampled_from(FAULTS), divergent=st.booleans())
    def attempt(self, name: str, fault: str, divergent: bool) -> None:
        before = self.world.count(self.op_id(name))
        params = {"v": 2 if divergent else 1}
        try:
            self.new_worker().perform(self.op_id(name), "k8s.patch", name, params, self.effect(name, fault))
        except DivergentOperation:
            assert self.world.count(self.op_id(name)) == before, "a divergent request touched the target"
        except (SimulatedCrash, RetryableLedgerError, EffectFailed, NeedsOperator):
            pass

    @rule(name=st.sampled_from(sorted(OPS)))
    def dry_run(self, name: str) -> None:
        before = self.world.count(self.op_id(name))
        try:
            self.new_worker().perform(
                self.op_id(name), "k8s.patch", name, {"v": 1}, self.effect(name, "none"), dry_run=True
            )
        except (DivergentOperation, EffectFailed, NeedsOperator):
            pass
        assert self.world.count(self.op_id(name)) == before

    @rule()
    def leases_expire(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE ledger_effects SET lease_expires_at = now() - interval '1 second' "
                    "WHERE state = 'claimed' AND op_id LIKE :prefix"
                ),
                {"prefix": f"{self.prefix}/%"},
            )

    @invariant()
    def at_most_one_application_and_rows_match_the_world(self) -> None:
        for name in OPS:
            landed = self.world.count(self.op_id(name))
            row = self.row(name)
            assert landed <= 1, f"{name} applied {landed} times"
            if row is None:
                assert landed == 0, f"{name} landed with no ledger row (orphan)"
                continue
            if row["state"] == "applied":
                assert landed == 1, f"{name} recorded applied but not in the world"
            if row["state"] in ("failed", "planned"):
                assert landed == 0
            assert row["fence"] >= self.fences.get(name, 0), "fencing token went back"
            self.fences[name] = row["fence"]

    def teardown(self) -> None:
        self.leases_expire()
        for name in OPS:
            row = self.row(name)
            if row is None:
                continue
            try:
                self.new_worker().perform(
                    self.op_id(name), "k8s.patch", name, row["params"], self.effect(name, "none")
                )
            except (EffectFailed, NeedsOperator):
                pass
            final = self.row(name)
            assert final is not None
            assert final["state"] in ("applied", "failed", "needs_operator"), f"{name} unresolved: {final}"
            landed = self.world.count(self.op_id(name))
            ending = f"{final['state']} ({'after a takeover' if final['fence'] > 1 else 'first holder'})"
            event(ending)
            self.endings[ending] += 1
            assert landed == {"applied": 1, "failed": 0}.get(final["state"], landed) and landed <= 1


def test_ledger_state_machine(ledger_url: str) -> None:
    LedgerMachine.engine = make_engine(ledger_url, pool_size=5, max_overflow=5)
    LedgerMachine.world = World(ledger_url)
    try:
        run_state_machine_as_test(
            LedgerMachine,
            settings=settings(
                max_examples=60,
                derandomize=True,  # the same interleavings every run: CI stays reproducible
                stateful_step_count=25,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
        print("how the ops ended:", dict(LedgerMachine.endings))
        # The interleavings must reach every resolution, not only the happy path.
        assert {"applied (after a takeover)", "applied (first holder)", "failed (first holder)"} <= set(
            LedgerMachine.endings
        )
        assert any(ending.startswith("needs_operator") for ending in LedgerMachine.endings)
    finally:
        LedgerMachine.engine.dispose()
        LedgerMachine.world.close()
