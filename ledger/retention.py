"""Retention: resolved rows older than the window are deleted; unresolved rows never are.

The window must outlast the longest workflow retry horizon and every downstream
idempotency window (Stripe keeps keys 24 h, AWS client tokens ≥ 24 h): a retry that
arrives after its row was pruned would be treated as a new operation.
"""

from __future__ import annotations

from datetime import timedelta
from typing import cast

from sqlalchemy import Engine, Table, delete, func

from ledger.models import EffectRecord, EffectState

EFFECTS = cast(Table, EffectRecord.__table__)
DEFAULT_RETENTION = timedelta(days=30)
# claimed (outcome may be unknown) and needs_operator rows wait for a person, however old.
PRUNABLE_STATES = (EffectState.APPLIED, EffectState.FAILED, EffectState.PLANNED)


def prune(engine: Engine, *, older_than: timedelta = DEFAULT_RETENTION, dry_run: bool = False) -> int:
    """Delete resolved rows resolved more than ``older_than`` ago; return how many (would be) deleted."""
    if older_than < timedelta(0):
        raise ValueError("the retention window cannot be negative")
    c = EFFECTS.c
    cutoff = func.now() - older_than
    condition = (
        c.state.in_([s.value for s in PRUNABLE_STATES]),
        func.coalesce(c.resolved_at, c.updated_at) < cutoff,
    )
    with engine.begin() as conn:
        if dry_run:
            return int(
                conn.execute(func.count().select().select_from(EFFECTS).where(*condition)).scalar_one()
            )
        return conn.execute(delete(EFFECTS).where(*condition)).rowcount
