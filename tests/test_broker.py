"""The workers' kombu transport (bso_workers.broker): garbage never reaches kombu.

* In-process, over a real Redis: a kombu consumer on the transport receives the
  good messages only, on both of kombu's read paths (BRPOP and ``basic_get``'s
  RPOP); the refused items are in the dead letters.  The reused Redis client
  is still reused.  (That the app configures this transport for ``redis://``
  and ``rediss://`` brokers, with its dead letters: test_celery_app.py.)
* End to end: 1,200 generated garbage items of every kind on both queues of
  real worker processes (solo nodes, and a prefork node); every process stays
  up, each item is logged, counted and dead-lettered (the list capped), a
  refused event's caller gets ``invalid_event``; garbage published on the
  remote-control channel is refused too, and the nodes still answer pings; a
  real job then completes.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import redis
from kombu import Connection, Queue
from kombu.message import Message

from bso.errors import InvalidEvent
from bso.spec import JobSpec
from bso.storage.sql.engine import upgrade
from bso.wire import keys
from bso.wire.events import REPLY_ADAPTER, ErrorReply, NextTrial
from bso_client.transport import ServiceClient
from bso_workers import broker
from bso_workers.deadletters import DeadLetters
from bso_workers.stack import node_name, ping_workers
from tests.fixtures.celery_workers import WorkerCluster
from tests.fixtures.garbage import garbage, message

GOOD_EVENT = NextTrial(job_id="good")


def good_item() -> bytes:
    raw = message(keys.TASK_NEXT_TRIAL, GOOD_EVENT.model_dump_json())
    return json.dumps(raw).encode()


@pytest.fixture
def connection(redis_url: str) -> Iterator[Connection]:
    box = DeadLetters(redis_url)
    options = {"global_keyprefix": keys.BROKER_KEY_PREFIX, broker.DEAD_LETTERS_OPTION: box}
    with Connection(redis_url, transport=broker.Transport, transport_options=options) as conn:
        yield conn
    box.close()


def counts(url: str) -> dict[str, int]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return {k: int(v) for k, v in client.hgetall(keys.DEADLETTER_COUNTS_KEY).items()}
    finally:
        client.close()


def test_a_consumer_gets_the_good_message_and_never_the_garbage(
    connection: Connection, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    queue_key = keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE
    received: list[Message] = []

    def on_message(body: object, message: Message) -> None:
        received.append(message)
        message.ack()

    with connection.Consumer(Queue(keys.EVENTS_QUEUE), callbacks=[on_message], accept=["json"]):
        # BRPOP takes from the right: garbage first, then the good one, then more garbage.
        client.lpush(queue_key, b"[]", b"\x80\x04pickle", good_item(), b"null", b"{}")
        deadline = time.monotonic() + 10
        while client.llen(queue_key) and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                connection.drain_events(timeout=0.5)
    assert [m.headers["task"] for m in received] == [keys.TASK_NEXT_TRIAL]
    assert json.loads(received[0].decode()[0][0])["event_id"] == GOOD_EVENT.event_id
    assert counts(redis_url) == {"bad_envelope": 3, "not_utf8": 1, "total": 4}
    assert client.hlen(keys.BROKER_KEY_PREFIX + "unacked") == 0  # the garbage never got there


def test_basic_get_skips_garbage_too(connection: Connection, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    channel = connection.default_channel
    channel.queue_declare(keys.EVENTS_QUEUE)
    client.lpush(keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE, b"[]")
    assert channel.basic_get(keys.EVENTS_QUEUE, no_ack=True) is None
    client.lpush(keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE, good_item())
    message = channel.basic_get(keys.EVENTS_QUEUE, no_ack=True)
    assert message is not None
    assert message.headers["task"] == keys.TASK_NEXT_TRIAL
    assert counts(redis_url) == {"bad_envelope": 1, "total": 1}


def test_the_channel_still_reuses_one_screening_client(connection: Connection) -> None:
    channel = connection.default_channel
    with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
        assert first is second
        assert isinstance(first, broker.ScreeningRedis)
    assert isinstance(channel.client, broker.ScreeningRedis)


# -- end to end: real worker processes -----------------------------------------------------

GARBAGE = 1200
"""More items than the dead-letter list keeps, so the cap shows."""


@pytest.fixture(scope="module", params=["solo", "prefork"])
def cluster(
    request: pytest.FixtureRequest,
    worker_cluster_factory: Callable[..., WorkerCluster],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerCluster]:
    url = f"sqlite:///{tmp_path_factory.mktemp('poison') / 'bso.sqlite3'}"
    upgrade(url)
    if request.param == "solo":
        workers = worker_cluster_factory(url, nodes=2)
    else:
        workers = worker_cluster_factory(url, pool="prefork", concurrency=2)
    yield workers
    workers.stop()


@pytest.mark.integration
def test_garbage_on_the_queues_is_dead_lettered_and_the_service_lives_on(
    cluster: WorkerCluster,
) -> None:
    broker_url = cluster.settings.broker_url
    items = garbage(GARBAGE, seed=len(cluster.nodes))
    processes = [*cluster.nodes]
    pool_pids = cluster.pool_pids()
    # A refused item that carries an event: its caller is told why.
    refused = message(keys.TASK_NEXT_TRIAL, NextTrial(job_id="x").model_dump_json())
    refused["content-type"] = "application/x-python-serialize"
    event = json.loads(json.loads(refused["body"])[0][0])
    items.append((json.dumps(refused).encode(), keys.EVENTS_QUEUE, "content_type"))

    client = cluster.redis()
    with client.pipeline(transaction=False) as pipe:
        for i, (item, queue, _) in enumerate(items):
            # Every tenth on a priority list, which the workers' BRPOP also reads.
            suffix = "\x06\x163" if i % 10 == 0 else ""
            pipe.lpush(keys.BROKER_KEY_PREFIX + queue + suffix, item)
        pipe.execute()
    wait_for(lambda: counts(broker_url).get("total") == len(items), "every item refused", cluster)

    assert all(p.alive() for p in processes), cluster.logs()
    assert cluster.pool_pids() == pool_pids  # prefork: the same pool processes, none replaced
    expected = Counter(reason for _, _, reason in items)
    assert counts(broker_url) == {**expected, "total": len(items)}
    assert client.llen(keys.DEADLETTERS_KEY) == keys.DEADLETTERS_MAX
    assert 0 < client.ttl(keys.DEADLETTERS_KEY) <= keys.DEADLETTERS_TTL_S
    assert not client.keys(keys.BROKER_KEY_PREFIX + "bso.*")  # both queues drained
    logs = cluster.logs()
    # Counted to the last one above; logged a line per process, queue and reason in a
    # window (deadletters.LOG_EVERY_S), not a line per item.
    lines = logs.count("queue item refused and dead-lettered")
    kinds = {(queue, reason) for _, queue, reason in items}
    assert 0 < lines <= len(kinds) * len(processes) < len(items)
    assert "\x1b" not in logs
    assert "\x00" not in logs

    # The same on the remote-control channel the workers listen to: they still answer pings.
    db = broker_url.rsplit("/", 1)[1]
    pidbox = f"{keys.BROKER_KEY_PREFIX}/{db}.celery.pidbox"
    for item in (b"[]", b"\xff", b'{"properties": {"delivery_tag": 1}}', items[0][0]):
        assert client.publish(pidbox, item) == len(cluster.nodes)
    total = len(items) + 4 * len(cluster.nodes)  # every node gets every broadcast
    wait_for(lambda: counts(broker_url).get("total") == total, "broadcasts refused", cluster)
    assert all(p.alive() for p in processes), cluster.logs()
    names = [node_name(p.name) for p in processes]
    assert ping_workers(cluster.settings, names, timeout_s=5) == set(names)

    key = keys.reply_key_for(event)
    assert key is not None
    service = cluster.client(timeout_s=30)
    reply = REPLY_ADAPTER.validate_json(service.replies.pop(key, 30) or "null")
    assert isinstance(reply, ErrorReply)
    assert reply.code == InvalidEvent.code

    run_a_job(service, "after-the-flood")
    assert all(p.alive() for p in processes)


def run_a_job(service: ServiceClient, job_id: str) -> None:
    """Register, take a trial, report epochs until told to stop, end it."""
    spec = JobSpec(
        job_id=job_id, batch_sizes=[8, 16], default_batch_size=16, target_metric=0.9, max_epochs=3
    )
    assert service.register(spec).created
    trial = service.next_trial(job_id)
    for epoch in range(1, 4):
        decision = service.report_epoch(
            job_id, trial.trial_number, epoch=epoch, time_s=10.0, energy_j=100.0, metric=0.5
        )
        if decision.stop:
            break
    ended = service.end_trial(job_id, trial.trial_number)
    assert ended.trial_number == trial.trial_number
    assert service.status(job_id).lanes[0].trials == 1


def wait_for(condition: Callable[[], bool], what: str, cluster: WorkerCluster) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what}\n{cluster.logs()[-5000:]}"
        )
        time.sleep(0.2)
