"""SQL store on SQLAlchemy 2 Core: a SQLite file or PostgreSQL (psycopg 3).

Locking, the heart of :class:`Store`'s contract, differs per backend:

* PostgreSQL: each transaction locks the job's row with ``SELECT ... FOR
  UPDATE``.  A job that is not registered yet has no row to lock, so the
  transaction inserts a placeholder row (``INSERT ... ON CONFLICT DO NOTHING``):
  a concurrent transaction on the same id then waits on that uncommitted key
  exactly as it would on a row lock.  ``create_job`` fills the placeholder in;
  one still empty at commit is deleted, so other readers never see it.
* SQLite: every write transaction starts with ``BEGIN IMMEDIATE``, which takes
  the database's write lock up front, so the read-decide-write cycle of an event
  cannot interleave with another process's.  WAL mode lets readers (the stale
  trial scan, ``job_ids``) proceed meanwhile and ``busy_timeout`` makes writers
  queue instead of failing.  The statements are the same as on PostgreSQL:
  SQLAlchemy's SQLite dialect drops ``FOR UPDATE`` and the placeholder insert
  never meets a competitor.

Trial numbers come from ``jobs.next_trial_number`` under that lock, never from
``MAX(trial_number) + 1``, and the trials primary key rejects duplicates should
the lock ever be bypassed.  Tables are created only by the Alembic migrations
(:func:`upgrade`); :class:`SqlStore` refuses a database that is not at head.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import (
    Connection,
    Engine,
    Executable,
    Row,
    bindparam,
    create_engine,
    delete,
    event,
    exc,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection
from sqlalchemy.sql.dml import ReturningInsert

from bso.events import StopReason, TrialPhase, TrialStatus
from bso.spec import Hardware, JobSpec
from bso.storage.base import JobRecord, JobTransaction, LaneRecord, Store, TrialRecord
from bso.storage.schema import jobs, lanes, replies, trials

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

# How long a SQLite writer waits for the write lock before giving up.
SQLITE_BUSY_TIMEOUT_S = 60.0
# Execution option that makes SQLite begin a deferred (read) transaction, so that
# pure reads do not queue behind writers.
_SQLITE_READ = "bso_sqlite_read"
# pg_advisory_xact_lock key serializing concurrent upgrades of one database.
_MIGRATION_LOCK_KEY = 0x62736F  # "bso"


class SchemaNotCurrentError(RuntimeError):
    """The database lacks the bso tables or is at another migration revision."""


def alembic_config() -> Config:
    """Alembic configuration of the packaged migrations, wherever bso is installed."""
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
        # own deferred BEGIN so that the "begin" listener below decides how to begin.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # In WAL mode NORMAL survives application crashes; only an OS crash or
        # power loss may lose the last commits, in exchange for no fsync per event.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection: Connection) -> None:
        read_only = connection.get_execution_options().get(_SQLITE_READ, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


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


def _check_schema(engine: Engine) -> None:
    heads = set(ScriptDirectory.from_config(alembic_config()).get_heads())
    with engine.connect() as connection:
        connection.execution_options(**{_SQLITE_READ: True})
        current = set(MigrationContext.configure(connection).get_current_heads())
    if current != heads:
        found = ", ".join(sorted(current)) or "no bso tables"
        raise SchemaNotCurrentError(
            f"database {engine.url.render_as_string(hide_password=True)} is not at the "
            f"current bso schema (found {found}, need {', '.join(sorted(heads))}); "
            "run bso.storage.sql.upgrade(url) to apply the migrations"
        )


# Statements are built once with named parameters: building SQLAlchemy
# expressions per call costs more than running them on SQLite.  Parameter names
# in WHERE clauses carry a ``w_`` prefix because UPDATE takes its SET columns
# from the execution parameters named after them.
_SELECT_JOB_FOR_UPDATE = (
    select(jobs.c.spec, jobs.c.created_at, jobs.c.next_trial_number)
    .where(jobs.c.job_id == bindparam("w_job_id"))
    .with_for_update()
)
_INSERT_JOB = insert(jobs)
_UPDATE_JOB = update(jobs).where(jobs.c.job_id == bindparam("w_job_id"))
_DELETE_OF_JOB = {
    table.name: delete(table).where(table.c.job_id == bindparam("w_job_id"))
    for table in (trials, lanes, jobs)
}
_SELECT_TRIALS = (
    select(trials).where(trials.c.job_id == bindparam("w_job_id")).order_by(trials.c.trial_number)
)
_SELECT_TRIALS_OF_KEY = _SELECT_TRIALS.where(trials.c.hardware_key == bindparam("w_hardware_key"))
_SELECT_TRIAL = select(trials).where(
    trials.c.job_id == bindparam("w_job_id"),
    trials.c.trial_number == bindparam("w_trial_number"),
)
_INSERT_TRIAL = insert(trials)
_UPDATE_TRIAL = update(trials).where(
    trials.c.job_id == bindparam("w_job_id"),
    trials.c.trial_number == bindparam("w_trial_number"),
)
_SELECT_LANE = select(lanes.c.hardware, lanes.c.rng_state).where(
    lanes.c.job_id == bindparam("w_job_id"),
    lanes.c.hardware_key == bindparam("w_hardware_key"),
)
_SELECT_REPLY = select(replies.c.reply).where(replies.c.event_id == bindparam("w_event_id"))
_INSERT_REPLY = insert(replies)


@dataclass(frozen=True, slots=True)
class _Upserts:
    """The statements whose ON CONFLICT syntax comes from the dialect's INSERT."""

    insert_placeholder: ReturningInsert[tuple[str]]
    upsert_lane: Executable

    @staticmethod
    def of(dialect_name: str) -> _Upserts:
        dialect_insert = postgresql.insert if dialect_name == "postgresql" else sqlite.insert
        upsert = dialect_insert(lanes)
        return _Upserts(
            insert_placeholder=dialect_insert(jobs)
            .on_conflict_do_nothing()
            .returning(jobs.c.job_id),
            upsert_lane=upsert.on_conflict_do_update(
                index_elements=[lanes.c.job_id, lanes.c.hardware_key],
                set_={"hardware": upsert.excluded.hardware, "rng_state": upsert.excluded.rng_state},
            ),
        )


