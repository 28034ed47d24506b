"""The caller's transport: reply backends (stub, fakeredis, real Redis) and ServiceClient.

ServiceClient runs here against the workers' real task bodies
(:func:`bso_workers.tasks.process_event`) through an inline publisher, so the
wait / retry / timeout logic is exercised without Celery; the integration
tests run the same client against real workers.
"""

from __future__ import annotations

import json
import logging
import re
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import fakeredis
import pytest
import redis
from sqlalchemy.exc import OperationalError

from bso.apikeys import DEFAULT_TENANT
from bso.core.vocabulary import TrialPhase
from bso.errors import ConfigMismatch, OutOfOrder, RateLimited, ServiceUnavailable, UnknownJob
from bso.spec import JobSpec
from bso.storage.base import JobTransaction
from bso.storage.memory import MemoryStore
from bso.wire import keys
from bso.wire.connection import BrokerUnreachable, broker_error, redact_url
from bso.wire.events import NextTrial
from bso.wire.replies import RedisReplyBackend, ReplyBackend, StubReplyBackend
from bso_client.transport import Publisher, ServiceClient
from bso_workers.settings import WorkerSettings
from bso_workers.supervision import free_port
from bso_workers.tasks import WorkerRuntime, process_event, process_status
from bso_workers.tenant_keys import create_key
from tests.fixtures.celery_publisher import CeleryPublisher

SPEC = JobSpec(
    job_id="job", batch_sizes=[8, 16, 32], default_batch_size=16, target_metric=0.9, mab_seed=1
)


# -- reply backends: one contract, three implementations --------------------------------


@pytest.fixture
def backend(reply_backend: ReplyBackend) -> ReplyBackend:
    return reply_backend


def test_pop_times_out_with_none(backend: ReplyBackend) -> None:
    started = time.monotonic()
    assert backend.pop("bso:reply:j:-:a", 0.2) is None
    assert 0.15 < time.monotonic() - started < 2


def test_push_then_pop_takes_the_reply_once(backend: ReplyBackend) -> None:
    backend.push("bso:reply:j:-:a", '{"n": 1}', 60)
    backend.push("bso:reply:j:-:b", '{"n": 2}', 60)
    assert backend.pop("bso:reply:j:-:a", 1) == '{"n": 1}'
    assert backend.pop("bso:reply:j:-:a", 0.05) is None
    assert backend.pop("bso:reply:j:-:b", 1) == '{"n": 2}'


def test_a_second_push_replaces_the_first(backend: ReplyBackend) -> None:
    # A redelivered event stores its (identical, recorded) reply again: one key, one reply.
    backend.push("k", "first", 60)
    backend.push("k", "second", 60)
    assert backend.pop("k", 1) == "second"
    assert backend.pop("k", 0.05) is None


def test_a_waiting_pop_wakes_on_push(backend: ReplyBackend) -> None:
    timer = threading.Timer(0.2, backend.push, args=("k", "late", 60))
    started = time.monotonic()
    timer.start()
    try:
        assert backend.pop("k", 10) == "late"
    finally:
        timer.join()
    assert time.monotonic() - started < 5


def test_redis_reply_is_a_string_key_with_its_ttl() -> None:
    fake = fakeredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    RedisReplyBackend("redis://fake", client=fake).push("k", "r", 30)
    assert fake.type("k") == "string"
    assert 0 < fake.ttl("k") <= 30


def test_stub_reply_expires_on_its_clock() -> None:
    now = [100.0]
    stub = StubReplyBackend(clock=lambda: now[0])
    stub.push("k", "r", 30)
    assert stub.keys() == ["k"]
    now[0] += 30
    assert stub.keys() == []
    assert stub.pop("k", 0.01) is None


def test_unreachable_redis_is_service_unavailable_with_the_url() -> None:
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    backend = RedisReplyBackend(url, connect_timeout_s=1)
    with pytest.raises(BrokerUnreachable, match=r"redis://:\*\*\*@127\.0\.0\.1") as caught:
        backend.pop("k", 1)
    assert "secret" not in str(caught.value)
    with pytest.raises(BrokerUnreachable):
        backend.push("k", "r", 1)


def _wrapped(cause: OSError) -> redis.ConnectionError:
    """``cause`` wrapped the way redis-py wraps socket and TLS errors when it connects
    (``raise ConnectionError(...)`` inside ``except OSError``: the cause is the context)."""
    wrapped = redis.ConnectionError(f"Error connecting to h:6379. {cause}.")
    wrapped.__context__ = cause
    return wrapped


