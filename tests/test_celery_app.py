"""The Celery configuration (bso_workers/celery_app.py), read without a broker.

JSON only, late acknowledgement, prefetch 1, the time limits and the
visibility timeout; every task's name and queue (events vs. maintenance); the
beat schedule of the sweep; the pools a worker may start on; the client's app
speaking the same dialect; and, for ``redis://`` and ``rediss://`` brokers,
kombu's screening transport (certificate checks for TLS) holding the app's
dead letters.
"""

from __future__ import annotations

import ssl
from datetime import UTC, datetime, timedelta

import pytest
from celery.worker.request import Request
from kombu import Message

from bso.wire import keys
from bso_workers import broker
from bso_workers.celery_app import SWEEP_ENTRY, celery_config, check_pool, create_app
from bso_workers.deadletters import DeadLetters
from bso_workers.limits import CELERY_HARD_LIMIT_GRACE_S
from bso_workers.settings import WorkerSettings
from bso_workers.tasks import WorkerRuntime
from tests.fixtures.celery_publisher import client_celery_app
from tests.test_tasks import settings


def test_app_is_json_only_late_acking_and_explicit() -> None:
    conf = create_app(settings(soft_time_limit_s=5, time_limit_s=9, visibility_timeout_s=20)).conf
    assert conf.task_serializer == conf.result_serializer == conf.event_serializer == "json"
    assert conf.accept_content == conf.result_accept_content == ["json"]
    assert conf.task_acks_late
    assert conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert conf.task_ignore_result
    # bso enforces both limits itself (every pool); Celery's hard one is prefork's backstop.
    assert conf.task_soft_time_limit is None
    assert conf.task_time_limit == 9 + CELERY_HARD_LIMIT_GRACE_S
    assert conf.broker_transport_options["visibility_timeout"] == 20
    assert conf.broker_transport_options["unacked_restore_interval"] == 4
    assert {q.name for q in conf.task_queues} == {keys.EVENTS_QUEUE, keys.MAINTENANCE_QUEUE}
    assert not conf.task_create_missing_queues


@pytest.mark.parametrize("pool", ["solo", "prefork", "processes"])
def test_workers_start_on_the_pools_that_keep_a_task_on_its_main_thread(pool: str) -> None:
    check_pool(pool)


@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_workers_refuse_pools_that_share_a_thread_or_a_signal(pool: str) -> None:
    with pytest.raises(RuntimeError, match="solo or prefork"):
        check_pool(pool)


def test_every_task_has_its_name_and_queue() -> None:
    app = create_app(settings())
    route = app.amqp.router.route
    for name in {*keys.TASK_FOR_KIND.values(), keys.TASK_STATUS, keys.TASK_LIST_JOBS}:
        assert name in app.tasks
        assert route({}, name)["queue"].name == keys.EVENTS_QUEUE
    assert route({}, keys.TASK_SWEEP)["queue"].name == keys.MAINTENANCE_QUEUE


def test_beat_runs_the_sweep_on_the_maintenance_queue() -> None:
    schedule = create_app(settings(sweep_interval_s=7)).conf.beat_schedule
    (entry,) = schedule.values()
    assert entry["task"] == keys.TASK_SWEEP
    assert entry["schedule"] == 7
    assert entry["options"] == {"queue": keys.MAINTENANCE_QUEUE, "expires": 607}


@pytest.mark.parametrize(("beat_behind_s", "dropped"), [(0, False), (20, False), (700, True)])
def test_a_worker_runs_the_sweeps_of_a_beat_whose_clock_is_behind_its_own(
    beat_behind_s: float, dropped: bool
) -> None:
    """Celery sends a sweep's expiry as a time on beat's clock, and the worker checks it
    against its own: with an expiry of one interval (15 s), a beat host 20 s behind
    the workers' had every sweep dropped, and no lease ever ran out.  Ten minutes of
    difference are allowed; past that the sweep is dropped, as a stale one is."""
    app = create_app(settings())
    options = app.conf.beat_schedule[SWEEP_ENTRY]["options"]
    sent_at = datetime.now(UTC) - timedelta(seconds=beat_behind_s)
    sent = app.amqp.as_task_v2("sweep-1", keys.TASK_SWEEP, expires=options["expires"], now=sent_at)
    message = Message(
        body="[[], {}, {}]",
        headers=sent.headers,
        content_type="application/json",
        content_encoding="utf-8",
    )
    request = Request(message, app=app, task=app.tasks[keys.TASK_SWEEP])
    assert bool(request.maybe_expire()) is dropped


def test_client_app_speaks_the_workers_dialect() -> None:
    worker = create_app(settings()).conf
    client = client_celery_app("redis://127.0.0.1:1/0").conf
    prefix = "global_keyprefix"
    assert client.broker_transport_options[prefix] == worker.broker_transport_options[prefix]
    assert client.task_serializer == "json"
    assert client.accept_content == ["json"]


# -- the broker transport -------------------------------------------------------------


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://127.0.0.1:6380/0"])
def test_both_redis_schemes_get_the_screening_transport(url: str) -> None:
    config = celery_config(WorkerSettings(_env_file=None, broker_url=url))
    assert config["broker_transport"] == broker.TRANSPORT
    if url.startswith("rediss"):
        assert config["broker_use_ssl"]["ssl_cert_reqs"] == ssl.CERT_REQUIRED


def test_the_app_hands_the_transport_its_dead_letters() -> None:
    settings = WorkerSettings(_env_file=None, max_queue_item_bytes=2048)
    runtime = WorkerRuntime(settings)
    app = create_app(settings, runtime)
    box = app.conf.broker_transport_options[broker.DEAD_LETTERS_OPTION]
    assert isinstance(box, DeadLetters)
    assert box.max_item_bytes == 2048
    assert box.push_reply == runtime.push  # replies go through the runtime's reply backend
