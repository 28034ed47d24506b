"""The Celery application factory: configuration and tasks, with nothing built at import.

``celery -A bso_workers.app`` builds the app (:mod:`bso_workers.app`); everything else
(the stack, the tests, the benchmarks) calls :func:`create_app` with its own settings.

Configuration choices, each for a reason:

* JSON everywhere, pickle refused: a broker message must never be able to run
  code in a worker.
* ``acks_late`` + ``task_reject_on_worker_lost``: a message is acknowledged
  only after its task finished, so a worker that dies mid-task (OOM, SIGKILL,
  lost node) leaves the message to be delivered again.  Events are idempotent
  (the service dedupes on the event id), so a second delivery is harmless.
* prefetch multiplier 1: a busy worker does not sit on events another worker
  could handle now; event tasks take milliseconds, so prefetching buys nothing.
* explicit queues and task names: callers publish by name (``bso.wire.keys``)
  without importing this package; the periodic sweep has its own queue, so a
  deployment can give it a worker of its own (``--queues bso.maintenance``).
* soft/hard time limits: a stuck task answers an error (soft) or has its
  process killed and its event delivered again (hard) instead of holding a
  queue forever.  bso enforces them itself (:mod:`bso_workers.limits`), since
  Celery's solo pool, bso's default, enforces none; Celery's hard limit stays
  set a little later, as prefork's backstop.
* no result backend: replies travel on the per-event reply keys.
* every tenant's events queue is consumed besides the two above, found at run time
  (:mod:`bso_workers.tenant_queues`), in kombu's rotation.
* with ``BSO_HEALTH_FILE`` set, a worker node touches that file from its event
  loop, for a container health check (:mod:`bso_workers.healthcheck`).
* kombu's Redis transport with a reused Redis client (:mod:`bso_workers.broker`)
  for ``redis://`` and ``rediss://`` brokers: kombu builds a new client object
  for every unacked-bookkeeping command otherwise, twice per task; and it hands
  every popped item to :mod:`bso_workers.deadletters` before kombu parses it,
  so that garbage on a queue is dead-lettered instead of stopping the worker.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from typing import Any, Literal, get_args

import redis
from celery import Celery
from celery.concurrency import get_implementation
from kombu import Queue

from bso.wire import keys
from bso_workers import broker
from bso_workers.deadletters import DeadLetters
from bso_workers.healthcheck import health_file_step
from bso_workers.limits import CELERY_HARD_LIMIT_GRACE_S
from bso_workers.logs import configure_logging
from bso_workers.settings import WorkerSettings
from bso_workers.tasks import WorkerRuntime, register_tasks
from bso_workers.tenant_queues import tenant_queues_step
from bso_workers.tenant_users import serve_stored_tenants

SWEEP_ENTRY = "bso-sweep"

SWEEP_CLOCK_ALLOWANCE_S = 600.0
"""How far beat's clock may be behind a worker's before that worker drops the
sweeps beat sends as expired: Celery sends an expiry as a time on beat's clock,
and a worker compares it with its own.  Were the expiry one interval, a beat
host 15 s behind the workers' would have every sweep dropped, no lease would
ever run out, and a killed run's trial would stay running for good."""


def celery_config(settings: WorkerSettings) -> dict[str, Any]:
    """Celery settings for ``settings``; see the module docstring for the why."""
    config: dict[str, Any] = {
        "broker_url": settings.broker_url,
        "broker_transport_options": {
            "global_keyprefix": keys.BROKER_KEY_PREFIX,
            "visibility_timeout": settings.visibility_timeout_s,
            # Every node looks for messages of dead nodes (unacknowledged past the
            # visibility timeout) this often; kombu's default is every ~100 s.
            "unacked_restore_interval": unacked_restore_interval_s(settings),
            "unacked_restore_throttle": 1,
        },
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "result_backend": None,
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_disable_rate_limits": True,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "task_time_limit": settings.time_limit_s + CELERY_HARD_LIMIT_GRACE_S,
        "task_queues": (Queue(keys.EVENTS_QUEUE), Queue(keys.MAINTENANCE_QUEUE)),
        "task_default_queue": keys.EVENTS_QUEUE,
        "task_routes": task_routes(),
        "task_create_missing_queues": False,
        "worker_send_task_events": settings.task_events,
        "worker_hijack_root_logger": False,
        "enable_utc": True,
        "timezone": "UTC",
        "beat_schedule": beat_schedule(settings),
    }
    if settings.broker_url.startswith(("redis://", "rediss://")):
        config["broker_transport"] = broker.TRANSPORT
        if settings.broker_url.startswith("rediss://"):
            # kombu turns TLS on from the URL's scheme only with its own transport name;
            # with this one it needs broker_use_ssl, and then verifies certificates.
            config.setdefault("broker_use_ssl", {"ssl_cert_reqs": ssl.CERT_REQUIRED})
    return config


