"""A worker node's health file, and the container health check that reads it.

With ``BSO_HEALTH_FILE`` set (compose.yaml sets it for its workers; ``bso up``
leaves it unset), a worker node touches that file every
:data:`TOUCH_INTERVAL_S` seconds from a timer of its own event loop, the loop
that consumes the queues.  ``python -m bso_workers.healthcheck`` succeeds while
the file is fresh.  The file goes stale, and the check fails, when the loop
stops turning: the node lost its broker and is reconnecting, it is stuck, or it
is gone.  A running task blocks a solo node's loop too, but for at most the
longest a task can live (:attr:`WorkerSettings.longest_task_s`, after which the
hard time limit ends the process), so the check allows that much plus two touch
intervals.  The allowance comes from the same settings the worker runs with, so
raising ``BSO_TIME_LIMIT_S`` cannot make a busy node look dead.  A node starting
removes a file a previous run of the same container left behind.

Why not ``celery inspect ping -d celery@$HOSTNAME``: every check would start a
Python process that builds the whole Celery app (tasks, SQLAlchemy, the
service), connects to Redis, broadcasts on the remote-control channel (which
every node reads) and waits for the answer, N times per interval with
``--scale worker=N``; and a solo node cannot answer while it runs a task.  This
check imports the settings only and reads one ``stat``; it needs no Redis, so a
broker outage is reported by the Redis check, and by these only once the nodes
stop consuming.

Nothing here runs at import; the Celery step is built by :func:`health_file_step`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

from bso_workers.settings import WorkerSettings

TOUCH_INTERVAL_S = 10.0
"""How often a node's event loop touches its health file."""

logger = logging.getLogger(__name__)


def max_age_s(settings: WorkerSettings) -> float:
    """How old the health file may be on a healthy node: one task blocking the
    loop for as long as a task can live, and two touch intervals around it."""
    return settings.longest_task_s + 2 * TOUCH_INTERVAL_S


def touch(path: Path) -> None:
    """Refresh ``path``.  An error is logged, never raised: it would reach the
    event loop, which takes an ``OSError`` for a lost connection; a file that is
    not refreshed makes the check fail, which is what should happen."""
    try:
        path.touch()
    except OSError as exc:
        logger.warning("cannot touch the health file %s: %s", path, exc)


def health_file_step(path: Path, interval_s: float = TOUCH_INTERVAL_S) -> type[Any]:
    """A worker bootstep that touches ``path`` every ``interval_s`` from the worker's
    timer (``app.steps["worker"].add(...)``; :func:`bso_workers.celery_app.create_app`)."""
    from celery import bootsteps

    class HealthFile(bootsteps.StartStopStep):
        """Touches the health file from the event loop's timer while the node consumes."""

        requires = ("celery.worker.components:Timer",)

        def __init__(self, parent: Any, **kwargs: Any) -> None:
            super().__init__(parent, **kwargs)
            self.trefs: list[Any] = []

        def start(self, parent: Any) -> None:
            # Stale from this container's previous run: healthy only once the loop turns.
            path.unlink(missing_ok=True)
            self.trefs = [
                parent.timer.call_after(0.0, touch, (path,)),  # on the loop's first turn
                parent.timer.call_repeatedly(interval_s, touch, (path,)),
            ]

        def stop(self, parent: Any) -> None:
            for tref in self.trefs:
                tref.cancel()
            self.trefs = []
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    return HealthFile


def check(settings: WorkerSettings, now: float | None = None) -> tuple[bool, str]:
    """Whether the node whose settings these are is healthy, and why (one line)."""
    path = settings.health_file
    if path is None:
        return False, "BSO_HEALTH_FILE is not set: this worker keeps no health file"
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return False, f"no health file {path} yet: the worker's event loop has not run"
    limit = max_age_s(settings)
    if age > limit:
        return False, (
            f"health file {path} is {age:.0f} s old (limit {limit:.0f} s): the worker's "
            "event loop has stopped turning"
        )
    return True, f"health file {path} is {age:.0f} s old (limit {limit:.0f} s)"


def main() -> int:
    """The health check: exit 0 when healthy, 1 otherwise, with the reason on one line
    (``docker inspect`` shows it)."""
    healthy, why = check(WorkerSettings())
    print(why, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
