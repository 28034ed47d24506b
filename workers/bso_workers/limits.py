"""Time limits for bso's tasks, enforced inside the process that runs them, under any pool.

Celery enforces ``task_soft_time_limit`` / ``task_time_limit`` only in its
prefork pool, where the node process watches its children.  The solo pool,
bso's default (the task runs in the node process itself: ~20% more events per
second on 2 cores, see docs/benchmarks.md), enforces none.  So bso enforces
both limits itself, the same way under every pool:

* **soft limit**: a ``SIGALRM`` timer (``setitimer``) raises
  :class:`SoftTimeLimitExceeded` in the running task.  The event's transaction
  rolls back and the caller gets a ``service_unavailable`` reply, which it
  retries with the same event id.
* **hard limit**: a watchdog thread, one per process, ``SIGKILL``\\ s its own
  process when a task is still running past the hard limit, e.g. blocked in a
  C call (a database lock wait) that a Python signal handler cannot
  interrupt.  The message was not acknowledged (``acks_late``), so it is
  delivered again: at once under prefork (the node sees its child die,
  ``task_reject_on_worker_lost``), after the visibility timeout under solo,
  where the node itself dies and ``bso up`` / the container runtime start a
  new one.

A task stuck in C code that holds the GIL stops the watchdog thread as well;
Celery's own hard limit, kept configured a little later than ours
(:data:`CELERY_HARD_LIMIT_GRACE_S`), still catches that under prefork.

The soft limit needs the main thread (only it receives signals); where a task
runs on another thread (Celery's threads pool, a test calling a task body from
a thread) only the hard limit applies.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from billiard.exceptions import SoftTimeLimitExceeded

log = logging.getLogger("bso.limits")

CELERY_HARD_LIMIT_GRACE_S = 5.0
"""Celery's ``task_time_limit`` is bso's hard limit plus this: a backstop under
prefork for the one case the watchdog thread cannot handle (a GIL held forever)."""


class TimeLimits:
    """The soft and hard limit of every task a process runs (one instance per process)."""

    def __init__(self, soft_s: float, hard_s: float) -> None:
        if not 0 < soft_s < hard_s:
            raise ValueError(f"need 0 < soft limit ({soft_s}) < hard limit ({hard_s})")
        self.soft_s = soft_s
        self.hard_s = hard_s
        self._soft_armed = False
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._running = ""
        self._watchdog_pid: int | None = None

    @contextmanager
    def enforce(self, what: str) -> Iterator[None]:
        """Run the block under both limits; ``what`` names it in the hard limit's log line."""
        soft = threading.current_thread() is threading.main_thread()
        self._ensure_watchdog()
        with self._lock:
            self._deadline = time.monotonic() + self.hard_s
            self._running = what
        if soft:
            self._arm_soft()
        try:
            yield
        finally:
            if soft:
                self._disarm_soft()
            with self._lock:
                self._deadline = None

    # -- soft limit -------------------------------------------------------------------------

    def _arm_soft(self) -> None:
        if signal.getsignal(signal.SIGALRM) != self._on_alarm:
            signal.signal(signal.SIGALRM, self._on_alarm)
        self._soft_armed = True
        signal.setitimer(signal.ITIMER_REAL, self.soft_s)

    def _disarm_soft(self) -> None:
        self._soft_armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)

    def _on_alarm(self, _signum: int, _frame: FrameType | None) -> None:
        # A timer that fired while the block was being left must not raise outside it.
        if self._soft_armed:
            self._soft_armed = False
            raise SoftTimeLimitExceeded(f"soft time limit ({self.soft_s:g} s) exceeded")

    # -- hard limit -------------------------------------------------------------------------

    def _ensure_watchdog(self) -> None:
        """Start this process's watchdog thread, again after a fork: threads do not
        survive one, and a lock the parent's thread held would stay held."""
        if self._watchdog_pid == os.getpid():
            return
        self._watchdog_pid = os.getpid()
        self._lock = threading.Lock()
        self._deadline = None
        threading.Thread(target=self._watch, name="bso-hard-time-limit", daemon=True).start()

    def _watch(self) -> None:
        # Polling keeps entering and leaving a task free of any wake-up; at most
        # a 20th of the limit late (3 s for the default 60 s).
        poll_s = min(self.hard_s / 20, 3.0)
        while True:
            time.sleep(poll_s)
            with self._lock:
                if self._deadline is not None and time.monotonic() > self._deadline:
                    self._kill_self()

    def _kill_self(self) -> None:
        log.critical(
            "hard time limit exceeded; killing this worker process, its event will be "
            "delivered again",
            extra={"task": self._running, "limit_s": self.hard_s, "pid": os.getpid()},
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
