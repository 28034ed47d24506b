"""A kernel lock that lines up bso's SQLite writers before ``BEGIN IMMEDIATE``.

SQLite lets one writer in at a time.  A writer that finds the write lock taken
is handled by SQLite's busy handler, which sleeps and retries (after 1, 2, 5,
10, 15, 20, 25 ... ms) until it gets in.  Between bso's own worker processes,
which at full load write hundreds of times a second, that costs twice: a
sleeping worker does not notice the lock come free, and every retry spends CPU.
An exclusive ``flock`` on a file beside the database queues the writers in the
kernel instead, which wakes the next one the moment the lock is released.  On
the 2-core dev machine (``scripts/bench_pipeline.py``, 2 workers, C=32) that
took SQLite from 398-440 to 479-547 epoch reports/s and cut the workers' CPU
per event by ~0.3 ms.

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
