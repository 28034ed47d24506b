"""Detached runs: a trial delivered from the client's journal after an outage.

The column is new and false for every existing trial: each was reported live.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27 06:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "trials",
        sa.Column("detached", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("detached")
