"""One mutating request as the world's own log records it: what reconcile compares the ledger with.

The simulator serves its log as ``GET /sim/v1/actions?since_seq=N`` in this shape
(``sim.actionlog``); ``ledger.reconcile`` reads it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ActionLogEntry(BaseModel):
    """A mutating request the simulated API received: the world's own record."""

    model_config = ConfigDict(extra="forbid")

    seq: int
    time: float
    verb: str
    path: str
    body_digest: str
    client: str
    status: int
