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
  cannot interleave with another process's.  No placeholder is needed: nothing
  else can write until the commit.  WAL mode lets readers (:meth:`SqlStore.read`,
  the stale trial scan, ``job_ids``) proceed meanwhile and ``busy_timeout`` makes
  writers queue instead of failing.  Before that, bso's writers line up on a
  kernel lock beside the database (:mod:`bso.storage.sqlite_turnstile`), which
  wakes the next one as soon as the lock is free instead of letting SQLite's busy
  handler sleep and poll.

Trial numbers come from ``jobs.next_trial_number`` under that lock, never from
``MAX(trial_number) + 1``, and the trials primary key rejects duplicates should
the lock ever be bypassed.  Tables are created only by the Alembic migrations
(:func:`upgrade`); :class:`SqlStore` refuses a database that is not at head.

The per-event units of work (:meth:`SqlStore.transaction`, :meth:`SqlStore.read`)
run on the pooled DBAPI connection with statements rendered once per dialect
from the Core expressions: SQLAlchemy's execution machinery costs several times
what SQLite needs to run one of these statements, and every worker pays it on
every event.  Driver errors still come out as SQLAlchemy's exceptions and lost
connections are still invalidated, as with ``Connection.execute``; engine events
and ``echo`` logging see only the schema check and the maintenance statements.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import (
    Connection,
    Dialect,
    Engine,
    Table,
    bindparam,
    create_engine,
    delete,
    event,
    exc,
    exists,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import psycopg as postgresql_psycopg
from sqlalchemy.engine import URL, make_url
from sqlalchemy.engine.interfaces import DBAPICursor, DBAPIModule
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection
from sqlalchemy.sql import ClauseElement

from bso.apikeys import DEFAULT_TENANT, ApiKeyRecord
from bso.events import StopReason, TrialPhase, TrialStatus
from bso.spec import Hardware, JobSpec
from bso.storage import sql_keys
from bso.storage.base import (
    JobReader,
    JobRecord,
    JobTransaction,
    LaneRecord,
    Store,
    StoredReply,
    TrialRecord,
)
from bso.storage.schema import (
    SCHEMA_REVISION,
    VERSION_TABLE,
    UtcDateTime,
    jobs,
    lanes,
    replies,
    trials,
)
from bso.storage.sqlite_turnstile import WriterTurnstile

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

# How long a SQLite writer waits for the write lock before giving up.
SQLITE_BUSY_TIMEOUT_S = 60.0
# Execution option that makes SQLite begin a deferred (read) transaction, so that
# pure reads do not queue behind writers.
_SQLITE_READ = "bso_sqlite_read"
# pg_advisory_xact_lock key serializing concurrent upgrades of one database.
_MIGRATION_LOCK_KEY = 0x62736F  # "bso"
# Distinct specs and hardware documents whose parsed models are kept: every event
# reads the job's spec, and validating it again costs more than the whole query.
_PARSED_CACHE_SIZE = 4096
# Trial rows whose records are kept (a few hundred bytes each): every event reads
# all trials of a hardware key, nearly all of them unchanged since the last event.
_TRIAL_CACHE_SIZE = 16384


class SchemaNotCurrentError(RuntimeError):
    """The database lacks the bso tables or is at another migration revision."""


def alembic_config() -> Config:
    """Alembic configuration of the packaged migrations, wherever bso is installed."""
    # Imported here, like Alembic everywhere in this module: only migrations need
    # it, and importing it would double a worker's start-up.
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


def _check_schema(engine: Engine) -> None:
    """Refuse a database whose ``alembic_version`` is not :data:`SCHEMA_REVISION`."""
    with engine.connect() as connection:
        connection.execution_options(**{_SQLITE_READ: True})
        found: set[str] = set()
        if inspect(connection).has_table(VERSION_TABLE):
            version = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))
            found = set(version.scalars())
    if found != {SCHEMA_REVISION}:
        raise SchemaNotCurrentError(
            f"database {engine.url.render_as_string(hide_password=True)} is not at the "
            f"current bso schema (found {', '.join(sorted(found)) or 'no bso tables'}, "
            f"need {SCHEMA_REVISION}); run bso.storage.sql.upgrade(url) to apply the "
            "migrations"
        )


