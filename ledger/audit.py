"""Audit queries: every effect fleetmend performed or planned, by operation id, workflow, target, kind,
state and time range, newest first, paginated with an opaque cursor."""

from __future__ import annotations

import base64
import json
from datetime import datetime
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Engine, Table, and_, or_, select

from ledger.models import DivergenceRecord, EffectRecord, EffectState
from ledger.outcome import DivergenceView, EffectOutcome

EFFECTS = cast(Table, EffectRecord.__table__)
DIVERGENCES = cast(Table, DivergenceRecord.__table__)
MAX_PAGE = 500


class InvalidQuery(ValueError):
    """An audit filter or cursor that cannot be used; the message says what to change."""


class EffectFilter(BaseModel):
    """Which ledger rows to show. ``state='divergent'`` lists ops that were re-requested with other params."""

    model_config = ConfigDict(extra="forbid")

    workflow_id: str | None = None
    target: str | None = None
    kind: str | None = None
    state: EffectState | None = None
    request_id: str | None = None
    since: datetime | None = Field(None, description="created at or after (inclusive)")
    until: datetime | None = Field(None, description="created before (exclusive)")

    @field_validator("since", "until")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("give a time zone (e.g. 2026-11-29T10:00:00Z)")
        return value

    def conditions(self) -> list[Any]:
        c = EFFECTS.c
        out: list[Any] = []
        if self.workflow_id:
            out.append(c.workflow_id == self.workflow_id)
        if self.target:
            out.append(c.target == self.target)
        if self.kind:
            out.append(c.kind == self.kind)
        if self.request_id:
            out.append(c.request_id == self.request_id)
        if self.state == EffectState.DIVERGENT:
            out.append(c.divergences > 0)
        elif self.state is not None:
            out.append(c.state == self.state.value)
        if self.since:
            out.append(c.created_at >= self.since)
        if self.until:
            out.append(c.created_at < self.until)
        if self.since and self.until and self.since >= self.until:
            raise InvalidQuery("the time range is empty: 'since' must be before 'until'")
        return out


class EffectPage(BaseModel):
    items: list[EffectOutcome]
    next_cursor: str | None = None


class EffectDetail(BaseModel):
    effect: EffectOutcome
    divergences: list[DivergenceView]


def _encode_cursor(created_at: datetime, op_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), op_id]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created, op_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        return datetime.fromisoformat(created), str(op_id)
    except (ValueError, TypeError) as exc:
        raise InvalidQuery("the page cursor is not one this ledger issued; start again without it") from exc


def list_effects(
    engine: Engine, filters: EffectFilter | None = None, *, limit: int = 50, cursor: str | None = None
) -> EffectPage:
    """A page of effects, newest first. Pass ``next_cursor`` back for the next page."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidQuery(f"page size must be between 1 and {MAX_PAGE}, got {limit}")
    filters = filters or EffectFilter()
    c = EFFECTS.c
    query = select(EFFECTS).where(*filters.conditions())
    if cursor:
        created_at, op_id = _decode_cursor(cursor)
        query = query.where(or_(c.created_at < created_at, and_(c.created_at == created_at, c.op_id < op_id)))
    query = query.order_by(c.created_at.desc(), c.op_id.desc()).limit(limit + 1)
    with engine.connect() as conn:
        rows = conn.execute(query).mappings().all()
    items = [EffectOutcome.from_row(r) for r in rows[:limit]]
    next_cursor = _encode_cursor(items[-1].created_at, items[-1].op_id) if len(rows) > limit else None
    return EffectPage(items=items, next_cursor=next_cursor)


def show_effect(engine: Engine, op_id: str) -> EffectDetail | None:
    """One operation with every divergent request that reused its id."""
    with engine.connect() as conn:
        row = conn.execute(select(EFFECTS).where(EFFECTS.c.op_id == op_id)).mappings().first()
        if row is None:
            return None
        divergent = (
            conn.execute(select(DIVERGENCES).where(DIVERGENCES.c.op_id == op_id).order_by(DIVERGENCES.c.id))
            .mappings()
            .all()
        )
    return EffectDetail(
        effect=EffectOutcome.from_row(row),
        divergences=[DivergenceView.model_validate(dict(d)) for d in divergent],
    )
