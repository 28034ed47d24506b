"""The entry point of ``celery -A bso_workers.app worker|beat|flower``.

Celery's command line needs a module that holds the app, so this one builds it
from the environment's settings (:class:`~bso_workers.settings.WorkerSettings`)
and connects the worker's signal handlers.  Building opens no connection (the
runtime connects on first use, in the process that runs the tasks), but it
reads the environment and registers handlers, so no other module imports this
one: they call :func:`bso_workers.celery_app.create_app`.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import setup_logging, worker_init, worker_process_shutdown, worker_shutdown

from bso_workers import broker
from bso_workers.celery_app import CELERY_PER_TASK_LOGGERS, check_pool, create_app
from bso_workers.logs import configure_logging
from bso_workers.settings import WorkerSettings
from bso_workers.tasks import WorkerRuntime

settings = WorkerSettings()
runtime = WorkerRuntime(settings)
app = create_app(settings, runtime)


@worker_init.connect
def _check_pool(sender: Any = None, **_: Any) -> None:
    check_pool(getattr(sender, "pool_cls", "solo"))


@worker_process_shutdown.connect  # each prefork pool process
@worker_shutdown.connect  # a solo node, which runs the tasks itself
def _close_runtime(**_: Any) -> None:
    """Close this process's database and Redis connections on the way out."""
    runtime.close()
    app.conf.broker_transport_options[broker.DEAD_LETTERS_OPTION].close()


@setup_logging.connect
def _configure_logging(**_: Any) -> None:
    """Replace Celery's logging setup by the structured one (worker and beat)."""
    configure_logging(settings.log_level, settings.log_format)
    if settings.log_level != "DEBUG":
        for name in CELERY_PER_TASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
