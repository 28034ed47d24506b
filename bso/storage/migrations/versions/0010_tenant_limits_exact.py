"""MySQL/MariaDB: tenants' limits kept per tenant name exactly, as every other table's ids.

Revision 0006 gave every bso table of its time utf8mb4's binary collation;
``tenant_limits`` came later (0008) and got the server's, which on most servers
ignores case.  Tenants ``Team-B`` and ``team-b`` are two tenants everywhere else
(their keys, jobs and Redis users), but there setting one's limits deleted the
other's row: ``bso keys limits Team-B`` silently gave ``team-b`` the defaults.
This revision converts the table as 0006 converted the others.  Nothing happens on
SQLite or PostgreSQL, which compare exactly.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 07:30:00+00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_context().dialect.name in ("mysql", "mariadb"):
        op.execute("ALTER TABLE tenant_limits CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")


def downgrade() -> None:
    """Nothing to undo: exact tenant names serve revision 0009 as well."""
