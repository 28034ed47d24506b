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

from celery.signals import setup_logging, worker_init, worker_process_shutdown, worker_shutdown

from bso_workers import broker
from bso_workers.celery_app import check_pool, configure_worker_logging, create_app
from bso_workers.settings import WorkerSettings
from bso_workers.tasks import WorkerRuntime

settings = WorkerSettings()
runtime = WorkerRuntime(settings)
app = create_app(settings, runtime)


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
