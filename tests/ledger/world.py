"""A target for ledger tests: a table in the test database that counts every application.

Test code only. It is deliberately *not* idempotent (no unique op id), so a
repeated apply shows up as two rows and the tests can count applications exactly.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import Engine, create_engine, text

from ledger import ActionSignature, Attempt, Delivery, Effect, PermanentEffectError

WORLD_DDL = """
CREATE TABLE IF NOT EXISTS world_actions (
    seq bigserial PRIMARY KEY,
    op_id text NOT NULL,
    applied_by text,
    at timestamptz NOT NULL DEFAULT now()
)
"""


class SimulatedCrash(BaseException):
    """Raised inside an effect to end the attempt the way a killed worker would: the ledger does not
    catch it (it is not an ``Exception``), so nothing is recorded after it. The kill -9 tests do the same
    with real processes."""


class World:
    """The ``world_actions`` table in one test database."""

    def __init__(self, url: str) -> None:
        self.engine: Engine = create_engine(url, pool_size=20, max_overflow=80)
        with self.engine.begin() as conn:
            conn.execute(text(WORLD_DDL))

    def land(self, op_id: str, by: str = "") -> int:
        with self.engine.begin() as conn:
            return int(
                conn.execute(
                    text("INSERT INTO world_actions (op_id, applied_by) VALUES (:op, :by) RETURNING seq"),
                    {"op": op_id, "by": by},
                ).scalar_one()
            )

    def find(self, op_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                text("SELECT seq FROM world_actions WHERE op_id = :op ORDER BY seq LIMIT 1"), {"op": op_id}
            ).first()
        return {"seq": int(row[0])} if row else None

    def count(self, op_id: str) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM world_actions WHERE op_id = :op"), {"op": op_id}
                ).scalar_one()
            )

    def counts(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(text("SELECT op_id, count(*) FROM world_actions GROUP BY op_id")).all()
        return {str(op): int(n) for op, n in rows}

    def close(self) -> None:
        self.engine.dispose()


class WorldEffect(Effect):
    """Lands one row in the world table; probes by op id. Counts its own apply/probe calls."""

    delivery = Delivery.EXACTLY_ONCE

    def __init__(self, world: World, by: str = "", before_land: Any = None, after_land: Any = None) -> None:
        self.world = world
        self.by = by
        self.before_land = before_land
        self.after_land = after_land
        self.applies = 0
        self.probes = 0
        self._lock = threading.Lock()

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        with self._lock:
            self.applies += 1
        if self.before_land:
            self.before_land(attempt)
        seq = self.world.land(attempt.op_id, self.by)
        if self.after_land:
            self.after_land(attempt)
        return {"seq": seq}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        with self._lock:
            self.probes += 1
        return self.world.find(attempt.op_id)

    def action_signature(self, attempt: Attempt) -> ActionSignature | None:
        return ActionSignature(
            world="test-world", verb="INSERT", path="world_actions", body_digest=attempt.op_id
        )


class NoProbeWorldEffect(WorldEffect):
    """The same target, for a kind declared at-most-once or at-least-once (no probe)."""

    def __init__(self, world: World, delivery: Delivery, **kwargs: Any) -> None:
        super().__init__(world, **kwargs)
        self.delivery = delivery

    def has_probe(self) -> bool:
        return False

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        raise AssertionError("the ledger must never probe a kind that declares no probe")


class RefusingEffect(Effect):
    """A target that refuses for good (e.g. a 4xx)."""

    def __init__(self) -> None:
        self.applies = 0

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        self.applies += 1
        raise PermanentEffectError("target refused: node 'gpu-9' does not exist")

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        return None
