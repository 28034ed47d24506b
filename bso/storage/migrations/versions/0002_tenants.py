"""Tenants: job owners, API keys, replies per (job, event id) with the body's hash.

Jobs and replies that exist before this revision belong to the ``default``
tenant, the one whose key ``bso up`` generates.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24 00:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_TENANT = "default"

# The two altered tables as revision 0001 left them: batch mode recreates them on
# SQLite, and with these it needs no reflection, so `alembic upgrade --sql` works.
_OLD = sa.MetaData()
_JOBS_0001 = sa.Table(
    "jobs",
    _OLD,
    sa.Column("job_id", sa.String(128), nullable=False),
    sa.Column("spec", sa.Text(), nullable=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("next_trial_number", sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint("job_id", name="pk_jobs"),
)
_REPLIES_0001 = sa.Table(
    "replies",
    _OLD,
    sa.Column("event_id", sa.String(128), nullable=False),
    sa.Column("job_id", sa.String(128), nullable=False),
    sa.Column("reply", sa.Text(), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint("event_id", name="pk_replies"),
    sa.Index("ix_replies_created_at", "created_at"),
)


def upgrade() -> None:
    # Rows from before this revision belong to the default tenant; new rows always
    # name their owner, so the server default goes once the old rows are filled.
    with op.batch_alter_table("jobs", copy_from=_JOBS_0001) as batch:
        batch.add_column(
            sa.Column("owner", sa.String(64), nullable=False, server_default=DEFAULT_TENANT)
        )
    with op.batch_alter_table("replies", copy_from=_REPLIES_0001) as batch:
        batch.add_column(sa.Column("body_sha256", sa.String(64), nullable=True))
        batch.add_column(
            sa.Column("owner", sa.String(64), nullable=False, server_default=DEFAULT_TENANT)
        )
        batch.drop_constraint("pk_replies", type_="primary")
        batch.create_primary_key("pk_replies", ["job_id", "event_id"])
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(16), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("secret_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("key_id", name="pk_api_keys"),
    )


def downgrade() -> None:
    op.drop_table("api_keys")
    with op.batch_alter_table("replies") as batch:
        batch.drop_constraint("pk_replies", type_="primary")
        batch.create_primary_key("pk_replies", ["event_id"])
        batch.drop_column("owner")
        batch.drop_column("body_sha256")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("owner")