def unacked_restore_interval_s(settings: WorkerSettings) -> float:
    """A fifth of the visibility timeout, at most 10 s: a solo node killed by the
    hard time limit has its event delivered again soon after the timeout, for
    one cheap Redis range read per node and interval."""
    return min(10.0, settings.visibility_timeout_s / 5)


def task_routes() -> dict[str, dict[str, str]]:
    """Every task's queue, spelled out: events and reads vs. maintenance."""
    routes = {name: {"queue": keys.EVENTS_QUEUE} for name in keys.TASK_FOR_KIND.values()}
    routes[keys.TASK_STATUS] = {"queue": keys.EVENTS_QUEUE}
    routes[keys.TASK_LIST_JOBS] = {"queue": keys.EVENTS_QUEUE}
    routes[keys.TASK_SWEEP] = {"queue": keys.MAINTENANCE_QUEUE}
    return routes


def beat_schedule(settings: WorkerSettings) -> dict[str, Any]:
    """The sweep every ``sweep_interval_s``; a sweep nobody ran within one interval
    and :data:`SWEEP_CLOCK_ALLOWANCE_S` expires, so that a node back after hours
    without workers runs the last few sweeps, not every one beat sent meanwhile."""
    expires = settings.sweep_interval_s + SWEEP_CLOCK_ALLOWANCE_S
    return {
        SWEEP_ENTRY: {
            "task": keys.TASK_SWEEP,
            "schedule": settings.sweep_interval_s,
            "options": {"queue": keys.MAINTENANCE_QUEUE, "expires": expires},
        }
    }


def create_app(settings: WorkerSettings, runtime: WorkerRuntime | None = None) -> Celery:
    """A configured app with the bso tasks bound to ``runtime`` (one per process)."""
    app = Celery("bso", set_as_current=False)
    runtime = runtime or WorkerRuntime(settings)
    config = celery_config(settings)
    config["broker_transport_options"][broker.DEAD_LETTERS_OPTION] = DeadLetters(
        settings.broker_url, max_item_bytes=settings.max_queue_item_bytes, push_reply=runtime.push
    )
    app.conf.update(config)
    if settings.health_file is not None:
        app.steps["worker"].add(health_file_step(settings.health_file))
    if settings.broker_url.startswith(("redis://", "rediss://")):

        def rebuild(client: redis.Redis) -> list[str]:  # the store, opened when needed
            return serve_stored_tenants(client, runtime.service.store)

        app.steps["consumer"].add(tenant_queues_step(settings.broker_url, rebuild=rebuild))
    register_tasks(app, runtime)
    return app


CELERY_PER_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace")
"""Celery's "received" / "succeeded" lines: two per event, and our own "event
handled" line already says the same with the job and trial; kept for DEBUG."""


def configure_worker_logging(settings: WorkerSettings) -> None:
    """The structured log format instead of Celery's, for a worker or beat process
    (connected to Celery's ``setup_logging`` by :mod:`bso_workers.app`)."""
    configure_logging(settings.log_level, settings.log_format)
    if settings.log_level != "DEBUG":
        for name in CELERY_PER_TASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


WorkerPool = Literal["solo", "prefork"]
"""How a node runs its tasks.  ``solo`` (the default): in the node process itself,
one at a time, so N nodes are N processes; ``prefork``: in ``concurrency`` child
processes the node feeds through pipes (how they compare: docs/benchmarks.md).
Only these two give each task a process
and its main thread to itself, which bso's time limits need
(:mod:`bso_workers.limits`)."""
WORKER_POOLS: tuple[WorkerPool, ...] = get_args(WorkerPool)


def check_pool(pool: object) -> None:
    """Refuse to start a worker on a pool bso cannot enforce its time limits in."""
    if isinstance(pool, str):
        # An alias ("processes" is prefork too); gevent/eventlet may not be installed.
        with contextlib.suppress(ImportError):
            pool = get_implementation(pool)
    name = pool if isinstance(pool, str) else getattr(pool, "__module__", repr(pool))
    if name.rsplit(".", 1)[-1] not in WORKER_POOLS:
        raise RuntimeError(
            f"bso workers run the solo or prefork pool, not {name}: their time limits "
            "need each task alone on its process's main thread"
        )