# -- the statements of the units of work ------------------------------------------------

# Trial columns in the order the SELECTs return them and _SqlReader unpacks them.
_TRIAL_COLUMNS = [
    trials.c[name]
    for name in (
        "trial_number",
        "hardware_key",
        "batch_size",
        "phase",
        "status",
        "epochs",
        "time_s",
        "energy_j",
        "cost",
        "last_metric",
        "stop_reason",
        "created_at",
        "updated_at",
        "lease_s",
    )
]
# Parameter names in WHERE clauses carry a ``w_`` prefix: SET and VALUES take the
# column names.
_OF_JOB = jobs.c.job_id == bindparam("w_job_id")
_OF_TRIAL = (trials.c.job_id == bindparam("w_job_id")) & (
    trials.c.trial_number == bindparam("w_trial_number")
)
_SELECT_TRIALS = (
    select(*_TRIAL_COLUMNS)
    .where(trials.c.job_id == bindparam("w_job_id"))
    .order_by(trials.c.trial_number)
)
# Timestamps go through UtcDateTime's own conversions (see _sql_of), so the raw
# statements store exactly what the Core statements of the maintenance scans
# compare against.
_Encode = Callable[[datetime], Any]
_Decode = Callable[[Any], datetime]


def _set(*columns: str) -> dict[str, Any]:
    return {name: bindparam(name) for name in columns}


@dataclass(frozen=True, slots=True)
class _Sql:
    """The units of work's SQL for one dialect, all with named parameters."""

    begin: str | None
    """Starts a write transaction; None where the driver begins one implicitly."""
    begin_read: str
    """First statement of a read: a deferred BEGIN, or a read-only snapshot."""
    lock_job: str
    read_job: str
    insert_placeholder: str | None
    """PostgreSQL only: SQLite's write lock already excludes every competitor."""
    insert_job: str
    fill_job: str
    set_next_trial_number: str
    delete_trials: str
    delete_lanes: str
    delete_job: str
    select_trials: str
    select_trials_of_key: str
    select_trial: str
    insert_trial: str
    update_trial: str
    select_lane: str
    upsert_lane: str
    select_reply: str
    insert_reply: str
    encode_time: _Encode
    decode_time: _Decode


