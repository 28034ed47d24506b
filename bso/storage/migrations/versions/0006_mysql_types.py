"""MySQL/MariaDB: ids compared exactly, timestamps to the microsecond.

Revisions 0001 to 0005 leave MySQL's defaults: the server's collation, which on
most servers ignores case (``Job-A`` and ``job-a`` would be one job, unlike on
SQLite and PostgreSQL), and DATETIME without fractional seconds (a trial's times
would lose their microseconds, and the events of one second would tie).  This
revision converts every bso table to utf8mb4 with its binary collation and
every timestamp to DATETIME(6).  A database that an earlier bso migrated
(``bso migrate`` accepted MySQL before the store did) is converted the same way.
Nothing happens on SQLite or PostgreSQL.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27 07:00:00+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLES = ("jobs", "lanes", "trials", "replies", "api_keys")
_REFERRING = ("lanes", "trials")
"""The tables whose job_id has a foreign key to jobs (named as in revision 0001)."""
# Each table's timestamps, and whether they may be NULL.
_TIMESTAMPS = {
    "jobs": {"created_at": False},
    "trials": {"created_at": False, "updated_at": False},
    "replies": {"created_at": False},
    "api_keys": {"created_at": False, "revoked_at": True},
}


def upgrade() -> None:
    if op.get_context().dialect.name not in ("mysql", "mariadb"):
        return
    # MySQL and MariaDB refuse to change the collation of a column a foreign key
    # joins: the keys go while both sides change, and come back as they were.
    for table in _REFERRING:
        op.drop_constraint(f"fk_{table}_job_id_jobs", table, type_="foreignkey")
    for table in _TABLES:
        op.execute(f"ALTER TABLE {table} CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
    for table in _REFERRING:
        op.create_foreign_key(f"fk_{table}_job_id_jobs", table, "jobs", ["job_id"], ["job_id"])
    for table, columns in _TIMESTAMPS.items():
        for column, nullable in columns.items():
            op.alter_column(
                table,
                column,
                type_=mysql.DATETIME(fsp=6),
                existing_type=sa.DateTime(timezone=True),
                existing_nullable=nullable,
            )


def downgrade() -> None:
    """Nothing to undo: exact ids and finer timestamps serve revision 0005 as well."""