_UPSERTS = {name: _Upserts.of(name) for name in ("postgresql", "sqlite")}


def _trial_from_row(row: Row[Any]) -> TrialRecord:
    return TrialRecord(
        job_id=row.job_id,
        trial_number=row.trial_number,
        hardware_key=row.hardware_key,
        batch_size=row.batch_size,
        phase=TrialPhase(row.phase),
        created_at=row.created_at,
        updated_at=row.updated_at,
        status=TrialStatus(row.status),
        epochs=row.epochs,
        time_s=row.time_s,
        energy_j=row.energy_j,
        cost=row.cost,
        last_metric=row.last_metric,
        stop_reason=StopReason(row.stop_reason) if row.stop_reason is not None else None,
    )


def _trial_values(trial: TrialRecord) -> dict[str, Any]:
    """Every non-key column of ``trial``."""
    return {
        "hardware_key": trial.hardware_key,
        "batch_size": trial.batch_size,
        "phase": trial.phase.value,
        "status": trial.status.value,
        "epochs": trial.epochs,
        "time_s": trial.time_s,
        "energy_j": trial.energy_j,
        "cost": trial.cost,
        "last_metric": trial.last_metric,
        "stop_reason": trial.stop_reason.value if trial.stop_reason is not None else None,
        "created_at": trial.created_at,
        "updated_at": trial.updated_at,
    }


