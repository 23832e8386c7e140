"""The ledger's tables (SQLAlchemy 2). The alembic migrations in ``ledger/migrations`` create them.

``ledger_effects`` holds one row per operation id: what was asked (kind, target,
canonical params and their fingerprint), who asked (workflow, run, step, alert
fingerprints, request id), how delivery is guaranteed, the lease and fencing
token of whoever is performing it, and the outcome. ``ledger_divergences`` keeps
every *different* request that reused an operation id: the original row is the
truth about the world and is never overwritten by a divergent caller.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

MAX_OPERATION_ID_LENGTH = 255


class EffectState(StrEnum):
    """Where an operation stands. ``claimed`` is the only unresolved state."""

    PLANNED = "planned"  # dry run: computed and recorded, never performed
    CLAIMED = "claimed"  # someone holds (or held) the lease; the effect may or may not have happened
    APPLIED = "applied"
    FAILED = "failed"  # the target refused for good; the error is recorded
    DIVERGENT = "divergent"  # audit filter only: ops that were re-requested with different params
    NEEDS_OPERATOR = "needs_operator"  # outcome unknown and the kind cannot be probed or repeated


RESOLVED_STATES = (EffectState.APPLIED, EffectState.FAILED, EffectState.NEEDS_OPERATOR, EffectState.PLANNED)
# States a row can actually hold (DIVERGENT is a flag kept in ledger_divergences).
ROW_STATES = (
    EffectState.PLANNED,
    EffectState.CLAIMED,
    EffectState.APPLIED,
    EffectState.FAILED,
    EffectState.NEEDS_OPERATOR,
)


class Delivery(StrEnum):
    """What an effect kind can promise when an attempt's outcome is unknown.

    ``exactly_once``: the kind can probe the target (and usually passes the op id
    downstream as an idempotency key), so an unknown outcome is resolved by looking.
    ``at_most_once``: no probe; an unknown outcome is handed to an operator, never repeated.
    ``at_least_once``: no probe; an unknown outcome is repeated, accepting a possible duplicate.
    """

    EXACTLY_ONCE = "exactly_once"
    AT_MOST_ONCE = "at_most_once"
    AT_LEAST_ONCE = "at_least_once"


def _enum_check(column: str, values: tuple[StrEnum, ...] | type[StrEnum]) -> str:
    listed = ", ".join(f"'{v.value}'" for v in values)
    return f"{column} IN ({listed})"


metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class Base(DeclarativeBase):
    metadata = metadata


class EffectRecord(Base):
    __tablename__ = "ledger_effects"

    op_id: Mapped[str] = mapped_column(String(MAX_OPERATION_ID_LENGTH), primary_key=True)
    kind: Mapped[str] = mapped_column(String(100))
    target: Mapped[str] = mapped_column(Text)
    params: Mapped[dict[str, Any]] = mapped_column(JSONB(none_as_null=True))
    fingerprint: Mapped[str] = mapped_column(String(64))
    delivery: Mapped[str] = mapped_column(String(20))
    state: Mapped[str] = mapped_column(String(20))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))
    error: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # Kleppmann-style fencing token: bumped on every (re)claim; every write checks it.
    fence: Mapped[int] = mapped_column(BigInteger, server_default=text("1"))
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # What the world's action log will show when this effect lands (reconciliation).
    action_signature: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))
    # Who asked.
    workflow_id: Mapped[str | None] = mapped_column(String(255))
    run_id: Mapped[str | None] = mapped_column(String(255))
    step: Mapped[str | None] = mapped_column(String(255))
    request_id: Mapped[str | None] = mapped_column(String(255))
    alert_fingerprints: Mapped[list[str]] = mapped_column(JSONB, server_default=text("'[]'::jsonb"))
    requested_by: Mapped[str | None] = mapped_column(String(255))
    divergences: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    resolved_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        CheckConstraint(_enum_check("state", ROW_STATES), name="state"),
        CheckConstraint(_enum_check("delivery", Delivery), name="delivery"),
        CheckConstraint("char_length(op_id) > 0", name="op_id_not_empty"),
        Index("ix_ledger_effects_workflow_id", "workflow_id"),
        Index("ix_ledger_effects_target", "target"),
        Index("ix_ledger_effects_kind", "kind"),
        Index("ix_ledger_effects_created_at", "created_at"),
        # Reconcile and the audit "what is stuck" view scan only unresolved rows.
        Index(
            "ix_ledger_effects_unresolved",
            "updated_at",
            postgresql_where=text("state = 'claimed'"),
        ),
    )


class DivergenceRecord(Base):
    __tablename__ = "ledger_divergences"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    op_id: Mapped[str] = mapped_column(
        String(MAX_OPERATION_ID_LENGTH), ForeignKey("ledger_effects.op_id", ondelete="CASCADE")
    )
    fingerprint: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(100))
    target: Mapped[str] = mapped_column(Text)
    params: Mapped[dict[str, Any]] = mapped_column(JSONB(none_as_null=True))
    workflow_id: Mapped[str | None] = mapped_column(String(255))
    run_id: Mapped[str | None] = mapped_column(String(255))
    step: Mapped[str | None] = mapped_column(String(255))
    request_id: Mapped[str | None] = mapped_column(String(255))
    requested_by: Mapped[str | None] = mapped_column(String(255))
    times_seen: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    first_seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    last_seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    __table_args__ = (UniqueConstraint("op_id", "fingerprint", name="uq_ledger_divergences_op_fingerprint"),)


effects_table = EffectRecord.__table__
divergences_table = DivergenceRecord.__table__


class GatewayPolicyRecord(Base):
    """The gateway policy fleetmend wants for one pool (weights, admission, retry), one row per pool.

    Written by the gateway adapter (``activities/envoy_gateway.py``) inside a ledger effect; read by
    the xDS control plane (``gateway/``), which renders it into Envoy resources. ``revision`` comes from
    one sequence, so a single number orders every change across pools and the Envoy resource
    versions carry it: an Envoy that ACKed version ``p<r>`` has every change up to ``r``.
    """

    __tablename__ = "gateway_policies"

    pool: Mapped[str] = mapped_column(String(255), primary_key=True)
    revision: Mapped[int] = mapped_column(BigInteger)
    policy: Mapped[dict[str, Any]] = mapped_column(JSONB(none_as_null=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class GatewayAckRecord(Base):
    """What each Envoy last answered the control plane, per resource type (ACK or NACK, with Envoy's text)."""

    __tablename__ = "gateway_acks"

    node_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    type_url: Mapped[str] = mapped_column(String(255), primary_key=True)
    acked_version: Mapped[str | None] = mapped_column(String(255))
    nacked_version: Mapped[str | None] = mapped_column(String(255))
    error: Mapped[str | None] = mapped_column(Text)
    # Where this Envoy's admin answers (its bootstrap's node metadata ``admin_url``): the adapter
    # reads the routing set and host health there.
    admin_url: Mapped[str | None] = mapped_column(String(255))
    connected: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class GatewayRequestRecord(Base):
    """One request as an Envoy reported it (access-log service), kept for the in-flight record.

    ``started_at`` is unix seconds; rows older than the retention are pruned by the control plane.
    """

    __tablename__ = "gateway_requests"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    pool: Mapped[str] = mapped_column(String(255))
    request_id: Mapped[str] = mapped_column(String(255))
    tier: Mapped[str | None] = mapped_column(String(32))
    replica: Mapped[str | None] = mapped_column(String(255))
    route: Mapped[str | None] = mapped_column(String(64))
    response_code: Mapped[int] = mapped_column(Integer)
    flags: Mapped[str] = mapped_column(String(128))
    started_at: Mapped[float] = mapped_column(Float)
    duration_s: Mapped[float] = mapped_column(Float)
    first_byte_s: Mapped[float | None] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer)
    bytes_sent: Mapped[int] = mapped_column(BigInteger)
    envoy: Mapped[str] = mapped_column(String(255))

    __table_args__ = (Index("ix_gateway_requests_pool_started", "pool", "started_at"),)


gateway_policies_table = cast(Table, GatewayPolicyRecord.__table__)
gateway_acks_table = cast(Table, GatewayAckRecord.__table__)
gateway_requests_table = cast(Table, GatewayRequestRecord.__table__)