@pytest.mark.parametrize(
    ("error", "waiting_helps"),
    [
        (redis.ConnectionError("Connection reset by peer"), True),
        (redis.TimeoutError("Timeout reading from socket"), True),
        (redis.BusyLoadingError("Redis is loading the dataset in memory"), True),
        (redis.ReadOnlyError("You can't write against a read only replica."), True),
        (ConnectionRefusedError(111, "Connection refused"), True),
        (redis.AuthenticationError("invalid username-password pair"), False),
        (redis.exceptions.NoPermissionError("this user has no permissions"), False),
        (_wrapped(ssl.SSLCertVerificationError(1, "certificate verify failed")), False),
        (_wrapped(ConnectionResetError(104, "Connection reset by peer")), True),
    ],
)
def test_broker_errors_tell_an_outage_from_a_refusal(error: Exception, waiting_helps: bool) -> None:
    made = broker_error("redis://bso-client:hunter2@h:6379/0", error)
    assert isinstance(made, ServiceUnavailable)
    assert isinstance(made, BrokerUnreachable) is waiting_helps
    assert "redis://bso-client:***@h:6379/0" in str(made)
    assert "hunter2" not in str(made)


def test_redact_url() -> None:
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://u:pw@h/0") == "redis://u:***@h/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


# -- ServiceClient over the workers' task bodies -------------------------------------------


class InlinePublisher(Publisher):
    """Runs the task body at once in the caller's thread: the pipeline without Celery.

    ``deliver`` decides per message (1-based) whether and how often it arrives,
    to play lost messages and broker redeliveries.
    """

    def __init__(
        self,
        runtime: WorkerRuntime,
        deliver: Callable[[int], int] = lambda _: 1,
        api_key: str | None = None,
    ) -> None:
        self.runtime = runtime
        self.deliver = deliver
        self.api_key = api_key
        self.sent: list[tuple[str, str, str]] = []

    def publish(
        self, task_name: str, payload_json: str, message_id: str, reply_channel: str | None = None
    ) -> None:
        self.sent.append((task_name, payload_json, message_id))
        for _ in range(self.deliver(len(self.sent))):
            if task_name == keys.TASK_STATUS:
                process_status(self.runtime, payload_json, api_key=self.api_key)
            else:
                process_event(self.runtime, task_name, payload_json, api_key=self.api_key)

    def close(self) -> None:
        """Nothing to release."""


def make_client(
    store: MemoryStore | None = None,
    deliver: Callable[[int], int] = lambda _: 1,
    **options: Any,
) -> tuple[ServiceClient, InlinePublisher]:
    replies = StubReplyBackend()
    the_store = store or MemoryStore()
    runtime = WorkerRuntime(
        WorkerSettings(_env_file=None),
        store_factory=lambda: the_store,
        replies_factory=lambda: replies,
    )
    publisher = InlinePublisher(runtime, deliver, create_key(the_store, DEFAULT_TENANT))
    return ServiceClient(publisher, replies, address="inline", **options), publisher


def test_the_whole_loop_through_the_client() -> None:
    client, _ = make_client()
    assert client.register(SPEC).created
    assert not client.register(SPEC).created
    trial = client.next_trial("job")
    assert (trial.trial_number, trial.batch_size, trial.phase) == (1, 16, TrialPhase.EXPLORATION)
    decision = client.report_epoch("job", 1, epoch=1, time_s=10, energy_j=1000, metric=0.95)
    assert decision.stop
    assert decision.converged
    assert client.end_trial("job", 1).status == "converged"
    status = client.status("job")
    assert status.lanes[0].recommended_batch_size == 16
    assert client.delete_job("job").existed


def test_error_replies_raise_their_typed_error() -> None:
    client, _ = make_client()
    with pytest.raises(UnknownJob, match="'nope' is not registered"):
        client.next_trial("nope")
    with pytest.raises(UnknownJob):
        client.status("nope")
    client.register(SPEC)
    with pytest.raises(ConfigMismatch, match="eta_knob"):
        client.register(SPEC.model_copy(update={"eta_knob": 0.1}))
    client.next_trial("job")
    client.report_epoch("job", 1, epoch=1, time_s=1, energy_j=1, metric=0.1)
    with pytest.raises(OutOfOrder):
        client.report_epoch("job", 1, epoch=1, time_s=2, energy_j=2, metric=0.1)


def test_a_lost_message_is_sent_again_with_the_same_event_id() -> None:
    client, publisher = make_client(deliver=lambda n: 0 if n == 1 else 1, timeout_s=0.1)
    started = time.monotonic()
    assert client.register(SPEC).created
    assert time.monotonic() - started >= 0.1
    (task1, payload1, id1), (task2, payload2, id2) = publisher.sent
    assert (task1, payload1) == (task2, payload2) == (keys.TASK_REGISTER, payload1)
    event_id = json.loads(payload1)["event_id"]
    assert (id1, id2) == (f"{event_id}.1", f"{event_id}.2")


