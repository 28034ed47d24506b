"""The SQL store: :class:`~bso.storage.base.Store` on a SQLite file, PostgreSQL or MySQL/MariaDB.

Every unit of work runs on one pooled DBAPI connection
(:mod:`bso.storage.sql.session`) with the statements of
:mod:`bso.storage.sql.statements`; the dialect's :class:`JobLocking` says how
it begins and locks its job.  Trial numbers come from ``jobs.next_trial_number``
under that lock, never from ``MAX(trial_number) + 1``, and the trials primary
key rejects duplicates should the lock ever be bypassed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, case, delete, exists, func, select

from bso.apikeys import DEFAULT_TENANT, ApiKeyRecord, TenantLimits
from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.spec import BatchPlan, JobSpec
from bso.storage.base import (
    JobActivity,
    JobReader,
    JobRecord,
    JobTransaction,
    LaneRecord,
    Store,
    StoredReply,
    TrialRecord,
    sorted_activity,
)
from bso.storage.schema import jobs, replies, trials
from bso.storage.sql.api_keys import add_key, all_keys, all_limits, revoke_key, set_limits
from bso.storage.sql.engine import MYSQL_DIALECTS, SQLITE_READ_OPTION, check_schema, make_engine
from bso.storage.sql.locking import JobLocking
from bso.storage.sql.mysql_lock import MysqlLocking
from bso.storage.sql.postgres_lock import PostgresLocking
from bso.storage.sql.session import DbapiSession, open_session
from bso.storage.sql.sqlite_lock import SqliteLocking
from bso.storage.sql.statements import (
    Statements,
    hardware_from_json,
    spec_from_json,
    statements_for,
    trial_from_row,
    trial_values,
)


class _SqlReader(JobReader):
    """Reads of one job inside one session.

    The job row is read once, when the unit of work opens: a transaction holds
    its lock and a read sees one snapshot, so it cannot change meanwhile.
    """

    def __init__(self, job_id: str, session: DbapiSession, sql: Statements) -> None:
        super().__init__(job_id)
        self._session = session
        self._sql = sql
        self._key = {"w_job_id": job_id}
        self._job: JobRecord | None = None

    def read_job(self) -> None:
        """Read the job row, without any lock."""
        self.keep_job(self._session.one(self._sql.read_job, self._key))

    def keep_job(self, row: Any) -> int | None:
        """Keep the job of ``row`` (None: no job); its next trial number, None if absent."""
        if row is None:
            return None
        spec, created_at, next_trial_number, owner = row
        self._job = JobRecord(
            self.job_id, spec_from_json(spec), self._sql.decode_time(created_at), owner
        )
        number: int = next_trial_number
        return number

    def get_job(self) -> JobRecord | None:
        return self._job

    def first_trial_number(self) -> int:
        # The deleted job's next number stays in retired_jobs after the job is
        # registered again: it is where the new job began.
        retired = self._session.one(self._sql.select_retired, self._key)
        return int(retired[0]) if retired is not None else 1

    def trials(self, hardware_key: str | None = None) -> list[TrialRecord]:
        if hardware_key is None:
            cursor = self._session.execute(self._sql.select_trials, self._key)
        else:
            cursor = self._session.execute(
                self._sql.select_trials_of_key, {**self._key, "w_hardware_key": hardware_key}
            )
        return [
            trial_from_row(self.job_id, tuple(row), self._sql.decode_time)
            for row in cursor.fetchall()
        ]

    def get_trial(self, trial_number: int) -> TrialRecord | None:
        row = self._session.one(
            self._sql.select_trial, {**self._key, "w_trial_number": trial_number}
        )
        if row is None:
            return None
        return trial_from_row(self.job_id, tuple(row), self._sql.decode_time)

    def get_lane(self, hardware_key: str) -> LaneRecord | None:
        row = self._session.one(
            self._sql.select_lane, {**self._key, "w_hardware_key": hardware_key}
        )
        if row is None:
            return None
        hardware, rng_state, reprobed_through, plan = row
        return LaneRecord(
            hardware_from_json(hardware),
            json.loads(rng_state) if rng_state is not None else None,
            reprobed_through or 0,
            BatchPlan.model_validate_json(plan) if plan is not None else None,
        )


class _SqlTransaction(_SqlReader, JobTransaction):
    """One job's exclusive unit of work, under the dialect's :class:`JobLocking`."""

    def __init__(
        self, job_id: str, session: DbapiSession, sql: Statements, locking: JobLocking
    ) -> None:
        super().__init__(job_id, session, sql)
        self._locking = locking
        self._next_trial_number = 1
        self._row_exists = False
        self._placeholder = False
        """The row locked is a placeholder this transaction inserted."""

    def lock(self) -> None:
        """Take the job's lock and read its row."""
        locked = self._locking.lock_job(self._session, self.job_id)
        number = self.keep_job(locked.row)
        if number is not None:
            self._next_trial_number = number
            self._row_exists = True
        elif locked.placeholder:
            self._placeholder = self._row_exists = True

    def finish(self) -> None:
        """Drop a placeholder that did not become a job, just before commit."""
        if self._placeholder:
            self._session.execute(self._sql.delete_job, self._key)

    def create_job(self, spec: JobSpec, now: datetime, owner: str = DEFAULT_TENANT) -> JobRecord:
        first = self.first_trial_number()
        values = {
            "spec": spec.model_dump_json(),
            "created_at": self._sql.encode_time(now),
            "next_trial_number": first,
            "owner": owner,
        }
        if self._row_exists:
            self._session.execute(self._sql.fill_job, {**self._key, **values})
        else:
            self._session.execute(self._sql.insert_job, {"job_id": self.job_id, **values})
        self._job = JobRecord(self.job_id, spec, now, owner)
        self._next_trial_number = first
        self._row_exists = True
        self._placeholder = False
        return self._job

    def delete_job(self) -> bool:
        if self._job is None:
            return False
        for statement in (
            self._sql.delete_trials,
            self._sql.delete_lanes,
            self._sql.delete_job,
            self._sql.delete_retired,
        ):
            self._session.execute(statement, self._key)
        retired = {"job_id": self.job_id, "next_trial_number": self._next_trial_number}
        self._session.execute(self._sql.insert_retired, retired)
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
        values = trial_values(trial, self._sql.encode_time)
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
            {
                **self._key,
                "w_trial_number": trial.trial_number,
                **trial_values(trial, self._sql.encode_time),
            },
        )
        if cursor.rowcount == 0:
            raise KeyError(trial.trial_number)

    def forget_finished_trials(self) -> int:
        cursor = self._session.execute(
            self._sql.delete_finished_trials,
            {**self._key, "w_running": TrialStatus.RUNNING.value},
        )
        forgotten: int = cursor.rowcount
        return forgotten

    def save_lane(self, lane: LaneRecord) -> None:
        self._session.execute(
            self._sql.upsert_lane,
            {
                "job_id": self.job_id,
                "hardware_key": lane.hardware.key,
                "hardware": lane.hardware.model_dump_json(),
                "rng_state": json.dumps(lane.rng_state) if lane.rng_state is not None else None,
                "memory_reprobed_through": lane.memory_reprobed_through,
                "plan": lane.plan.model_dump_json() if lane.plan is not None else None,
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


def _locking_for(engine: Engine, sql: Statements) -> JobLocking:
    """The engine's dialect's locking; :func:`statements_for` refused any other dialect."""
    if engine.dialect.name == "sqlite":
        return SqliteLocking(sql, engine.url.database)
    if engine.dialect.name in MYSQL_DIALECTS:
        return MysqlLocking(sql, engine.dialect.name)
    return PostgresLocking(sql)


class SqlStore(Store):
    """The durable store; ``url`` is a SQLAlchemy URL (``sqlite:///bso.db``,
    ``postgresql+psycopg://user@host/db``, ``mysql+pymysql://user@host/db``) of a
    database migrated by
    :func:`~bso.storage.sql.engine.upgrade`.
    """

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        try:
            self._sql = statements_for(self.engine.dialect.name)
            check_schema(self.engine)
        except BaseException:
            self.engine.dispose()
            raise
        self._locking = _locking_for(self.engine, self._sql)

    @contextmanager
    def transaction(self, job_id: str) -> Iterator[JobTransaction]:
        with (
            self._locking.writers_turn(),
            open_session(self.engine, self._locking.begin_write) as session,
        ):
            tx = _SqlTransaction(job_id, session, self._sql, self._locking)
            tx.lock()
            yield tx
            tx.finish()

    @contextmanager
    def read(self, job_id: str) -> Iterator[JobReader]:
        """A snapshot without any lock: SQLite's deferred BEGIN under WAL, or a
        PostgreSQL or MySQL REPEATABLE READ, READ ONLY transaction (no ``FOR UPDATE``)."""
        with open_session(self.engine, self._locking.begin_read) as session:
            reader = _SqlReader(job_id, session, self._sql)
            reader.read_job()
            yield reader

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect() as connection:
            connection.execution_options(**{SQLITE_READ_OPTION: True})
            with connection.begin():
                yield connection

    def job_ids(self) -> list[str]:
        with self._read() as connection:
            # Sorted here, not by the database, whose collation may differ from
            # Python's code point order.
            return sorted(connection.execute(select(jobs.c.job_id)).scalars())

    def jobs_of(self, owner: str, limit: int) -> list[JobActivity]:
        """Two queries: the tenant's jobs, and their trials counted per job and lane."""
        running = func.sum(case((trials.c.status == TrialStatus.RUNNING.value, 1), else_=0))
        per_lane = (
            select(
                trials.c.job_id,
                trials.c.hardware_key,
                func.count(),
                running,
                func.max(trials.c.updated_at),
            )
            .join(jobs, jobs.c.job_id == trials.c.job_id)
            .where(jobs.c.owner == owner)
            .group_by(trials.c.job_id, trials.c.hardware_key)
        )
        with self._read() as connection:
            job_rows = connection.execute(
                select(jobs.c.job_id, jobs.c.spec, jobs.c.created_at).where(
                    jobs.c.owner == owner, jobs.c.spec.is_not(None)
                )
            ).all()
            lane_rows = connection.execute(per_lane).all()
        lanes: dict[str, list[tuple[str, int, int, datetime]]] = {}
        for job_id, key, count, busy, latest in lane_rows:
            lanes.setdefault(job_id, []).append((key, count, int(busy or 0), latest))
        found = []
        for job_id, spec, created_at in job_rows:
            mine = lanes.get(job_id, [])
            found.append(
                JobActivity(
                    job_id=job_id,
                    lanes=tuple(sorted({spec_from_json(spec).hardware.key, *(m[0] for m in mine)})),
                    trials=sum(m[1] for m in mine),
                    running_trials=sum(m[2] for m in mine),
                    last_activity=max((m[3] for m in mine), default=created_at),
                )
            )
        return sorted_activity(found)[:limit]

    def trial_tallies(self) -> dict[tuple[TrialStatus, StopReason | None], int]:
        query = select(trials.c.status, trials.c.stop_reason, func.count()).group_by(
            trials.c.status, trials.c.stop_reason
        )
        with self._read() as connection:
            return {
                (TrialStatus(status), StopReason(reason) if reason is not None else None): count
                for status, reason, count in connection.execute(query)
            }

    def recently_active_jobs(self, limit: int) -> list[str]:
        latest = func.max(trials.c.updated_at)
        query = (
            select(trials.c.job_id)
            .group_by(trials.c.job_id)
            .order_by(latest.desc(), trials.c.job_id.desc())
            .limit(limit)
        )
        with self._read() as connection:
            return list(connection.execute(query).scalars())

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
        with self._locking.writers_turn(), self.engine.begin() as connection:
            result = connection.execute(
                delete(replies).where(replies.c.created_at < recorded_before, ~job_exists)
            )
            return result.rowcount

    def add_api_key(self, record: ApiKeyRecord) -> None:
        with self._locking.writers_turn(), self.engine.begin() as connection:
            add_key(connection, record)

    def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        # Every event authenticates first: one plain SELECT on a pooled connection,
        # like the units of work, not SQLAlchemy's execution machinery (which took
        # a fifth of a worker's time per event).
        with open_session(self.engine, None) as session:
            row = session.one(self._sql.select_api_key, {"w_key_id": key_id})
        if row is None:
            return None
        key_id, tenant, secret_sha256, created_at, revoked_at = row
        decode = self._sql.decode_time
        return ApiKeyRecord(
            key_id,
            tenant,
            secret_sha256,
            decode(created_at),
            decode(revoked_at) if revoked_at is not None else None,
        )

    def api_keys(self) -> list[ApiKeyRecord]:
        with self._read() as connection:
            return all_keys(connection)

    def revoke_api_key(self, key_id: str, now: datetime) -> bool:
        with self._locking.writers_turn(), self.engine.begin() as connection:
            return revoke_key(connection, key_id, now)

    def set_tenant_limits(self, tenant: str, limits: TenantLimits | None) -> None:
        with self._locking.writers_turn(), self.engine.begin() as connection:
            set_limits(connection, tenant, limits)

    def tenant_limits(self) -> dict[str, TenantLimits]:
        with self._read() as connection:
            return all_limits(connection)

    def close(self) -> None:
        self.engine.dispose()
        self._locking.close()
