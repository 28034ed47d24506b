"""The SQLAlchemy engine of the SQL store, and the migrations that make its tables.

:func:`make_engine` gives every caller (the store, the migrations, audits) the
same driver, pragmas, isolation level and connection pool, on SQLite, PostgreSQL
and MySQL/MariaDB.  Tables are created only by the
Alembic migrations in ``bso/storage/migrations`` (:func:`upgrade`), and a store
refuses a database that is not at their head (:func:`check_schema`).  Alembic
is imported only where migrations run: importing it would double a worker's
start-up.
"""

from __future__ import annotations

import hashlib
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, create_engine, event, exc, inspect, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import ConnectionPoolEntry

from bso.storage.schema import SCHEMA_REVISION, VERSION_TABLE

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

SQLITE_BUSY_TIMEOUT_S = 60.0
"""How long a SQLite writer waits for the write lock before giving up."""
SQLITE_READ_OPTION = "bso_sqlite_read"
"""Execution option that marks a pure read: SQLite begins a deferred (read)
transaction, so that pure reads do not queue behind writers; MySQL a read-only
snapshot (:data:`MYSQL_BEGIN_READ`)."""
_MIGRATION_LOCK_KEY = 0x62736F  # "bso"
"""pg_advisory_xact_lock key serializing concurrent upgrades of one database."""
MYSQL_DIALECTS = frozenset({"mysql", "mariadb"})
"""SQLAlchemy's names for MySQL and MariaDB (``mysql://`` or ``mariadb://`` URLs)."""
MYSQL_DRIVER = "pymysql"
"""The MySQL driver bso installs (pure Python, in the ``server`` extra)."""
MYSQL_BEGIN_READ = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"
"""Makes the next transaction on a MySQL connection one consistent snapshot that
takes no lock (the session's own level, READ COMMITTED, reads each statement anew)."""
MYSQL_MIGRATION_LOCK_TIMEOUT_S = 600
"""How long ``bso migrate`` on MySQL waits for another upgrade of the same database."""


