"""The floor under bso's event pipeline: a bare Celery task, one commit, one reply.

``scripts/bench_pipeline.py`` compares bso's C=1 latency with this task's: it
rides the same Redis broker with the same Celery configuration as the bso
workers (:func:`bso_workers.celery_app.celery_config`: JSON, ``acks_late``, prefetch 1,
same task-event setting), on its own queue, and does only what any event task
must do:

1. decode the JSON payload;
2. one SQLite write transaction, set up like bso's ``SqlStore`` (WAL,
   ``synchronous=NORMAL``, the writers' turnstile, ``BEGIN IMMEDIATE``): one
   INSERT, one COMMIT;
3. one reply-key write through the same :class:`RedisReplyBackend` the workers
   use (``SET key value EX ttl``), after the commit.

The caller waits for the reply key exactly as ``ServiceClient`` does (announced, then GETDEL).
So ``bso p50 / bare p50`` is what bso's validation, decision core, SQLAlchemy
store and logging add on top of the unavoidable broker and commit costs.

Run by the benchmark as a worker node (``celery -A bench_baseline_task worker
--queues bso.bench``, with ``scripts/`` on ``PYTHONPATH`` and the stack's
``BSO_*`` settings in the environment); ``BSO_BENCH_BARE_DB`` names the SQLite
file.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from celery import Celery, Task
from celery.signals import setup_logging
from kombu import Queue

from bso.storage.sql.sqlite_lock import WriterTurnstile
from bso.wire import keys
from bso.wire.replies import RedisReplyBackend
from bso_workers.celery_app import celery_config, configure_worker_logging
from bso_workers.message_headers import reply_channel_of
from bso_workers.settings import WorkerSettings

BENCH_QUEUE = "bso.bench"
"""Queue of the bare task, so the bso workers on the same broker never see it."""
TASK_NAME = "bso.bench.bare"
DB_ENV = "BSO_BENCH_BARE_DB"
"""Environment variable naming the SQLite file the bare task commits to."""
SQLITE_BUSY_TIMEOUT_S = 30.0


class BareRuntime:
    """Per pool process: one SQLite connection and one reply backend, made after the fork."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self._db: sqlite3.Connection | None = None
        self._turnstile = WriterTurnstile(Path(db_path()))
        self._replies: RedisReplyBackend | None = None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = open_db(db_path())
        return self._db

    @property
    def replies(self) -> RedisReplyBackend:
        if self._replies is None:
            self._replies = RedisReplyBackend(self.settings.broker_url)
        return self._replies

    def handle(self, payload: object, reply_channel: str | None = None) -> None:
        raw: Any = json.loads(payload) if isinstance(payload, str | bytes) else payload
        event_id = raw["event_id"]
        db = self.db
        with self._turnstile.turn():
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT INTO bare_events (event_id, created) VALUES (?, ?)",
                    (event_id, time.time()),
                )
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        reply = json.dumps({"event_id": event_id, "kind": "bare", "ok": True})
        key = keys.reply_key_for(raw) or keys.reply_key(event_id)
        self.replies.push(key, reply, 60, reply_channel)


def db_path() -> str:
    return os.environ.get(DB_ENV, "bench-bare.sqlite3")


def open_db(path: str) -> sqlite3.Connection:
    """A connection with bso's SQLite pragmas and explicit transactions."""
    db = sqlite3.connect(path, timeout=SQLITE_BUSY_TIMEOUT_S, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute(
        "CREATE TABLE IF NOT EXISTS bare_events "
        "(id INTEGER PRIMARY KEY, event_id TEXT NOT NULL, created REAL NOT NULL)"
    )
    return db


def create_bare_app(settings: WorkerSettings, runtime: BareRuntime | None = None) -> Celery:
    """bso's Celery configuration, with only the bench queue and the bare task."""
    app = Celery("bso-bench", set_as_current=False)
    config = celery_config(settings)
    config.update(
        task_queues=(Queue(BENCH_QUEUE),),
        task_default_queue=BENCH_QUEUE,
        task_routes={TASK_NAME: {"queue": BENCH_QUEUE}},
        beat_schedule={},
    )
    app.conf.update(config)
    bound = runtime or BareRuntime(settings)

    @app.task(name=TASK_NAME, shared=False, bind=True)
    def bare(self: Task[Any, None], payload: object) -> None:
        bound.handle(payload, reply_channel_of(self.request))  # announced as bso's are

    return app


settings = WorkerSettings()
app = create_bare_app(settings)


@setup_logging.connect
def _configure_logging(**_: Any) -> None:
    """Log like bso's workers (bso_workers.app): the structured format, and Celery's
    two lines per task kept at WARNING, so the bare side writes what bso's does."""
    configure_worker_logging(settings)
