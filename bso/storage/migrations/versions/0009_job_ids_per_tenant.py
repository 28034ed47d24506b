"""Job ids per tenant: a job is kept under its key ``<tenant>/<job id>``.

Two tenants may each have a job ``nightly``, and another tenant's job reads like
one that does not exist (:func:`bso.apikeys.job_key`).  The default tenant's key
is the job id itself, so its jobs stay where they are; every other tenant's job,
its lanes, trials and recorded replies move to the new key.  No existing id holds
a ``/`` (job ids never could), so nothing moved can meet a job already there, and
a second run of the move finds nothing left to move.

The ``job_id`` columns widen to hold a tenant, the separator and a job id, except
on SQLite, which checks no length (see :data:`bso.storage.schema.JOB_KEY`).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 06:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_TENANT = "default"
SEPARATOR = "/"
OLD_LENGTH = 128
NEW_LENGTH = 64 + 1 + 128
_REFERRING = ("lanes", "trials")
"""The tables whose job_id has a foreign key to jobs (named as in revision 0001)."""

_TABLES = sa.MetaData()
_JOBS = sa.Table(
    "jobs",
    _TABLES,
    sa.Column("job_id", sa.String(NEW_LENGTH)),
    sa.Column("spec", sa.Text()),
    sa.Column("created_at", sa.DateTime(timezone=True)),
    sa.Column("next_trial_number", sa.Integer()),
    sa.Column("owner", sa.String(64)),
)
_LANES = sa.Table("lanes", _TABLES, sa.Column("job_id", sa.String(NEW_LENGTH)))
_TRIALS = sa.Table("trials", _TABLES, sa.Column("job_id", sa.String(NEW_LENGTH)))
_REPLIES = sa.Table(
    "replies",
    _TABLES,
    sa.Column("job_id", sa.String(NEW_LENGTH)),
    sa.Column("owner", sa.String(64)),
)


def upgrade() -> None:
    dialect = op.get_context().dialect.name
    if dialect != "sqlite":
        _widen(mysql=dialect in ("mysql", "mariadb"))
    _move_other_tenants_jobs()


def _widen(*, mysql: bool) -> None:
    # MySQL and MariaDB refuse to change a column a foreign key joins (as in 0006).
    if mysql:
        for table in _REFERRING:
            op.drop_constraint(f"fk_{table}_job_id_jobs", table, type_="foreignkey")
    for table in ("jobs", *_REFERRING, "replies"):
        op.alter_column(
            table,
            "job_id",
            type_=sa.String(NEW_LENGTH),
            existing_type=sa.String(OLD_LENGTH),
            existing_nullable=False,
        )
    if mysql:
        for table in _REFERRING:
            op.create_foreign_key(f"fk_{table}_job_id_jobs", table, "jobs", ["job_id"], ["job_id"])


def _unmoved(owner: sa.ColumnElement[str], job_id: sa.ColumnElement[str]) -> sa.ColumnElement[bool]:
    return sa.and_(owner != DEFAULT_TENANT, ~job_id.contains(SEPARATOR))


def _move_other_tenants_jobs() -> None:
    """Statements only (no rows read into Python), so ``alembic upgrade --sql`` prints
    them too.  The foreign keys hold at every step: the job's row under its new key
    comes first, then its lanes and trials follow, then the old row goes."""
    jobs, moving = _JOBS, _unmoved(_JOBS.c.owner, _JOBS.c.job_id)
    op.execute(
        sa.insert(jobs).from_select(
            ["job_id", "spec", "created_at", "next_trial_number", "owner"],
            sa.select(
                jobs.c.owner + SEPARATOR + jobs.c.job_id,
                jobs.c.spec,
                jobs.c.created_at,
                jobs.c.next_trial_number,
                jobs.c.owner,
            ).where(moving),
        )
    )
    old = _JOBS.alias("old")
    for table in (_LANES, _TRIALS):
        new_key = (
            sa.select(old.c.owner + SEPARATOR + old.c.job_id)
            .where(old.c.job_id == table.c.job_id)
            .scalar_subquery()
        )
        op.execute(
            sa.update(table)
            .where(table.c.job_id.in_(sa.select(jobs.c.job_id).where(moving)))
            .values(job_id=new_key)
        )
    op.execute(sa.delete(jobs).where(moving))
    replies = _REPLIES
    op.execute(
        sa.update(replies)
        .where(_unmoved(replies.c.owner, replies.c.job_id))
        .values(job_id=replies.c.owner + SEPARATOR + replies.c.job_id)
    )


def downgrade() -> None:
    """Not supported: two tenants' jobs of one id would have to become one job."""
    raise NotImplementedError("revision 0009 cannot be undone: job ids are per tenant from it on")
