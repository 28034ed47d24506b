"""SQLite's locking: one writer at a time, lined up by a kernel lock beside the database.

Every write transaction starts with ``BEGIN IMMEDIATE``, which takes the
database's write lock up front, so the read-decide-write cycle of an event
cannot interleave with another process's.  No placeholder row is needed for a
job not registered yet: nothing else can write until the commit.  WAL mode
(:mod:`bso.storage.sql.engine`) lets readers (:meth:`SqlStore.read
<bso.storage.sql.store.SqlStore.read>`, the stale trial scan, ``job_ids``)
proceed meanwhile, and ``busy_timeout`` makes writers queue instead of failing.

Before that, bso's writers line up on a :class:`WriterTurnstile`.  SQLite lets
one writer in at a time.  A writer that finds the write lock taken
is handled by SQLite's busy handler, which sleeps and retries (after 1, 2, 5,
10, 15, 20, 25 ... ms) until it gets in.  Between bso's own worker processes,
which at full load write hundreds of times a second, that costs twice: a
sleeping worker does not notice the lock come free, and every retry spends CPU.
An exclusive ``flock`` on a file beside the database queues the writers in the
kernel instead, which wakes the next one the moment the lock is released
(its effect on ``scripts/bench_pipeline.py``: docs/benchmarks.md, "SQLite
writers' turnstile").

It only orders bso's writers: correctness still comes from ``BEGIN IMMEDIATE``,
and another program writing the database still meets SQLite's own lock and busy
timeout.  A wait for the turnstile is a plain blocking system call, so a signal
(a worker's soft time limit, see ``bso_workers.limits``) interrupts it, which
SQLite's busy wait, inside a C call, does not allow.  Where ``fcntl`` does not
exist (Windows) the turnstile does nothing and SQLite's busy handler alone
orders the writers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bso.storage.sql.locking import JobLocking, LockedJob
from bso.storage.sql.session import DbapiSession
from bso.storage.sql.statements import Statements

if sys.platform != "win32":
    import fcntl

SUFFIX = "-writers.lock"
"""Appended to the database file's name, beside SQLite's own ``-wal`` and ``-shm``."""


class WriterTurnstile:
    """One process's handle on the writers' lock of one SQLite database."""

    def __init__(self, database: Path) -> None:
        self.path = database.with_name(database.name + SUFFIX)
        self._fd: int | None = None
        self._pid: int | None = None

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the lock for the block, waiting for other writers to leave it."""
        if sys.platform == "win32":
            yield
            return
        fd = self._descriptor()
        try:
            # Inside the try: a signal handler may raise as the wait returns, with
            # the lock already taken.  Unlocking a lock not held is harmless.
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _descriptor(self) -> int:
        # flock locks belong to the open file description, which a forked child
        # shares with its parent: each process opens the file for itself, and a
        # child closes its copy of the parent's (closing a copy releases nothing).
        # Read-only is enough for flock, and works on a file another user created.
        if self._pid != os.getpid():
            if self._fd is not None:
                os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o644)
            self._pid = os.getpid()
        assert self._fd is not None
        return self._fd

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = self._pid = None


class SqliteLocking(JobLocking):
    """``BEGIN IMMEDIATE`` after the writers' turnstile: the job is locked with the database."""

    begin_write = "BEGIN IMMEDIATE"
    begin_read = "BEGIN"

    def __init__(self, statements: Statements, database: str | None) -> None:
        self._read_job = statements.read_job
        self._turnstile = WriterTurnstile(Path(database)) if database else None

    @contextmanager
    def writers_turn(self) -> Iterator[None]:
        """Wait for this database's other bso writers to finish first."""
        if self._turnstile is None:
            yield
            return
        with self._turnstile.turn():
            yield

    def lock_job(self, session: DbapiSession, job_id: str) -> LockedJob:
        """Read the job's row: ``BEGIN IMMEDIATE`` already holds the write lock."""
        return LockedJob(session.one(self._read_job, {"w_job_id": job_id}))

    def close(self) -> None:
        if self._turnstile is not None:
            self._turnstile.close()