def test_redelivered_events_apply_once_and_answer_alike() -> None:
    store = MemoryStore()
    client, _ = make_client(store, deliver=lambda _: 2)
    client.register(SPEC)
    first = client.next_trial("job", event_id="same")
    assert client.next_trial("job", event_id="same") == first
    with store.transaction("job") as tx:
        assert [t.trial_number for t in tx.trials()] == [1]


def test_no_reply_at_all_raises_service_unavailable_with_the_details() -> None:
    client, publisher = make_client(deliver=lambda _: 0, timeout_s=0.05, retries=2, backoff=2)
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable) as caught:
        client.register(SPEC)
    elapsed = time.monotonic() - started
    assert 0.35 <= elapsed < 3  # 0.05 + 0.1 + 0.2
    message = str(caught.value)
    for part in ("at inline", "bso.register", "3 attempts", "timeout_s=0.05", "0.35 s"):
        assert part in message
    assert len({payload for _, payload, _ in publisher.sent}) == 1


def test_a_call_cut_short_by_its_deadline_says_the_attempts_it_made() -> None:
    """The fail-open deadline (0.1 s) ends the call within its first 0.2 s wait: the
    message counts the one attempt made, not the three the retries would allow."""
    client, _ = make_client(deliver=lambda _: 0, timeout_s=0.2, retries=2, call_deadline_s=0.1)
    with pytest.raises(ServiceUnavailable) as caught:
        client.register(SPEC)
    message = str(caught.value)
    assert "(1 attempt, timeout_s=0.2" in message, message
    assert "call_deadline_s=0.1" in message, message


