"""The entry point of ``celery -A bso_workers.app worker|beat|flower``.

Celery's command line needs a module that holds the app, so this one builds it
from the environment's settings (:class:`~bso_workers.settings.WorkerSettings`)
and connects the worker's signal handlers.  Building opens no connection (the
runtime connects on first use, in the process that runs the tasks), but it
reads the environment and registers handlers, so no other module imports this
one: they call :func:`bso_workers.celery_app.create_app`.
"""

from __future__ import annotations

from typing import Any

from celery.signals import (
    setup_logging,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from bso_workers import broker
from bso_workers.celery_app import check_pool, configure_worker_logging, create_app
from bso_workers.flower_login import require_login
from bso_workers.presence import PresenceBeacon
from bso_workers.settings import WorkerSettings
from bso_workers.tasks import WorkerRuntime

settings = WorkerSettings()
runtime = WorkerRuntime(settings)
app = create_app(settings, runtime)
require_login()  # Flower's /metrics behind its login (this module is Flower's -A app too)
beacons: list[PresenceBeacon] = []
"""This node's announcement that it runs (one, once the node is ready)."""


@worker_init.connect
def _check_pool(sender: Any = None, **_: Any) -> None:
    """Refuse a pool bso cannot enforce its time limits in, before any task runs.

    SystemExit, not the RuntimeError itself: Celery's signal dispatch logs and
    swallows a receiver's Exception, and the worker would start anyway.
    """
    try:
        check_pool(getattr(sender, "pool_cls", "solo"))
    except RuntimeError as exc:
        raise SystemExit(f"bso worker: {exc}") from exc


@worker_process_shutdown.connect  # each prefork pool process
@worker_shutdown.connect  # a solo node, which runs the tasks itself
def _close_runtime(**_: Any) -> None:
    """Close this process's database and Redis connections on the way out."""
    runtime.close()
    app.conf.broker_transport_options[broker.DEAD_LETTERS_OPTION].close()


@setup_logging.connect
def _configure_logging(**_: Any) -> None:
    """Replace Celery's logging setup by the structured one (worker and beat)."""
    configure_worker_logging(settings)


@worker_ready.connect
def _announce_presence(sender: Any = None, **_: Any) -> None:
    """Say in Redis that this node runs (:mod:`bso_workers.presence`), so that a
    caller whose event nobody consumes learns within seconds that no worker runs."""
    if not settings.broker_url.startswith(("redis://", "rediss://", "unix://")):
        return  # another broker (memory:// in a test): no Redis to announce in
    beacon = PresenceBeacon(settings.broker_url, getattr(sender, "hostname", None) or "worker")
    beacon.start()
    beacons.append(beacon)


@worker_shutdown.connect
def _withdraw_presence(**_: Any) -> None:
    """Stop announcing; the key expires unless another node still refreshes it."""
    while beacons:
        beacons.pop().stop()
