"""Micro-batch exploration: each trial keeps the timings its run measured.

The column is new and NULL for every existing trial: none explored micro-batches.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28 00:10:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("trials", sa.Column("micro_batches", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("micro_batches")
