"""The SQLAlchemy engine of the SQL store, and the migrations that make its tables.

:func:`make_engine` gives every caller (the store, the migrations, audits) the
same driver, pragmas and connection pool.  Tables are created only by the
Alembic migrations in ``bso/storage/migrations`` (:func:`upgrade`), and a store
refuses a database that is not at their head (:func:`check_schema`).  Alembic
is imported only where migrations run: importing it would double a worker's
start-up.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, create_engine, event, exc, inspect, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection

from bso.storage.schema import SCHEMA_REVISION, VERSION_TABLE

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

SQLITE_BUSY_TIMEOUT_S = 60.0
"""How long a SQLite writer waits for the write lock before giving up."""
SQLITE_READ_OPTION = "bso_sqlite_read"
"""Execution option that makes SQLite begin a deferred (read) transaction, so that
pure reads do not queue behind writers."""
_MIGRATION_LOCK_KEY = 0x62736F  # "bso"
"""pg_advisory_xact_lock key serializing concurrent upgrades of one database."""


class SchemaNotCurrentError(RuntimeError):
    """The database lacks the bso tables or is at another migration revision.

    ``url`` is the database's URL with its password hidden, so that a command can
    tell its user which database to migrate (``bso migrate --database-url``).
    """

    def __init__(self, message: str, url: str = "") -> None:
        super().__init__(message)
        self.url = url


def alembic_config() -> Config:
    """Alembic configuration of the packaged migrations, wherever bso is installed."""
    from alembic.config import Config

    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def make_engine(url: str) -> Engine:
    """Engine with the pool, pragmas and transaction start the store relies on.

    ``postgresql://`` URLs get the psycopg 3 driver (SQLAlchemy would otherwise
    pick psycopg2, which bso does not install).
    """
    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite":
        engine = _sqlite_engine(parsed)
    else:
        engine = create_engine(parsed)
    _discard_connections_across_fork(engine)
    return engine


def _sqlite_engine(url: URL) -> Engine:
    if url.database in (None, "", ":memory:"):
        raise ValueError(
            "the SQL store needs a SQLite file (sqlite:///path/to/bso.db): an in-memory "
            "database is private to one connection; use MemoryStore instead"
        )
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
        # SQLAlchemy's documented pysqlite recipe: stop the driver from emitting its
        # own deferred BEGIN so that the "begin" listener below, and the store's
        # units of work, decide how to begin.
        dbapi_connection.isolation_level = None
        _use_wal(dbapi_connection)
        cursor = dbapi_connection.cursor()
        # In WAL mode NORMAL survives application crashes; only an OS crash or
        # power loss may lose the last commits, in exchange for no fsync per event.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection: Connection) -> None:
        # A write takes the database's write lock up front, as the store's units of
        # work do (bso.storage.sql.sqlite_lock).
        read_only = connection.get_execution_options().get(SQLITE_READ_OPTION, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def _use_wal(dbapi_connection: Any) -> None:
    """Switch the database to write-ahead logging (a persistent setting).

    The switch needs the database to itself, and SQLite does not wait for that
    (no busy handler), so connections opening a brand-new database at once (the
    workers and ``bso migrate`` of a first start) would fail with "database is
    locked": wait for the others' transactions, up to the busy timeout.
    """
    import sqlite3

    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    while True:
        try:
            dbapi_connection.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _discard_connections_across_fork(engine: Engine) -> None:
    """SQLAlchemy's pool recipe for ``os.fork``: a child never reuses the parent's sockets.

    Celery's prefork pool forks workers from a parent that may already hold a
    store; sharing a connection between processes corrupts both sessions.
    """

    @event.listens_for(engine, "connect")
    def _remember_pid(_dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        record.info["pid"] = os.getpid()

    @event.listens_for(engine, "checkout")
    def _check_pid(
        _dbapi_connection: Any, record: ConnectionPoolEntry, proxy: PoolProxiedConnection
    ) -> None:
        if record.info["pid"] != os.getpid():
            # Detach without closing: closing would end the parent's session too.
            record.dbapi_connection = proxy.dbapi_connection = None  # type: ignore[misc]
            raise exc.DisconnectionError("connection belongs to another process; reconnecting")


def upgrade(url: str) -> None:
    """Apply the Alembic migrations to head; a no-op on a database already there.

    Safe to call from several processes at once: PostgreSQL serializes the
    upgrades with an advisory lock, SQLite with its write lock.
    """
    from alembic import command

    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(
                    text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY}
                )
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
    finally:
        engine.dispose()


def check_schema(engine: Engine) -> None:
    """Refuse a database whose ``alembic_version`` is not :data:`SCHEMA_REVISION`."""
    with engine.connect() as connection:
        connection.execution_options(**{SQLITE_READ_OPTION: True})
        found: set[str] = set()
        if inspect(connection).has_table(VERSION_TABLE):
            version = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))
            found = set(version.scalars())
    if found != {SCHEMA_REVISION}:
        url = engine.url.render_as_string(hide_password=True)
        raise SchemaNotCurrentError(
            f"database {url} is not at the current bso schema (found "
            f"{', '.join(sorted(found)) or 'no bso tables'}, need {SCHEMA_REVISION}); apply the "
            "migrations with `bso migrate --database-url URL` or "
            "bso.storage.sql.engine.upgrade(url)",
            url,
        )
