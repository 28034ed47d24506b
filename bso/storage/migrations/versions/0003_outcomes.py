"""Outcomes: a trial's lease (heartbeats) and a lane's memory re-probe mark.

Both columns are nullable and new: existing trials keep the service's heartbeat
timeout, existing lanes have never been re-probed.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25 00:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("trials", sa.Column("lease_s", sa.Double(), nullable=True))
    op.add_column("lanes", sa.Column("memory_reprobed_through", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("lanes") as batch:
        batch.drop_column("memory_reprobed_through")
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("lease_s")