class SchemaNotCurrentError(RuntimeError):
    """The database lacks the bso tables or is at another migration revision.

    ``url`` is the database's URL with its password hidden, so that a command can
    tell its user which database to migrate (``bso migrate --database-url``).
    """

    def __init__(self, message: str, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class NoSqliteFileError(SchemaNotCurrentError):
    """The SQLite file a store was asked to open is not there.  Opening it would make
    an empty one at that path (a typo'd ``--database-url`` of ``bso status``), which
    the next command then took for a database to migrate."""


class SchemaTooNewError(SchemaNotCurrentError):
    """The database is at a revision none of this bso's migrations makes: a newer bso
    migrated it.  ``bso migrate`` cannot help (bso never downgrades); a bso at least as
    new as the database's revision must serve it."""


def known_revisions() -> frozenset[str]:
    """The revisions this bso's migrations make (``versions/<revision>_<name>.py``),
    read from the file names so that a store need not import Alembic."""
    return frozenset(
        path.name.split("_", 1)[0] for path in (MIGRATIONS_DIR / "versions").glob("*_*.py")
    )


def _too_new(url: str, found: set[str]) -> SchemaTooNewError:
    return SchemaTooNewError(
        f"database {url} is at a bso schema newer than this bso knows (found "
        f"{', '.join(sorted(found))}, need {SCHEMA_REVISION}): a newer bso migrated it, and bso "
        "never downgrades a database; run that newer bso against it (or upgrade this one)",
        url,
    )


def alembic_config() -> Config:
    """Alembic configuration of the packaged migrations, wherever bso is installed."""
    from alembic.config import Config

    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def make_engine(url: str) -> Engine:
    """Engine with the pool, pragmas and transaction start the store relies on.

    ``postgresql://`` URLs get the psycopg 3 driver (SQLAlchemy would otherwise
    pick psycopg2, which bso does not install), ``mysql://`` and ``mariadb://``
    URLs PyMySQL (:func:`_mysql_engine`).  A server's pool pings a connection
    before handing it out: a PostgreSQL restarted, failed over, or clearing its
    connections (``pg_terminate_backend``) leaves every pooled connection of every
    worker process dead, and without the ping each would fail one event first.
    """
    parsed = parse_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite":
        engine = _sqlite_engine(parsed)
    elif parsed.get_backend_name() in MYSQL_DIALECTS:
        engine = _mysql_engine(parsed)
    else:
        engine = create_engine(parsed, pool_pre_ping=True)
    _discard_connections_across_fork(engine)
    return engine


def parse_url(url: str) -> URL:
    """``url`` as SQLAlchemy reads it; a port that is not a number is an ``ArgumentError``.

    SQLAlchemy raises a bare ``ValueError`` for it, which ``bso`` reported as a bug
    in itself, and whose message quotes the "port": for ``mysql://bso:PASSWORD``
    (no ``@host``) that is the password.  The message here names neither.
    """
    try:
        return make_url(url)
    except ValueError:
        raise exc.ArgumentError(
            "the port after the host is not a number (a URL without @host reads its "
            "password as the port)"
        ) from None


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


def _mysql_engine(url: URL) -> Engine:
    """MySQL/MariaDB (InnoDB): PyMySQL, utf8mb4, READ COMMITTED, read-only snapshots.

    * Plain ``mysql://`` and ``mariadb://`` URLs get PyMySQL (SQLAlchemy would
      otherwise pick mysqlclient, which bso does not install), and every
      connection speaks utf8mb4 unless the URL names another ``charset``.
    * Writes run at READ COMMITTED: the job's row lock
      (:mod:`bso.storage.sql.mysql_lock`) serializes them, and REPEATABLE READ
      would add gap locks on every locking read of a job not registered yet,
      which deadlock concurrent registrations.
    * A transaction marked as a read (:data:`SQLITE_READ_OPTION`: the store's
      maintenance scans, the schema check) is REPEATABLE READ, READ ONLY
      instead: one consistent snapshot, without any lock.
    * The pool pings a connection before handing it out: MySQL closes
      connections idle for ``wait_timeout`` (8 hours by default, often less on
      hosted servers), and a worker's first event after a quiet night would
      otherwise fail on a dead socket.
    """
    if url.drivername in MYSQL_DIALECTS:
        url = url.set(drivername=f"{url.drivername}+{MYSQL_DRIVER}")
    if "charset" not in url.query:
        url = url.update_query_dict({"charset": "utf8mb4"})
    engine = create_engine(url, isolation_level="READ COMMITTED", pool_pre_ping=True)

    @event.listens_for(engine, "begin")
    def _begin(connection: Connection) -> None:
        # The driver begins implicitly, at the first statement: this sets the
        # characteristics of that transaction only.
        if connection.get_execution_options().get(SQLITE_READ_OPTION, False):
            connection.exec_driver_sql(MYSQL_BEGIN_READ)

    return engine


def _mysql_migration_lock(database: str | None) -> str:
    """The GET_LOCK name serializing upgrades of ``database``: named locks are
    server-wide and at most 64 characters, so the name carries a digest."""
    digest = hashlib.sha256((database or "").encode()).hexdigest()[:40]
    return f"bso:migrate:{digest}"


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
    """SQLAlchemy's pool recipe for ``os.fork``: a child never uses the parent's sockets.

    Celery's prefork pool forks workers from a parent that may already hold a
    store; sharing a connection between processes corrupts both sessions.  Right
    after a fork the child empties its copy of the pool without closing anything
    (closing would end the parent's sessions), so it opens connections of its own.
    A check at checkout would come too late: the pool pings a connection before
    handing it out, and that ping would go over the parent's socket.
    """
    engine_ref = weakref.ref(engine)

    def _forget_the_parents_connections() -> None:
        forked = engine_ref()
        if forked is not None:
            forked.dispose(close=False)

    os.register_at_fork(after_in_child=_forget_the_parents_connections)


def upgrade(url: str) -> None:
    """Apply the Alembic migrations to head; a no-op on a database already there.

    Safe to call from several processes at once: PostgreSQL serializes the
    upgrades with an advisory lock, SQLite with its write lock, MySQL with a
    named lock (``GET_LOCK``; its DDL commits at once, so the lock cannot belong
    to the transaction: it is held on a connection of its own and released only
    once the last revision's ``alembic_version`` row is committed, else the next
    upgrade read the revision before it and ran the last migration again).
    """
    from alembic import command

    engine = make_engine(url)
    try:
        with _mysql_migration_lock_held(engine), engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(
                    text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY}
                )
            found = _revisions(connection)
            if found - known_revisions():
                raise _too_new(engine.url.render_as_string(hide_password=True), found)
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
    finally:
        engine.dispose()


