"""Tenants' admission limits (bso.apikeys.TenantLimits): a row per tenant given its own.

No row for any existing tenant: each keeps the defaults.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28 03:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenant_limits",
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("max_queue", sa.Integer(), nullable=False),
        sa.Column("per_second", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("tenant"),
    )


def downgrade() -> None:
    op.drop_table("tenant_limits")
