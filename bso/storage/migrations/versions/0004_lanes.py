"""Lanes with their own batch plan, and the batch size of a trial's latest epoch.

Both columns are nullable and new: an existing lane uses its job's batch sizes,
an existing trial ran at its own size throughout.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 19:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("lanes", sa.Column("plan", sa.Text(), nullable=True))
    op.add_column("trials", sa.Column("current_batch_size", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("current_batch_size")
    with op.batch_alter_table("lanes") as batch:
        batch.drop_column("plan")
