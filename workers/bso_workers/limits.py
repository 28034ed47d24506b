"""Time limits for bso's tasks, enforced inside the process that runs them, under any pool.

Celery's solo pool, bso's default (the task runs in the node process itself;
how it compares with prefork: docs/benchmarks.md), enforces no
``task_soft_time_limit`` / ``task_time_limit``; its prefork pool does, from the
node process.  So bso enforces both limits itself, the same way under the two
pools it runs (solo and prefork; :func:`bso_workers.celery_app.check_pool` refuses
the others, whose tasks share a thread or a signal):

* **soft limit**: a ``SIGALRM`` timer (``setitimer``) raises
  :class:`SoftTimeLimitExceeded` in the running task.  The event's transaction
  rolls back and the caller gets a ``service_unavailable`` reply, which it
  retries with the same event id.
* **hard limit**: a watchdog thread, one per process, ends its own process
  (``os._exit``, which works from any thread and also for a container's PID 1,
  which ignores signals it sends itself) when a task is still running past the
  hard limit, e.g. blocked in a C call (a database lock wait) that a Python
  signal handler cannot interrupt.  The message was not acknowledged
  (``acks_late``), so it is delivered again: at once under prefork (the node
  sees its child die, ``task_reject_on_worker_lost``), after the visibility
  timeout under solo, where the node itself exits and ``bso up`` / the
  container runtime start a new one.  An event that keeps killing its workers
  is dropped after ``BSO_MAX_WORKER_DEATHS`` of them (:mod:`bso_workers.tasks`).

A task stuck in C code that holds the GIL stops the watchdog thread as well;
Celery's own hard limit, kept configured a little later than ours
(:data:`CELERY_HARD_LIMIT_GRACE_S`), still catches that under prefork.

The soft limit needs the main thread (only it receives signals); where a task
runs on another thread (Celery's threads pool, a test calling a task body from
a thread) only the hard limit applies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from billiard.exceptions import SoftTimeLimitExceeded

CELERY_HARD_LIMIT_GRACE_S = 5.0
"""Celery's ``task_time_limit`` is bso's hard limit plus this: a backstop under
prefork for the one case the watchdog thread cannot handle (a GIL held forever)."""

HARD_LIMIT_EXIT_CODE = 70
"""Exit status of a process ended by the hard limit (``EX_SOFTWARE``)."""


def watchdog_lateness_s(hard_s: float) -> float:
    """How late past the hard limit the watchdog may notice it (its polling period)."""
    return min(hard_s / 20, 3.0)


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
            try:
                self._leave(soft)
            except SoftTimeLimitExceeded:
                # The timer fired as the block ended: its work is done, and the
                # handler disarmed itself before raising, so this second call completes.
                self._leave(soft)

    def _leave(self, soft: bool) -> None:
        if soft:
            self._soft_armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        with self._lock:
            self._deadline = None

    # -- soft limit -------------------------------------------------------------------------

    def _arm_soft(self) -> None:
        if signal.getsignal(signal.SIGALRM) != self._on_alarm:
            signal.signal(signal.SIGALRM, self._on_alarm)
        self._soft_armed = True
        signal.setitimer(signal.ITIMER_REAL, self.soft_s)

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
        # Polling keeps entering and leaving a task free of any wake-up.
        poll_s = watchdog_lateness_s(self.hard_s)
        while True:
            time.sleep(poll_s)
            with self._lock:
                if self._deadline is not None and time.monotonic() > self._deadline:
                    self._exit()

    def _exit(self) -> None:
        """End the process now.  The line goes straight to stderr (the worker's log):
        a logging handler's lock may be held by the stuck main thread."""
        line = (
            f"bso: hard time limit ({self.hard_s:g} s) exceeded by {self._running} in process "
            f"{os.getpid()}; exiting, its event will be delivered again\n"
        )
        with contextlib.suppress(OSError):
            os.write(2, line.encode())
        os._exit(HARD_LIMIT_EXIT_CODE)