class _SqlTransaction(JobTransaction):
    """One job's unit of work on one connection, inside the caller's transaction.

    The job row is read once when locked and kept in memory: nothing else can
    change it while the lock is held.
    """

    def __init__(self, job_id: str, connection: Connection) -> None:
        super().__init__(job_id)
        self.connection = connection
        self._upserts = _UPSERTS[connection.dialect.name]
        self._key = {"w_job_id": job_id}
        self._job: JobRecord | None = None
        self._next_trial_number = 1
        self._row_exists = False
        self._placeholder = False
        """The row locked is a placeholder this transaction inserted."""

    def lock(self) -> None:
        """Take the job's lock; see the module docstring."""
        while True:
            row = self.connection.execute(_SELECT_JOB_FOR_UPDATE, self._key).first()
            if row is not None:
                self._job = JobRecord(
                    self.job_id, JobSpec.model_validate_json(row.spec), row.created_at
                )
                self._next_trial_number = row.next_trial_number
                self._row_exists = True
                return
            placeholder = self.connection.execute(
                self._upserts.insert_placeholder,
                {
                    "job_id": self.job_id,
                    "spec": None,
                    "created_at": datetime.now(UTC),
                    "next_trial_number": 1,
                },
            ).first()
            if placeholder is not None:
                self._placeholder = self._row_exists = True
                return
            # Someone committed the job between our SELECT and INSERT: lock that row.

    def finish(self) -> None:
        """Drop a placeholder that did not become a job, just before commit."""
        if self._placeholder:
            self.connection.execute(_DELETE_OF_JOB["jobs"], self._key)

    def get_job(self) -> JobRecord | None:
        return self._job

    def create_job(self, spec: JobSpec, now: datetime) -> JobRecord:
        values = {"spec": spec.model_dump_json(), "created_at": now, "next_trial_number": 1}
        if self._row_exists:
            self.connection.execute(_UPDATE_JOB, {**self._key, **values})
        else:
            self.connection.execute(_INSERT_JOB, {"job_id": self.job_id, **values})
        self._job = JobRecord(self.job_id, spec, now)
        self._next_trial_number = 1
        self._row_exists = True
        self._placeholder = False
        return self._job

    def delete_job(self) -> bool:
        if self._job is None:
            return False
        for table in ("trials", "lanes", "jobs"):
            self.connection.execute(_DELETE_OF_JOB[table], self._key)
        self._job = None
        self._row_exists = False
        return True

    def trials(self, hardware_key: str | None = None) -> list[TrialRecord]:
        if hardware_key is None:
            rows = self.connection.execute(_SELECT_TRIALS, self._key)
        else:
            rows = self.connection.execute(
                _SELECT_TRIALS_OF_KEY, {**self._key, "w_hardware_key": hardware_key}
            )
        return [_trial_from_row(row) for row in rows]

    def get_trial(self, trial_number: int) -> TrialRecord | None:
        row = self.connection.execute(
            _SELECT_TRIAL, {**self._key, "w_trial_number": trial_number}
        ).first()
        return _trial_from_row(row) if row is not None else None

    def add_trial(
        self, hardware_key: str, batch_size: int, phase: TrialPhase, now: datetime
    ) -> TrialRecord:
        if self._job is None:
            raise LookupError(f"job {self.job_id!r} is not registered; cannot add a trial")
        number = self._next_trial_number
        self.connection.execute(_UPDATE_JOB, {**self._key, "next_trial_number": number + 1})
        trial = TrialRecord(self.job_id, number, hardware_key, batch_size, phase, now, now)
        self.connection.execute(
            _INSERT_TRIAL, {"job_id": self.job_id, "trial_number": number, **_trial_values(trial)}
        )
        self._next_trial_number = number + 1
        return trial

    def save_trial(self, trial: TrialRecord) -> None:
        result = self.connection.execute(
            _UPDATE_TRIAL,
            {**self._key, "w_trial_number": trial.trial_number, **_trial_values(trial)},
        )
        if result.rowcount == 0:
            raise KeyError(trial.trial_number)

    def get_lane(self, hardware_key: str) -> LaneRecord | None:
        row = self.connection.execute(
            _SELECT_LANE, {**self._key, "w_hardware_key": hardware_key}
        ).first()
        if row is None:
            return None
        rng_state = json.loads(row.rng_state) if row.rng_state is not None else None
        return LaneRecord(Hardware.model_validate_json(row.hardware), rng_state)

    def save_lane(self, lane: LaneRecord) -> None:
        self.connection.execute(
            self._upserts.upsert_lane,
            {
                "job_id": self.job_id,
                "hardware_key": lane.hardware.key,
                "hardware": lane.hardware.model_dump_json(),
                "rng_state": json.dumps(lane.rng_state) if lane.rng_state is not None else None,
            },
        )

    def recorded_reply(self, event_id: str) -> str | None:
        reply: str | None = self.connection.execute(
            _SELECT_REPLY, {"w_event_id": event_id}
        ).scalar()
        return reply

    def record_reply(self, event_id: str, reply_json: str, now: datetime) -> None:
        self.connection.execute(
            _INSERT_REPLY,
            {"event_id": event_id, "job_id": self.job_id, "reply": reply_json, "created_at": now},
        )


class SqlStore(Store):
    """The durable store; ``url`` is a SQLAlchemy URL (``sqlite:///bso.db``,
    ``postgresql+psycopg://user@host/db``) of a database migrated by :func:`upgrade`.
    """

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        try:
            _check_schema(self.engine)
        except BaseException:
            self.engine.dispose()
            raise

    @contextmanager
    def transaction(self, job_id: str) -> Iterator[JobTransaction]:
        with self.engine.begin() as connection:
            tx = _SqlTransaction(job_id, connection)
            tx.lock()
            yield tx
            tx.finish()

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect() as connection:
            connection.execution_options(**{_SQLITE_READ: True})
            with connection.begin():
                yield connection

    def job_ids(self) -> list[str]:
        with self._read() as connection:
            # Sorted here, not by the database, whose collation may differ from
            # Python's code point order.
            return sorted(connection.execute(select(jobs.c.job_id)).scalars())

    def stale_trials(self, last_heartbeat_before: datetime) -> list[tuple[str, int]]:
        with self._read() as connection:
            rows = connection.execute(
                select(trials.c.job_id, trials.c.trial_number).where(
                    trials.c.status == TrialStatus.RUNNING.value,
                    trials.c.updated_at < last_heartbeat_before,
                )
            )
            return sorted((row.job_id, row.trial_number) for row in rows)

    def prune_replies(self, recorded_before: datetime) -> int:
        with self.engine.begin() as connection:
            result = connection.execute(
                delete(replies).where(replies.c.created_at < recorded_before)
            )
            return result.rowcount

    def close(self) -> None:
        self.engine.dispose()