@cache
def _sql_of(dialect_name: str) -> _Sql:
    """Render the statements once per process, for the one dialect in use."""
    dialect: Dialect
    dialect_insert: Callable[[Table], sqlite.Insert | postgresql.Insert]
    if dialect_name == "sqlite":
        dialect, dialect_insert = sqlite.dialect(paramstyle="named"), sqlite.insert
    elif dialect_name == "postgresql":
        dialect = postgresql_psycopg.dialect()  # type: ignore[no-untyped-call]
        dialect_insert = postgresql.insert
    else:
        raise ValueError(f"the SQL store runs on SQLite or PostgreSQL, not {dialect_name}")

    def render(statement: ClauseElement) -> str:
        return str(statement.compile(dialect=dialect))

    upsert = dialect_insert(lanes)
    time_type = UtcDateTime().dialect_impl(dialect)
    select_job = select(
        jobs.c.spec, jobs.c.created_at, jobs.c.next_trial_number, jobs.c.owner
    ).where(_OF_JOB)
    return _Sql(
        begin="BEGIN IMMEDIATE" if dialect_name == "sqlite" else None,
        begin_read=(
            "BEGIN"
            if dialect_name == "sqlite"
            else "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"
        ),
        lock_job=render(select_job.with_for_update()),
        read_job=render(select_job),
        insert_placeholder=(
            render(dialect_insert(jobs).on_conflict_do_nothing())
            if dialect_name == "postgresql"
            else None
        ),
        insert_job=render(insert(jobs)),
        fill_job=render(
            update(jobs)
            .where(_OF_JOB)
            .values(_set("spec", "created_at", "next_trial_number", "owner"))
        ),
        set_next_trial_number=render(update(jobs).where(_OF_JOB).values(_set("next_trial_number"))),
        delete_trials=render(delete(trials).where(trials.c.job_id == bindparam("w_job_id"))),
        delete_lanes=render(delete(lanes).where(lanes.c.job_id == bindparam("w_job_id"))),
        delete_job=render(delete(jobs).where(_OF_JOB)),
        select_trials=render(_SELECT_TRIALS),
        select_trials_of_key=render(
            _SELECT_TRIALS.where(trials.c.hardware_key == bindparam("w_hardware_key"))
        ),
        select_trial=render(select(*_TRIAL_COLUMNS).where(_OF_TRIAL)),
        insert_trial=render(insert(trials)),
        update_trial=render(
            update(trials).where(_OF_TRIAL).values(_set(*(c.name for c in _TRIAL_COLUMNS[1:])))
        ),
        select_lane=render(
            select(lanes.c.hardware, lanes.c.rng_state, lanes.c.memory_reprobed_through).where(
                lanes.c.job_id == bindparam("w_job_id"),
                lanes.c.hardware_key == bindparam("w_hardware_key"),
            )
        ),
        upsert_lane=render(
            upsert.on_conflict_do_update(
                index_elements=[lanes.c.job_id, lanes.c.hardware_key],
                set_={
                    "hardware": upsert.excluded.hardware,
                    "rng_state": upsert.excluded.rng_state,
                    "memory_reprobed_through": upsert.excluded.memory_reprobed_through,
                },
            )
        ),
        select_reply=render(
            select(replies.c.reply, replies.c.body_sha256, replies.c.owner).where(
                replies.c.job_id == bindparam("w_job_id"),
                replies.c.event_id == bindparam("w_event_id"),
            )
        ),
        insert_reply=render(insert(replies)),
        # UtcDateTime converts both ways, so neither processor is None.
        encode_time=cast(_Encode, time_type.bind_processor(dialect)),
        decode_time=cast(_Decode, time_type.result_processor(dialect, None)),
    )


@lru_cache(maxsize=_PARSED_CACHE_SIZE)
def _spec_from_json(document: str) -> JobSpec:
    """The stored spec, validated once per distinct text; JobSpec is frozen, so shared."""
    return JobSpec.model_validate_json(document)


@lru_cache(maxsize=_PARSED_CACHE_SIZE)
def _hardware_from_json(document: str) -> Hardware:
    """The stored hardware, validated once per distinct text; Hardware is frozen."""
    return Hardware.model_validate_json(document)


@lru_cache(maxsize=_TRIAL_CACHE_SIZE)
def _trial_from_row(job_id: str, row: tuple[Any, ...], decode_time: _Decode) -> TrialRecord:
    """The record of a trial row (columns as in ``_TRIAL_COLUMNS``).

    Keyed by the row's whole content, so a cached record can never be stale:
    a changed row is a new key.  Records are frozen, so they are shared.
    """
    (
        number,
        key,
        size,
        phase,
        status,
        epochs,
        time_s,
        energy_j,
        cost,
        metric,
        reason,
        created_at,
        updated_at,
        lease_s,
    ) = row
    return TrialRecord(
        job_id=job_id,
        trial_number=number,
        hardware_key=key,
        batch_size=size,
        phase=TrialPhase(phase),
        created_at=decode_time(created_at),
        updated_at=decode_time(updated_at),
        status=TrialStatus(status),
        epochs=epochs,
        time_s=time_s,
        energy_j=energy_j,
        cost=cost,
        last_metric=metric,
        stop_reason=StopReason(reason) if reason is not None else None,
        lease_s=lease_s,
    )


# -- the units of work -----------------------------------------------------------------


