"""A broker outage, seen from the caller: wait, send the same event again, or give up in time.

The restart test stops a real Redis (append-only file on) in the middle of a
call and starts it again on the same port and data folder; a worker loop in
the test thread plays the Celery worker (BRPOP the events queue, run the
workers' task body) so that every copy of the event is applied through the
real service code.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bso.apikeys import DEFAULT_TENANT
from bso.errors import ServiceUnavailable
from bso.storage.memory import MemoryStore
from bso.wire import keys
from bso.wire.connection import BrokerUnreachable, broker_error
from bso.wire.events import JobRegistered
from bso.wire.replies import RedisReplyBackend
from bso_client.energy.time_only import TimeOnlyMonitor
from bso_client.optimizer import BatchSizeOptimizer
from bso_client.outage import DEFAULT_OUTAGE_WINDOW_S, outage_window_from_env
from bso_client.transport import Publisher, ServiceClient
from bso_workers.settings import WorkerSettings
from bso_workers.stack import start_redis
from bso_workers.supervision import ManagedProcess, free_port
from bso_workers.tasks import WorkerRuntime, process_event
from bso_workers.tenant_keys import create_key
from tests.test_transport import SPEC, make_client

QUEUE = keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE
AOF_ARGS = ["--appendonly", "yes", "--appendfsync", "always"]


def outage_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "bso_client.transport"
        and r.levelno == logging.WARNING
        and "outage_window_s" in r.getMessage()
    ]


# -- the window and its setting ----------------------------------------------------------


def test_the_window_defaults_to_three_minutes_and_reads_the_environment() -> None:
    assert DEFAULT_OUTAGE_WINDOW_S >= 120
    assert outage_window_from_env({}) == DEFAULT_OUTAGE_WINDOW_S
    assert outage_window_from_env({"BSO_OUTAGE_WINDOW_S": "7.5"}) == 7.5
    for bad in ("soon", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match="BSO_OUTAGE_WINDOW_S"):
            outage_window_from_env({"BSO_OUTAGE_WINDOW_S": bad})


def test_the_client_takes_its_window_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BSO_OUTAGE_WINDOW_S", "42")
    assert ServiceClient.connect("redis://127.0.0.1:1/0").outage_window_s == 42
    assert ServiceClient.connect("redis://127.0.0.1:1/0", outage_window_s=3).outage_window_s == 3
    with pytest.raises(ValueError, match="outage_window_s"):
        ServiceClient.connect("redis://127.0.0.1:1/0", outage_window_s=-1)


# -- scripted outages -------------------------------------------------------------------


class Unreachable(Publisher):
    """Wraps a publisher; ``down(n)`` says whether the n-th send finds the broker away."""

    def __init__(self, inner: Publisher, down: Callable[[int], bool]) -> None:
        self.inner = inner
        self.down = down
        self.sent: list[tuple[str, str]] = []

    def publish(
        self, task_name: str, payload_json: str, message_id: str, reply_channel: str | None = None
    ) -> None:
        self.sent.append((payload_json, message_id))
        if self.down(len(self.sent)):
            raise broker_error(
                "redis://bso-client:hunter2@broker:6379/0",
                redis.BusyLoadingError("Redis is loading the dataset in memory"),
            )
        self.inner.publish(task_name, payload_json, message_id)

    def close(self) -> None:
        self.inner.close()


def test_an_outage_is_waited_out_with_the_same_event(caplog: pytest.LogCaptureFixture) -> None:
    inline, _ = make_client()
    flaky = Unreachable(inline.publisher, down=lambda n: n <= 4)
    client = ServiceClient(flaky, inline.replies, retries=0, outage_window_s=60)
    with caplog.at_level(logging.INFO, "bso_client.transport"):
        assert client.register(SPEC).created
    payloads = {payload for payload, _ in flaky.sent}
    assert len(flaky.sent) == 5
    assert len(payloads) == 1  # the same event (same event id) every time
    event_id = json.loads(payloads.pop())["event_id"]
    assert [m for _, m in flaky.sent] == [f"{event_id}.{n}" for n in range(1, 6)]
    (warning,) = outage_warnings(caplog)  # one per outage, not one per try
    assert "hunter2" not in caplog.text
    assert "redis://bso-client:***@broker:6379/0" in warning.getMessage()
    assert "reachable again" in caplog.text


def test_a_broker_that_stays_away_ends_the_call_after_the_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inline, _ = make_client()
    gone = Unreachable(inline.publisher, down=lambda _: True)
    client = ServiceClient(gone, inline.replies, outage_window_s=0.3)
    with pytest.raises(ServiceUnavailable) as caught:
        client.register(SPEC)
    assert not isinstance(caught.value, BrokerUnreachable)
    assert len(gone.sent) > 1
    assert len(outage_warnings(caplog)) == 1
    message = str(caught.value)
    for part in ("outage_window_s=0.3", "BSO_OUTAGE_WINDOW_S", "broker:6379", "gave up after"):
        assert part in message
    assert "hunter2" not in message


def test_a_refused_connection_raises_after_the_window_naming_url_and_setting() -> None:
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    with (
        ServiceClient.connect(url, timeout_s=30, outage_window_s=1) as client,
        pytest.raises(ServiceUnavailable) as caught,
    ):
        client.register(SPEC)
    message = str(caught.value)
    assert "redis://:***@127.0.0.1" in message
    assert "outage_window_s=1" in message
    assert "waiting" in message
    assert "secret" not in message


def test_the_optimizer_inherits_the_window(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("BSO_OUTAGE_WINDOW_S", "0.5")
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(ServiceUnavailable, match=r"outage_window_s=0\.5"):
        BatchSizeOptimizer(SPEC, url, monitor=TimeOnlyMonitor(), environ={}, on_unavailable="raise")
    with pytest.raises(ServiceUnavailable, match=r"outage_window_s=0\.2"):
        BatchSizeOptimizer(
            SPEC,
            url,
            monitor=TimeOnlyMonitor(),
            outage_window_s=0.2,
            environ={},
            on_unavailable="raise",
        )
    assert len(outage_warnings(caplog)) == 2  # one line per outage, in the caller's log


# -- a real Redis, stopped and started again mid-call --------------------------------------


class RestartableRedis:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: ManagedProcess | None = None

    def start(self) -> None:
        self.process = start_redis(self.data_dir, "127.0.0.1", self.port, extra_args=AOF_ARGS)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5, retry=Retry(NoBackoff(), 0))


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[RestartableRedis]:
    server = RestartableRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def run_event(runtime: WorkerRuntime, item: bytes) -> str:
    """What a worker does with one queue item; returns the event payload it applied."""
    message = json.loads(item)
    (payload,), _, _ = json.loads(message["body"])
    headers = message["headers"]
    process_event(runtime, headers["task"], payload, api_key=headers.get(keys.API_KEY_HEADER))
    return str(payload)


def test_a_call_rides_out_a_redis_restart_and_applies_once(
    restartable: RestartableRedis, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    runtime = WorkerRuntime(
        WorkerSettings(_env_file=None),
        store_factory=lambda: store,
        replies_factory=lambda: RedisReplyBackend(restartable.url),
    )
    api_key = create_key(store, DEFAULT_TENANT)
    client = ServiceClient.connect(
        restartable.url, api_key=api_key, timeout_s=60, outage_window_s=120
    )
    outcome: list[JobRegistered | BaseException] = []

    def call() -> None:
        try:
            outcome.append(client.register(SPEC))
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    with caplog.at_level(logging.INFO, "bso_client.transport"):
        broker = restartable.client()
        # The worker loop below plays a live worker, so it says so as real nodes do
        # (bso_workers.presence); the append-only file keeps the key across the restart.
        broker.set(keys.WORKERS_ALIVE_KEY, "test-worker", ex=600)
        caller.start()
        wait_for(lambda: broker.llen(QUEUE) == 1, "the event on the queue")
        broker.close()
        restartable.stop()  # the event is queued, no worker took it yet
        wait_for(lambda: bool(outage_warnings(caplog)), "the caller to notice the outage")
        restartable.start()  # same port, same folder: the append-only file brings the queue back
        broker = restartable.client()
        applied: list[str] = []
        while caller.is_alive() or broker.llen(QUEUE):
            popped = broker.brpop([QUEUE], timeout=0.2)
            if popped is not None:
                applied.append(run_event(runtime, popped[1]))
        caller.join()
    broker.close()
    client.close()
    runtime.close()

    (reply,) = outcome
    assert isinstance(reply, JobRegistered), reply
    assert reply.created
    assert len(applied) >= 2  # the copy kept by the AOF, and the caller's re-send
    assert len(set(applied)) == 1  # all the same event id
    assert store.job_ids() == ["job"]
    assert len(outage_warnings(caplog)) == 1
    assert "reachable again" in caplog.text


def test_idle_connections_come_back_after_a_restart_without_an_error(
    restartable: RestartableRedis,
) -> None:
    # A client idle through a whole restart (an epoch of training) sees no outage at all.
    worker = RedisReplyBackend(restartable.url)
    caller = ServiceClient.connect(restartable.url, outage_window_s=0)
    try:
        worker.push("bso:reply:j:-:before", "r0", 60)
        assert caller.replies.take("bso:reply:j:-:before") == "r0"
        restartable.stop()
        restartable.start()
        worker.push("bso:reply:j:-:after", "r1", 60)
        assert caller.replies.take("bso:reply:j:-:after") == "r1"
    finally:
        worker.close()
        caller.close()
