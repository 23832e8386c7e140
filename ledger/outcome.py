"""The public view of one ledger row: what ``perform`` returns and what audit shows."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict


class EffectOutcome(BaseModel):
    """One operation as the ledger holds it.

    ``replayed`` is true when this call did not touch the target but returned what an
    earlier attempt recorded (or what a probe found).
    """

    model_config = ConfigDict(extra="forbid")

    op_id: str
    kind: str
    target: str
    state: str
    delivery: str
    params: dict[str, Any]
    fingerprint: str
    result: dict[str, Any] | None = None
    error: str | None = None
    attempts: int
    fence: int
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    action_signature: dict[str, Any] | None = None
    workflow_id: str | None = None
    run_id: str | None = None
    step: str | None = None
    request_id: str | None = None
    alert_fingerprints: list[str] = []
    requested_by: str | None = None
    divergences: int = 0
    created_at: datetime
    updated_at: datetime
    resolved_at: datetime | None = None
    replayed: bool = False

    @classmethod
    def from_row(cls, row: Mapping[Any, Any], *, replayed: bool = False) -> EffectOutcome:
        fields = {name: row[name] for name in cls.model_fields if name != "replayed" and name in row}
        return cls(**fields, replayed=replayed)


class DivergenceView(BaseModel):
    """A different request that reused an operation id."""

    op_id: str
    fingerprint: str
    kind: str
    target: str
    params: dict[str, Any]
    workflow_id: str | None = None
    run_id: str | None = None
    step: str | None = None
    request_id: str | None = None
    requested_by: str | None = None
    times_seen: int
    first_seen_at: datetime
    last_seen_at: datetime