class _Session:
    """One pooled DBAPI connection inside one database transaction.

    Driver errors are raised as SQLAlchemy's exceptions (the workers retry on
    ``sqlalchemy.exc.OperationalError``), and a connection the dialect reports
    as lost is invalidated so that the pool never hands it out again.
    """

    def __init__(self, dialect: Dialect, pooled: PoolProxiedConnection) -> None:
        self.dialect = dialect
        self.pooled = pooled
        self.dbapi = pooled.dbapi_connection
        assert self.dbapi is not None  # a connection fresh from the pool is open
        self.cursor: DBAPICursor = self.dbapi.cursor()

    def execute(self, statement: str, params: Mapping[str, Any] | None = None) -> DBAPICursor:
        try:
            if params is None:
                self.cursor.execute(statement)
            else:
                self.cursor.execute(statement, params)
        except self.dialect.loaded_dbapi.Error as error:
            raise self._translated(error, statement, params) from error
        return self.cursor

    def one(self, statement: str, params: Mapping[str, Any]) -> Any:
        """The first row as a tuple, or None."""
        return self.execute(statement, params).fetchone()

    def commit(self) -> None:
        assert self.dbapi is not None
        try:
            self.dbapi.commit()
        except self.dialect.loaded_dbapi.Error as error:
            raise self._translated(error, "COMMIT", None) from error

    def rollback(self) -> None:
        """Roll back; a connection that cannot even do that is discarded."""
        if not self.pooled.is_valid:
            return
        assert self.dbapi is not None
        try:
            self.dbapi.rollback()
        except self.dialect.loaded_dbapi.Error as error:
            self.pooled.invalidate(error)

    def close(self) -> None:
        """Return the connection to the pool (which drops an invalidated one)."""
        if self.pooled.is_valid:
            self.cursor.close()
        self.pooled.close()

    def _translated(
        self, error: DBAPIModule.Error, statement: str, params: Mapping[str, Any] | None
    ) -> BaseException:
        lost = self.dialect.is_disconnect(error, self.dbapi, self.cursor)
        if lost:
            self.pooled.invalidate(error)
        wrapped = exc.DBAPIError.instance(
            statement,
            dict(params) if params is not None else None,
            error,
            self.dialect.loaded_dbapi.Error,
            connection_invalidated=lost,
            dialect=self.dialect,
        )
        assert isinstance(wrapped, BaseException)  # only DontWrapMixin errors are not
        return wrapped


class _SqlReader(JobReader):
    """Reads of one job inside one session.

    The job row is read once, when the unit of work opens: a transaction holds
    its lock and a read sees one snapshot, so it cannot change meanwhile.
    """

    def __init__(self, job_id: str, session: _Session, sql: _Sql) -> None:
        super().__init__(job_id)
        self._session = session
        self._sql = sql
        self._key = {"w_job_id": job_id}
        self._job: JobRecord | None = None

    def load_job(self, statement: str) -> int | None:
        """Read the job row with ``statement``; its next trial number, None if absent."""
        row = self._session.one(statement, self._key)
        if row is None:
            return None
        spec, created_at, next_trial_number, owner = row
        self._job = JobRecord(
            self.job_id, _spec_from_json(spec), self._sql.decode_time(created_at), owner
        )
        number: int = next_trial_number
        return number

    def get_job(self) -> JobRecord | None:
        return self._job

    def trials(self, hardware_key: str | None = None) -> list[TrialRecord]:
        if hardware_key is None:
            cursor = self._session.execute(self._sql.select_trials, self._key)
        else:
            cursor = self._session.execute(
                self._sql.select_trials_of_key, {**self._key, "w_hardware_key": hardware_key}
            )
        return [
            _trial_from_row(self.job_id, tuple(row), self._sql.decode_time)
            for row in cursor.fetchall()
        ]

    def get_trial(self, trial_number: int) -> TrialRecord | None:
        row = self._session.one(
            self._sql.select_trial, {**self._key, "w_trial_number": trial_number}
        )
        if row is None:
            return None
        return _trial_from_row(self.job_id, tuple(row), self._sql.decode_time)

    def get_lane(self, hardware_key: str) -> LaneRecord | None:
        row = self._session.one(
            self._sql.select_lane, {**self._key, "w_hardware_key": hardware_key}
        )
        if row is None:
            return None
        hardware, rng_state, reprobed_through = row
        return LaneRecord(
            _hardware_from_json(hardware),
            json.loads(rng_state) if rng_state is not None else None,
            reprobed_through or 0,
        )


