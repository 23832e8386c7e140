"""Gateway policies (what fleetmend wants Envoy to apply per pool), Envoy's ACK/NACK answers, and
the requests Envoy reports through its access-log service.

Revision ID: 0002_gateway_policies
Revises: 0001_effect_ledger
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0002_gateway_policies"
down_revision = "0001_effect_ledger"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE SEQUENCE gateway_policy_revision")
    op.create_table(
        "gateway_policies",
        sa.Column("pool", sa.String(255), primary_key=True),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.Column("policy", JSONB(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_table(
        "gateway_acks",
        sa.Column("node_id", sa.String(255), primary_key=True),
        sa.Column("type_url", sa.String(255), primary_key=True),
        sa.Column("acked_version", sa.String(255), nullable=True),
        sa.Column("nacked_version", sa.String(255), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("admin_url", sa.String(255), nullable=True),
        sa.Column("connected", sa.Boolean(), nullable=False, server_default=sa.text("true")),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )

    op.create_table(
        "gateway_requests",
        sa.Column("id", sa.BigInteger(), primary_key=True, autoincrement=True),
        sa.Column("pool", sa.String(255), nullable=False),
        sa.Column("request_id", sa.String(255), nullable=False),
        sa.Column("tier", sa.String(32), nullable=True),
        sa.Column("replica", sa.String(255), nullable=True),
        sa.Column("route", sa.String(64), nullable=True),
        sa.Column("response_code", sa.Integer(), nullable=False),
        sa.Column("flags", sa.String(128), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=False),
        sa.Column("first_byte_s", sa.Float(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("bytes_sent", sa.BigInteger(), nullable=False),
        sa.Column("envoy", sa.String(255), nullable=False),
    )
    op.create_index("ix_gateway_requests_pool_started", "gateway_requests", ["pool", "started_at"])


def downgrade() -> None:
    op.drop_index("ix_gateway_requests_pool_started", table_name="gateway_requests")
    op.drop_table("gateway_requests")
    op.drop_table("gateway_acks")
    op.drop_table("gateway_policies")
    op.execute("DROP SEQUENCE gateway_policy_revision")
