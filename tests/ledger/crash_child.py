"""A worker process that dies by SIGKILL at a chosen point of ``perform`` (test helper).

    python -m tests.ledger.crash_child DATABASE_URL OP_ID POINT

POINT: after_claim | mid_apply | after_apply | after_record. The target is the
world table of the same database (``tests/ledger/world.py``).
"""

from __future__ import annotations

import os
import signal
import sys

from sqlalchemy import text

from ledger import Attempt, EffectLedger
from tests.ledger.world import World, WorldEffect

LEASE_SECONDS = 1.0


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class CrashingWorldEffect(WorldEffect):
    def __init__(self, world: World, point: str) -> None:
        super().__init__(world, by=f"child-{os.getpid()}")
        self.point = point

    def apply(self, attempt: Attempt) -> dict[str, int]:
        if self.point == "after_claim":
            die()
        if self.point == "mid_apply":
            # The target's write is in flight (its transaction open) when the process dies.
            with self.world.engine.connect() as conn:
                conn.execute(
                    text("INSERT INTO world_actions (op_id, applied_by) VALUES (:op, 'mid')"),
                    {"op": attempt.op_id},
                )
                die()
        result = super().apply(attempt)
        if self.point == "after_apply":
            die()
        return result


def main() -> None:
    url, op_id, point = sys.argv[1:4]
    world = World(url)
    ledger = EffectLedger(url, owner=f"child-{os.getpid()}", lease_seconds=LEASE_SECONDS)
    ledger.perform(
        op_id, "ticket.create", "oncall", {"title": "node lost"}, CrashingWorldEffect(world, point)
    )
    if point == "after_record":
        die()  # the activity's completion never reaches Temporal
    print("completed without crashing", file=sys.stderr)
    sys.exit(3)


if __name__ == "__main__":
    main()