class _SqlTransaction(_SqlReader, JobTransaction):
    """One job's exclusive unit of work; see the module docstring for the lock."""

    def __init__(self, job_id: str, session: _Session, sql: _Sql) -> None:
        super().__init__(job_id, session, sql)
        self._next_trial_number = 1
        self._row_exists = False
        self._placeholder = False
        """The row locked is a placeholder this transaction inserted."""

    def lock(self) -> None:
        """Take the job's lock and read its row; see the module docstring."""
        while True:
            number = self.load_job(self._sql.lock_job)
            if number is not None:
                self._next_trial_number = number
                self._row_exists = True
                return
            if self._sql.insert_placeholder is None:
                return
            placeholder = {
                "job_id": self.job_id,
                "spec": None,
                "created_at": self._sql.encode_time(datetime.now(UTC)),
                "next_trial_number": 1,
                "owner": "",
            }
            if self._session.execute(self._sql.insert_placeholder, placeholder).rowcount == 1:
                self._placeholder = self._row_exists = True
                return
            # Someone committed the job between our SELECT and INSERT: lock that row.

    def finish(self) -> None:
        """Drop a placeholder that did not become a job, just before commit."""
        if self._placeholder:
            self._session.execute(self._sql.delete_job, self._key)

    def create_job(self, spec: JobSpec, now: datetime, owner: str = DEFAULT_TENANT) -> JobRecord:
        values = {
            "spec": spec.model_dump_json(),
            "created_at": self._sql.encode_time(now),
            "next_trial_number": 1,
            "owner": owner,
        }
        if self._row_exists:
            self._session.execute(self._sql.fill_job, {**self._key, **values})
        else:
            self._session.execute(self._sql.insert_job, {"job_id": self.job_id, **values})
        self._job = JobRecord(self.job_id, spec, now, owner)
        self._next_trial_number = 1
        self._row_exists = True
        self._placeholder = False
        return self._job

    def delete_job(self) -> bool:
        if self._job is None:
            return False
        for statement in (self._sql.delete_trials, self._sql.delete_lanes, self._sql.delete_job):
            self._session.execute(statement, self._key)
        self._job = None
        self._row_exists = False
        return True

    def add_trial(
        self, hardware_key: str, batch_size: int, phase: TrialPhase, now: datetime
    ) -> TrialRecord:
        if self._job is None:
            raise LookupError(f"job {self.job_id!r} is not registered; cannot add a trial")
        number = self._next_trial_number
        trial = TrialRecord(self.job_id, number, hardware_key, batch_size, phase, now, now)
        values = self._trial_values(trial)
        self._session.execute(
            self._sql.set_next_trial_number, {**self._key, "next_trial_number": number + 1}
        )
        self._session.execute(
            self._sql.insert_trial, {"job_id": self.job_id, "trial_number": number, **values}
        )
        self._next_trial_number = number + 1
        return trial

    def save_trial(self, trial: TrialRecord) -> None:
        cursor = self._session.execute(
            self._sql.update_trial,
            {**self._key, "w_trial_number": trial.trial_number, **self._trial_values(trial)},
        )
        if cursor.rowcount == 0:
            raise KeyError(trial.trial_number)

    def _trial_values(self, trial: TrialRecord) -> dict[str, Any]:
        """Every non-key column of ``trial``, as the driver takes it."""
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
            "created_at": self._sql.encode_time(trial.created_at),
            "updated_at": self._sql.encode_time(trial.updated_at),
            "lease_s": trial.lease_s,
        }

    def save_lane(self, lane: LaneRecord) -> None:
        self._session.execute(
            self._sql.upsert_lane,
            {
                "job_id": self.job_id,
                "hardware_key": lane.hardware.key,
                "hardware": lane.hardware.model_dump_json(),
                "rng_state": json.dumps(lane.rng_state) if lane.rng_state is not None else None,
                "memory_reprobed_through": lane.memory_reprobed_through,
            },
        )

    def recorded_reply(self, event_id: str) -> StoredReply | None:
        row = self._session.one(self._sql.select_reply, {**self._key, "w_event_id": event_id})
        if row is None:
            return None
        reply_json, body_sha256, owner = row
        return StoredReply(reply_json, body_sha256, owner)

    def record_reply(self, event_id: str, reply: StoredReply, now: datetime) -> None:
        self._session.execute(
            self._sql.insert_reply,
            {
                "event_id": event_id,
                "job_id": self.job_id,
                "reply": reply.reply_json,
                "created_at": self._sql.encode_time(now),
                "body_sha256": reply.body_sha256,
                "owner": reply.owner,
            },
        )


