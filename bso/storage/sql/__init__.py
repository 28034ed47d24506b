"""The durable store on SQLAlchemy 2 Core: a SQLite file, PostgreSQL (psycopg 3) or
MySQL/MariaDB (PyMySQL).

:class:`SqlStore` (:mod:`~bso.storage.sql.store`) and :func:`upgrade` (the
migrations) are the package's entry.  Its
engine and the Alembic migrations are set up in :mod:`~bso.storage.sql.engine`,
the SQL of its units of work is in :mod:`~bso.storage.sql.statements` and runs
on :mod:`~bso.storage.sql.session`, and each dialect locks a job its own way
(:mod:`~bso.storage.sql.locking`: :mod:`~bso.storage.sql.sqlite_lock`,
:mod:`~bso.storage.sql.postgres_lock`, :mod:`~bso.storage.sql.mysql_lock`).
"""

from bso.storage.sql.engine import upgrade
from bso.storage.sql.store import SqlStore

__all__ = ["SqlStore", "upgrade"]
