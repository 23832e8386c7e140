"""Effect ledger: one row per operation id, plus the divergent requests that reused one.

Revision ID: 0001_effect_ledger
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001_effect_ledger"
down_revision = None
branch_labels = None
depends_on = None

_STATES = "'planned', 'claimed', 'applied', 'failed', 'needs_operator'"
_DELIVERIES = "'exactly_once', 'at_most_once', 'at_least_once'"


def upgrade() -> None:
    op.create_table(
        "ledger_effects",
        sa.Column("op_id", sa.String(255), primary_key=True),
        sa.Column("kind", sa.String(100), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("params", JSONB(), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("delivery", sa.String(20), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("result", JSONB(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("fence", sa.BigInteger(), nullable=False, server_default=sa.text("1")),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("action_signature", JSONB(), nullable=True),
        sa.Column("workflow_id", sa.String(255), nullable=True),
        sa.Column("run_id", sa.String(255), nullable=True),
        sa.Column("step", sa.String(255), nullable=True),
        sa.Column("request_id", sa.String(255), nullable=True),
        sa.Column("alert_fingerprints", JSONB(), nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("requested_by", sa.String(255), nullable=True),
        sa.Column("divergences", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(f"state IN ({_STATES})", name="ck_ledger_effects_state"),
        sa.CheckConstraint(f"delivery IN ({_DELIVERIES})", name="ck_ledger_effects_delivery"),
        sa.CheckConstraint("char_length(op_id) > 0", name="ck_ledger_effects_op_id_not_empty"),
    )
    op.create_index("ix_ledger_effects_workflow_id", "ledger_effects", ["workflow_id"])
    op.create_index("ix_ledger_effects_target", "ledger_effects", ["target"])
    op.create_index("ix_ledger_effects_kind", "ledger_effects", ["kind"])
    op.create_index("ix_ledger_effects_created_at", "ledger_effects", ["created_at"])
    op.create_index(
        "ix_ledger_effects_unresolved",
        "ledger_effects",
        ["updated_at"],
        postgresql_where=sa.text("state = 'claimed'"),
    )

    op.create_table(
        "ledger_divergences",
        sa.Column("id", sa.BigInteger(), primary_key=True, autoincrement=True),
        sa.Column(
            "op_id",
            sa.String(255),
            sa.ForeignKey("ledger_effects.op_id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(100), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("params", JSONB(), nullable=False),
        sa.Column("workflow_id", sa.String(255), nullable=True),
        sa.Column("run_id", sa.String(255), nullable=True),
        sa.Column("step", sa.String(255), nullable=True),
        sa.Column("request_id", sa.String(255), nullable=True),
        sa.Column("requested_by", sa.String(255), nullable=True),
        sa.Column("times_seen", sa.Integer(), nullable=False, server_default=sa.text("1")),
        sa.Column("first_seen_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.UniqueConstraint("op_id", "fingerprint", name="uq_ledger_divergences_op_fingerprint"),
    )


def downgrade() -> None:
    op.drop_table("ledger_divergences")
    op.drop_index("ix_ledger_effects_unresolved", table_name="ledger_effects")
    op.drop_index("ix_ledger_effects_created_at", table_name="ledger_effects")
    op.drop_index("ix_ledger_effects_kind", table_name="ledger_effects")
    op.drop_index("ix_ledger_effects_target", table_name="ledger_effects")
    op.drop_index("ix_ledger_effects_workflow_id", table_name="ledger_effects")
    op.drop_table("ledger_effects")