def create_if_new(url: str) -> None:
    """Give a database without bso tables its tables (:func:`upgrade`); leave any other
    as it is, for the store to refuse if it is not current (:func:`check_schema`).

    For the commands that write beside a service (``bso keys``): a brand-new
    database is theirs to start (keys made before the first ``bso up``), but an
    existing one is upgraded when the operator runs ``bso migrate``, not as a side
    effect of handing out a key while older workers still serve it (revision 0009
    moved every team's jobs, which those workers then no longer find).
    """
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            connection.execution_options(**{SQLITE_READ_OPTION: True})
            new = not _revisions(connection)
    finally:
        engine.dispose()
    if new:
        upgrade(url)


@contextmanager
def _mysql_migration_lock_held(engine: Engine) -> Iterator[None]:
    """On MySQL, hold the database's migration lock for the block; elsewhere nothing."""
    if engine.dialect.name not in MYSQL_DIALECTS:
        yield
        return
    name = _mysql_migration_lock(engine.url.database)
    with engine.connect() as lock_connection:
        taken = lock_connection.execute(
            text("SELECT GET_LOCK(:name, :timeout)"),
            {"name": name, "timeout": MYSQL_MIGRATION_LOCK_TIMEOUT_S},
        ).scalar()
        if taken != 1:
            raise RuntimeError(
                f"another upgrade of database {engine.url.render_as_string(hide_password=True)} "
                f"held its migration lock for {MYSQL_MIGRATION_LOCK_TIMEOUT_S} s; let it "
                "finish (or end it) and run bso migrate again"
            )
        try:
            yield
        finally:
            lock_connection.execute(text("DO RELEASE_LOCK(:name)"), {"name": name})


def check_schema(engine: Engine) -> None:
    """Refuse a database whose ``alembic_version`` is not :data:`SCHEMA_REVISION`, and
    a SQLite file that is not there before connecting makes it."""
    if _missing_sqlite_file(engine.url):
        raise NoSqliteFileError(
            f"no SQLite database at {engine.url.database}: check the URL (bso up and bso "
            "migrate make a new one)",
            engine.url.render_as_string(hide_password=True),
        )
    with engine.connect() as connection:
        connection.execution_options(**{SQLITE_READ_OPTION: True})
        found = _revisions(connection)
    if found != {SCHEMA_REVISION}:
        url = engine.url.render_as_string(hide_password=True)
        if found - known_revisions():
            raise _too_new(url, found)
        raise SchemaNotCurrentError(
            f"database {url} is not at the current bso schema (found "
            f"{', '.join(sorted(found)) or 'no bso tables'}, need {SCHEMA_REVISION}); apply the "
            "migrations with `bso migrate --database-url URL` or "
            "bso.storage.sql.engine.upgrade(url)",
            url,
        )


def _missing_sqlite_file(url: URL) -> bool:
    """A SQLite URL of a file path (not memory, not a ``file:`` URI) with no file there."""
    path = url.get_backend_name() == "sqlite" and url.database
    if not path or path == ":memory:" or path.startswith("file:"):
        return False
    return not Path(path).exists()


def _revisions(connection: Connection) -> set[str]:
    """The revisions in the database's ``alembic_version`` (none without bso tables)."""
    if not inspect(connection).has_table(VERSION_TABLE):
        return set()
    return set(connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars())
