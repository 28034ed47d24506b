"""How the SQL store gives one write transaction its job to itself, per dialect.

Locking is the heart of :class:`~bso.storage.base.Store`'s contract, and the
databases offer different tools for it: PostgreSQL and MySQL lock rows
(:mod:`bso.storage.sql.postgres_lock`, :mod:`bso.storage.sql.mysql_lock`),
SQLite locks the whole database for one writer at a time
(:mod:`bso.storage.sql.sqlite_lock`).  A :class:`JobLocking`
says how a unit of work begins and how it takes its job's lock; everything
else in a unit of work is the same on all three.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from bso.storage.sql.session import DbapiSession


@dataclass(frozen=True, slots=True)
class LockedJob:
    """What taking a job's lock found."""

    row: Sequence[Any] | None
    """The job's row (the columns of :data:`~bso.storage.sql.statements.SELECT_JOB`);
    None if the job is not registered."""
    placeholder: bool = False
    """The lock is held on a placeholder row the transaction inserted, which must
    become the job or go before the commit."""


class JobLocking(ABC):
    """One dialect's way of serializing the units of work on a job."""

    begin_write: ClassVar[str | None]
    """Starts a write transaction; None where the driver begins one implicitly."""
    begin_read: ClassVar[str]
    """First statement of a read: a deferred BEGIN, or a read-only snapshot."""

    @contextmanager
    def writers_turn(self) -> Iterator[None]:
        """Wait for this process's turn among bso's writers, before any write
        transaction begins; where the database queues writers well, at once."""
        yield

    @abstractmethod
    def lock_job(self, session: DbapiSession, job_id: str) -> LockedJob:
        """Lock ``job_id`` for the rest of the session's transaction and read its row."""

    @abstractmethod
    def close(self) -> None:
        """Release what the locking holds besides the engine's connections."""