class UnreachableAtFirst(InlinePublisher):
    """A broker that refuses connections for ``down_s``, then takes every message and
    no worker answers (``bso up`` restarting: Redis is back before the workers)."""

    def __init__(self, *args: Any, down_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.down_s = down_s
        self.up_at: float | None = None
        """``down_s`` after the first publish: the outage is the call's, not the setup's."""

    def publish(
        self, task_name: str, payload_json: str, message_id: str, reply_channel: str | None = None
    ) -> None:
        if self.up_at is None:
            self.up_at = time.monotonic() + self.down_s
        if time.monotonic() < self.up_at:
            raise BrokerUnreachable("cannot reach the bso broker: Connection refused")
        self.sent.append((task_name, payload_json, message_id))


def test_a_call_that_spent_its_deadline_on_an_unreachable_broker_says_so() -> None:
    """The wait for a reply was cut to nothing because the broker was unreachable for
    most of the call: the message used to say only "no reply after waiting 0 s", for a
    call that had blocked for its whole deadline."""
    client, inline = make_client(timeout_s=1.0, call_deadline_s=0.6, outage_window_s=10)
    client.publisher = UnreachableAtFirst(inline.runtime, down_s=0.5)
    with pytest.raises(ServiceUnavailable) as caught:
        client.register(SPEC)
    message = str(caught.value)
    assert re.search(r"after 0\.[5-9]\d* s unable to reach the broker", message), message
    assert "call_deadline_s=0.6" in message, message


class FlakyStore(MemoryStore):
    """Fails its first ``failures`` transactions the way a locked SQLite does."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    @contextmanager
    def transaction(self, job_id: str) -> Iterator[JobTransaction]:
        if self.failures > 0:
            self.failures -= 1
            raise OperationalError("BEGIN IMMEDIATE", {}, Exception("database is locked"))
        with super().transaction(job_id) as tx:
            yield tx


def test_a_transient_service_error_is_retried() -> None:
    client, publisher = make_client(FlakyStore(failures=1), timeout_s=1)
    assert client.register(SPEC).created
    assert len(publisher.sent) == 2


def test_a_persistent_service_error_ends_in_service_unavailable() -> None:
    client, _ = make_client(FlakyStore(failures=10), timeout_s=1, retries=1)
    with pytest.raises(
        ServiceUnavailable, match=r"database is unavailable or busy \(OperationalError\)"
    ):
        client.register(SPEC)


def test_client_options_are_checked() -> None:
    replies = StubReplyBackend()
    publisher = InlinePublisher(WorkerRuntime(WorkerSettings(_env_file=None)))
    bad_options: list[dict[str, Any]] = [{"timeout_s": 0}, {"retries": -1}, {"backoff": 0.5}]
    for bad in bad_options:
        with pytest.raises(ValueError, match="timeout_s"):
            ServiceClient(publisher, replies, **bad)


# -- the real publisher -------------------------------------------------------------------


def test_connection_refused_without_an_outage_window_fails_at_once_with_the_url() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with (
        ServiceClient.connect(url, timeout_s=30, outage_window_s=0) as client,
        pytest.raises(ServiceUnavailable) as caught,
    ):
        client.register(SPEC)
    assert time.monotonic() - started < 2
    assert url in str(caught.value)


def test_published_message_is_json_on_the_events_queue(redis_url: str) -> None:
    publisher = CeleryPublisher(redis_url)
    event = NextTrial(job_id="job", event_id="ev1")
    publisher.publish(keys.TASK_NEXT_TRIAL, event.model_dump_json(), "ev1.1")
    publisher.close()
    queue = keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    (raw,) = client.lrange(queue, 0, -1)
    message = json.loads(raw)
    assert message["content-type"] == "application/json"
    assert message["headers"]["task"] == keys.TASK_NEXT_TRIAL
    assert message["headers"]["id"] == "ev1.1"
    assert not [k for k in client.keys("*") if not str(k).startswith(keys.KEY_PREFIX)]


def test_the_transport_needs_no_server_code() -> None:
    # The client extra has no SQLAlchemy and no worker package: importing them would fail there.
    probe = (
        "import sys, bso_client.transport; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'sqlalchemy', 'alembic', 'psycopg', 'bso_workers', 'torch'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"


class DoorPublisher(InlinePublisher):
    """A tenant's door that refuses the first ``refusals`` sends, each with ``wait_s``."""

    def __init__(self, *args: Any, refusals: int, wait_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refusals = refusals
        self.wait_s = wait_s
        self.refused_at: list[float] = []

    def publish(
        self, task_name: str, payload_json: str, message_id: str, reply_channel: str | None = None
    ) -> None:
        if len(self.refused_at) < self.refusals:
            self.refused_at.append(time.monotonic())
            raise RateLimited("refused at the door", self.wait_s)
        super().publish(task_name, payload_json, message_id, reply_channel)


def door_client(
    refusals: int, wait_s: float, **options: Any
) -> tuple[ServiceClient, DoorPublisher]:
    client, inline = make_client(**options)
    door = DoorPublisher(inline.runtime, api_key=inline.api_key, refusals=refusals, wait_s=wait_s)
    client.publisher = door
    return client, door


def test_a_refusal_at_the_door_is_waited_out_and_the_same_event_sent_again() -> None:
    client, door = door_client(refusals=1, wait_s=0.2, timeout_s=1.0)
    started = time.monotonic()
    assert client.register(SPEC).created
    assert time.monotonic() - started >= 0.2
    assert len(door.sent) == 1  # refused sends never reached the queue


@pytest.mark.parametrize(("wait_s", "level"), [(0.01, logging.DEBUG), (1.0, logging.WARNING)])
def test_only_a_wait_at_the_door_a_user_could_notice_is_logged_above_debug(
    wait_s: float, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Epochs of milliseconds meet the rate limit at every epoch: an INFO line for each
    wait of 10 ms flooded the run's log."""
    client, _ = door_client(refusals=1, wait_s=wait_s, timeout_s=2.0)
    with caplog.at_level(logging.DEBUG, logger="bso_client"):
        assert client.register(SPEC).created
    (line,) = [r for r in caplog.records if r.getMessage() == "refused at the door"]
    assert line.levelno == level  # raise mode: a retry's level, WARNING


def test_short_waits_at_the_door_that_add_up_to_a_second_are_logged_above_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Five refusals of 0.3 s held one call 1.5 s, every line at DEBUG: a stall of the
    run that its log did not explain."""
    client, _ = door_client(refusals=5, wait_s=0.3, timeout_s=2.0)
    with caplog.at_level(logging.DEBUG, logger="bso_client"):
        assert client.register(SPEC).created
    lines = [r for r in caplog.records if r.getMessage() == "refused at the door"]
    assert [r.levelno for r in lines] == [logging.DEBUG] * 3 + [logging.WARNING] * 2


def test_a_door_that_keeps_refusing_raises_rate_limited_once_a_timeout_was_waited() -> None:
    client, door = door_client(refusals=100, wait_s=0.3, timeout_s=1.0, retries=2)
    started = time.monotonic()
    with pytest.raises(RateLimited, match="refused at the door"):
        client.register(SPEC)
    assert len(door.refused_at) == 4  # waits of 0.3 s while they add up to at most 1 s
    assert 0.9 <= time.monotonic() - started < 1.5
    assert door.sent == []


def test_a_wait_longer_than_the_timeout_is_not_waited() -> None:
    """The door asks for more than a call may take: raised at once, for the run's
    fail-open to treat as an outage rather than stall training."""
    client, _ = door_client(refusals=1, wait_s=30.0, timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(RateLimited):
        client.register(SPEC)
    assert time.monotonic() - started < 1.0
