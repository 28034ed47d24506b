"""A deleted job's next trial number (retired_jobs): registered again, it numbers on.

No row for jobs deleted before this revision: their ids start from 1 again once, as
they did.  On MySQL/MariaDB the table gets utf8mb4's binary collation, as every
other bso table (0006, 0010): job ids ``Job`` and ``job`` are two jobs.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 19:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JOB_KEY_LENGTH = 193
"""bso.storage.schema.JOB_KEY_LENGTH at this revision (a tenant, a colon, a job id)."""


def upgrade() -> None:
    job_key = sa.String(JOB_KEY_LENGTH).with_variant(sa.String(128), "sqlite")
    op.create_table(
        "retired_jobs",
        sa.Column("job_id", job_key, nullable=False),
        sa.Column("next_trial_number", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("job_id"),
    )
    if op.get_context().dialect.name in ("mysql", "mariadb"):
        op.execute("ALTER TABLE retired_jobs CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")


def downgrade() -> None:
    op.drop_table("retired_jobs")