class SqlStore(Store):
    """The durable store; ``url`` is a SQLAlchemy URL (``sqlite:///bso.db``,
    ``postgresql+psycopg://user@host/db``) of a database migrated by :func:`upgrade`.
    """

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        try:
            self._sql = _sql_of(self.engine.dialect.name)
            _check_schema(self.engine)
        except BaseException:
            self.engine.dispose()
            raise
        database = self.engine.url.database
        self._turnstile = (
            WriterTurnstile(Path(database))
            if self.engine.dialect.name == "sqlite" and database
            else None
        )

    @contextmanager
    def _writer_turn(self) -> Iterator[None]:
        """On SQLite, wait for this database's other bso writers to finish first."""
        if self._turnstile is None:
            yield
            return
        with self._turnstile.turn():
            yield

    @contextmanager
    def _session(self, begin: str | None) -> Iterator[_Session]:
        """A pooled connection in a transaction: committed on normal exit, else rolled back."""
        session = _Session(self.engine.dialect, self.engine.raw_connection())
        try:
            if begin is not None:
                session.execute(begin)
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    @contextmanager
    def transaction(self, job_id: str) -> Iterator[JobTransaction]:
        with self._writer_turn(), self._session(self._sql.begin) as session:
            tx = _SqlTransaction(job_id, session, self._sql)
            tx.lock()
            yield tx
            tx.finish()

    @contextmanager
    def read(self, job_id: str) -> Iterator[JobReader]:
        """A snapshot without any lock: SQLite's deferred BEGIN under WAL, or a
        PostgreSQL REPEATABLE READ, READ ONLY transaction (no ``FOR UPDATE``)."""
        with self._session(self._sql.begin_read) as session:
            reader = _SqlReader(job_id, session, self._sql)
            reader.load_job(self._sql.read_job)
            yield reader

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

    def stale_trials(self, now: datetime, default_lease: timedelta) -> list[tuple[str, int]]:
        # Running trials are few (one per live training run): those with their own
        # lease are checked here, the rest by the index on (status, updated_at).
        with self._read() as connection:
            rows = connection.execute(
                select(
                    trials.c.job_id, trials.c.trial_number, trials.c.updated_at, trials.c.lease_s
                )
                .where(trials.c.status == TrialStatus.RUNNING.value)
                .where(trials.c.lease_s.is_not(None) | (trials.c.updated_at < now - default_lease))
            )
            return sorted(
                (row.job_id, row.trial_number)
                for row in rows
                if row.updated_at
                + (timedelta(seconds=row.lease_s) if row.lease_s is not None else default_lease)
                < now
            )

    def prune_replies(self, recorded_before: datetime) -> int:
        job_exists = exists().where(jobs.c.job_id == replies.c.job_id)
        with self._writer_turn(), self.engine.begin() as connection:
            result = connection.execute(
                delete(replies).where(replies.c.created_at < recorded_before, ~job_exists)
            )
            return result.rowcount

    def add_api_key(self, record: ApiKeyRecord) -> None:
        with self._writer_turn(), self.engine.begin() as connection:
            sql_keys.add(connection, record)

    def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        with self._read() as connection:
            return sql_keys.get(connection, key_id)

    def api_keys(self) -> list[ApiKeyRecord]:
        with self._read() as connection:
            return sql_keys.all_keys(connection)

    def revoke_api_key(self, key_id: str, now: datetime) -> bool:
        with self._writer_turn(), self.engine.begin() as connection:
            return sql_keys.revoke(connection, key_id, now)

    def close(self) -> None:
        self.engine.dispose()
        if self._turnstile is not None:
            self._turnstile.close()
