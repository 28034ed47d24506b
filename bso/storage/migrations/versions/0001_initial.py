"""Initial schema: jobs, lanes, trials and recorded replies.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 00:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(128), nullable=False),
        sa.Column("spec", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("next_trial_number", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name="pk_jobs"),
    )
    op.create_table(
        "lanes",
        sa.Column("job_id", sa.String(128), nullable=False),
        sa.Column("hardware_key", sa.String(160), nullable=False),
        sa.Column("hardware", sa.Text(), nullable=False),
        sa.Column("rng_state", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("job_id", "hardware_key", name="pk_lanes"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.job_id"], name="fk_lanes_job_id_jobs"),
    )
    op.create_table(
        "trials",
        sa.Column("job_id", sa.String(128), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=False),
        sa.Column("hardware_key", sa.String(160), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(32), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("epochs", sa.Integer(), nullable=False),
        sa.Column("time_s", sa.Double(), nullable=False),
        sa.Column("energy_j", sa.Double(), nullable=False),
        sa.Column("cost", sa.Double(), nullable=False),
        sa.Column("last_metric", sa.Double(), nullable=True),
        sa.Column("stop_reason", sa.String(32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "trial_number", name="pk_trials"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.job_id"], name="fk_trials_job_id_jobs"),
    )
    op.create_index("ix_trials_status_updated_at", "trials", ["status", "updated_at"])
    op.create_table(
        "replies",
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("job_id", sa.String(128), nullable=False),
        sa.Column("reply", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("event_id", name="pk_replies"),
    )
    op.create_index("ix_replies_created_at", "replies", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_replies_created_at", table_name="replies")
    op.drop_table("replies")
    op.drop_index("ix_trials_status_updated_at", table_name="trials")
    op.drop_table("trials")
    op.drop_table("lanes")
    op.drop_table("jobs")
