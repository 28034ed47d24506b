"""MySQL/MariaDB's locking (InnoDB): the job's row, ``SELECT ... FOR UPDATE``.

As on PostgreSQL (:mod:`bso.storage.sql.postgres_lock`), each write transaction
locks its job's row, and a job not registered yet gets a placeholder row to
lock, which ``create_job`` fills in or the commit deletes.  InnoDB needs three
things more:

* Writes run at READ COMMITTED (the engine's level,
  :func:`~bso.storage.sql.engine.make_engine`).  At REPEATABLE READ, the
  locking read of a job that has no row takes a gap lock; gap locks do not
  exclude each other but block inserts into the gap, so two registrations of
  one new job would each wait for the other's placeholder: a deadlock every
  time.  At READ COMMITTED that read locks nothing.
* The placeholder goes in with ``INSERT ... ON DUPLICATE KEY UPDATE``.  Where
  the key exists (another transaction's placeholder, or a job committed since
  the read), it takes an exclusive lock on that row, waiting for its owner as
  a row lock does.  ``INSERT IGNORE`` (or a plain INSERT that fails) would take
  a shared lock there instead, and two waiters, each holding one and both
  wanting the exclusive lock, would deadlock.
* Concurrent registrations may still deadlock inside InnoDB when a placeholder
  is deleted while others wait for its key (their duplicate checks hold locks
  on the gap it leaves).  InnoDB then rolls the victim's transaction back
  whole; nothing else has happened in it yet (taking the lock is a unit of
  work's first statement), so the lock is simply tried again, after a short
  random pause: tried again at once, the same registrations meet in the same
  order and can deadlock again and again (seen: six processes racing at
  REPEATABLE READ, where one of them lost 21 tries in a row).

Reads take no lock: a REPEATABLE READ, READ ONLY snapshot.
"""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import exc

from bso.storage.schema import jobs
from bso.storage.sql.engine import MYSQL_BEGIN_READ
from bso.storage.sql.locking import JobLocking, LockedJob
from bso.storage.sql.session import DbapiSession
from bso.storage.sql.statements import SELECT_JOB, Statements, render

ER_LOCK_DEADLOCK = 1213
"""InnoDB chose this transaction as a deadlock's victim and rolled it back."""
DEADLOCK_RETRIES = 20
"""Tries of one lock after deadlocks before the error reaches the caller (the
workers then answer ``service_unavailable``, which the client retries)."""
DEADLOCK_PAUSE_S = 0.002
"""The first retry's longest pause; each later one may wait twice as long
("full jitter": a uniform pause up to the bound, so that the victims of one
deadlock do not come back together), up to :data:`DEADLOCK_PAUSE_CAP_S`."""
DEADLOCK_PAUSE_CAP_S = 0.1
"""At most this much per pause: 20 retries pause 1.5 s in all at worst."""


class MysqlLocking(JobLocking):
    """A row lock on the job, or on a placeholder row while the job is being registered."""

    begin_write = None
    begin_read = MYSQL_BEGIN_READ

    def __init__(self, statements: Statements, dialect_name: str) -> None:
        from sqlalchemy.dialects import mysql

        self._lock_job = render(SELECT_JOB.with_for_update(), dialect_name)
        claim = mysql.insert(jobs)
        # A no-op update: what matters is the exclusive lock it takes on a
        # duplicate key (see the module's docstring).
        self._claim_job = render(
            claim.on_duplicate_key_update(job_id=claim.inserted.job_id), dialect_name
        )
        self._encode_time = statements.encode_time

    def lock_job(self, session: DbapiSession, job_id: str) -> LockedJob:
        key = {"w_job_id": job_id}
        for attempt in range(DEADLOCK_RETRIES + 1):
            try:
                return self._lock(session, job_id, key)
            except exc.OperationalError as error:
                if not _is_deadlock(error) or attempt == DEADLOCK_RETRIES:
                    raise
                bound = min(DEADLOCK_PAUSE_CAP_S, DEADLOCK_PAUSE_S * 2**attempt)
                time.sleep(random.uniform(0, bound))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _lock(self, session: DbapiSession, job_id: str, key: dict[str, Any]) -> LockedJob:
        row = session.one(self._lock_job, key)
        if row is not None:
            return LockedJob(row)
        placeholder = {
            "job_id": job_id,
            "spec": None,
            "created_at": self._encode_time(datetime.now(UTC)),
            "next_trial_number": 1,
            "owner": "",
        }
        session.execute(self._claim_job, placeholder)
        # The row is locked now; it is a placeholder (no spec) only if it is ours:
        # placeholders never outlive their transaction.  (The affected-rows count
        # cannot tell: with CLIENT_FOUND_ROWS, as SQLAlchemy connects, an insert
        # and an unchanged duplicate both count 1.)
        row = session.one(self._lock_job, key)
        assert row is not None, "a row this transaction holds locked cannot vanish"
        if row[0] is None:
            return LockedJob(None, placeholder=True)
        return LockedJob(row)

    def close(self) -> None:
        """Nothing to release: row locks end with their transactions."""


def _is_deadlock(error: exc.OperationalError) -> bool:
    args: tuple[Any, ...] = getattr(error.orig, "args", ())
    return len(args) > 0 and args[0] == ER_LOCK_DEADLOCK
