"""PostgreSQL's locking: the job's row, ``SELECT ... FOR UPDATE``.

Each write transaction locks the job's row.  A job that is not registered yet
has no row to lock, so the transaction inserts a placeholder row (``INSERT ...
ON CONFLICT DO NOTHING``): a concurrent transaction on the same id then waits on
that uncommitted key exactly as it would on a row lock.  ``create_job`` fills
the placeholder in; one still empty at commit is deleted, so other readers never
see it.  Reads take no lock at all: a ``REPEATABLE READ, READ ONLY`` snapshot.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.dialects import postgresql

from bso.storage.schema import jobs
from bso.storage.sql.locking import JobLocking, LockedJob
from bso.storage.sql.session import DbapiSession
from bso.storage.sql.statements import SELECT_JOB, Statements, render


class PostgresLocking(JobLocking):
    """A row lock on the job, or on a placeholder row while the job is being registered."""

    begin_write = None
    begin_read = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"

    def __init__(self, statements: Statements) -> None:
        self._lock_job = render(SELECT_JOB.with_for_update(), "postgresql")
        self._insert_placeholder = render(
            postgresql.insert(jobs).on_conflict_do_nothing(), "postgresql"
        )
        self._encode_time = statements.encode_time

    def lock_job(self, session: DbapiSession, job_id: str) -> LockedJob:
        while True:
            row = session.one(self._lock_job, {"w_job_id": job_id})
            if row is not None:
                return LockedJob(row)
            placeholder = {
                "job_id": job_id,
                "spec": None,
                "created_at": self._encode_time(datetime.now(UTC)),
                "next_trial_number": 1,
                "owner": "",
            }
            if session.execute(self._insert_placeholder, placeholder).rowcount == 1:
                return LockedJob(None, placeholder=True)
            # Someone committed the job between our SELECT and INSERT: lock that row.

    def close(self) -> None:
        """Nothing to release: row locks end with their transactions."""
