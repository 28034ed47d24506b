"""Workers serve every tenant's queue, and serve them in rotation under a backlog."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime

import fakeredis
import pytest
import redis

from bso.apikeys import ApiKeyRecord, TenantLimits, key_id_of
from bso.errors import UnknownJob
from bso.storage.memory import MemoryStore
from bso.wire import keys
from bso_client.transport import ServiceClient
from bso_workers.stack import Stack
from bso_workers.tenant_keys import create_key
from bso_workers.tenant_queues import (
    TenantQueues,
    clear_spoiled_queues,
    count_refusals,
    tenant_names,
)
from bso_workers.tenant_users import serve_stored_tenants
from tests.fixtures.scripts import load_script
from tests.fixtures.stacks import running_stack


class Recorder:
    """A node's consumer, as far as the tenants' queues go."""

    def __init__(self, members: Iterable[bytes | str] = ()) -> None:
        self.members: list[bytes | str] | Exception = list(members)
        self.calls: list[tuple[str, str]] = []

    def read(self) -> list[bytes | str]:
        if isinstance(self.members, Exception):
            raise self.members
        return self.members

    def queues(self) -> TenantQueues:
        return TenantQueues(
            self.read,
            lambda queue: self.calls.append(("add", queue)),
            lambda queue: self.calls.append(("cancel", queue)),
        )


def test_a_node_starts_and_stops_consuming_as_tenants_come_and_go() -> None:
    recorder = Recorder([b"team-a", "team-b"])
    queues = recorder.queues()
    queues.refresh()
    queues.refresh()  # nothing new: nothing done
    assert recorder.calls == [("add", "bso.events.t.team-a"), ("add", "bso.events.t.team-b")]
    recorder.calls.clear()
    recorder.members = [b"team-b", b"team-c"]
    queues.refresh()
    assert recorder.calls == [("add", "bso.events.t.team-c"), ("cancel", "bso.events.t.team-a")]


def redis_wiped_queues(client: redis.Redis, store: MemoryStore) -> tuple[TenantQueues, list[str]]:
    """The step's wiring of :class:`TenantQueues` (:func:`tenant_queues_step`) on
    ``client``, rebuilding from ``store``; the consumer's calls."""
    calls: list[str] = []
    queues = TenantQueues(
        lambda: client.smembers(keys.TENANTS_KEY),
        lambda queue: calls.append(f"add {queue}"),
        lambda queue: calls.append(f"cancel {queue}"),
        missing=lambda: not client.exists(keys.TENANTS_KEY),
        rebuild=lambda: serve_stored_tenants(client, store),
    )
    return queues, calls


def test_a_redis_that_lost_its_keys_gets_the_tenants_set_back_from_the_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Redis restarted without persistence (or one that evicted the set) has no
    tenants set: the nodes cancelled every tenant's queue, and every team's runs were
    told that no worker ran, until someone ran ``bso keys sync``.  The node rebuilds
    the set, and the tenants' limits, from the store, and keeps serving."""
    store = MemoryStore()
    create_key(store, "team-a")
    revoked = create_key(store, "team-b")
    store.revoke_api_key(key_id_of(revoked)[0], datetime.now(UTC))
    store.set_tenant_limits("team-a", TenantLimits(max_queue=7, per_second=3))
    client = fakeredis.FakeRedis()
    client.sadd(keys.TENANTS_KEY, "team-a")
    queues, calls = redis_wiped_queues(client, store)
    queues.refresh()
    assert calls == ["add bso.events.t.team-a"]
    client.flushall()  # the restart without persistence
    with caplog.at_level(logging.WARNING, "bso.tenant_queues"):
        queues.refresh()
        queues.refresh()
    assert calls == ["add bso.events.t.team-a"]  # nothing cancelled
    assert client.smembers(keys.TENANTS_KEY) == {b"team-a"}
    assert client.hget(keys.TENANT_LIMITS_KEY, "team-a") == TenantLimits(7, 3).encoded().encode()
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "the tenants set was missing from Redis" in warning.getMessage()


def test_a_store_that_fails_while_the_set_is_missing_cancels_nothing() -> None:
    class Down(MemoryStore):
        def api_keys(self) -> list[ApiKeyRecord]:
            raise OSError("database unreachable")

    client = fakeredis.FakeRedis()
    client.sadd(keys.TENANTS_KEY, "team-a")
    queues, calls = redis_wiped_queues(client, Down())
    queues.refresh()
    client.flushall()
    queues.refresh()
    assert calls == ["add bso.events.t.team-a"]


def test_a_member_that_is_no_tenant_is_never_consumed_and_an_outage_changes_nothing() -> None:
    assert tenant_names([b"team-a", b"", b"a:b", b"*", "x" * 65, b"\xff"]) == {"team-a"}
    recorder = Recorder([b"team-a"])
    queues = recorder.queues()
    queues.refresh()
    recorder.members = redis.ConnectionError("down")
    queues.refresh()
    assert queues.consumed == {"bso.events.t.team-a"}
    assert recorder.calls == [("add", "bso.events.t.team-a")]


def test_a_queue_that_cannot_be_consumed_now_is_tried_again_and_the_others_are_served() -> None:
    recorder = Recorder([b"team-a", b"team-b"])
    failing = {"bso.events.t.team-a"}

    def add(queue: str) -> None:
        if queue in failing:
            raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind")
        recorder.calls.append(("add", queue))

    queues = TenantQueues(recorder.read, add, lambda queue: None)
    queues.refresh()
    assert queues.consumed == {"bso.events.t.team-b"}
    failing.clear()
    queues.refresh()
    assert queues.consumed == {"bso.events.t.team-a", "bso.events.t.team-b"}


def test_the_doors_refusals_are_counted_once_into_the_workers_counter() -> None:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    team = keys.tenant_namespace("team-a")
    client.lpush(team.refusals_key, "r", "r", "q")
    count_refusals(client, {"team-a", "team-b"})
    count_refusals(client, {"team-a", "team-b"})  # nothing new: nothing counted
    client.lpush(team.refusals_key, "r")
    count_refusals(client, {"team-a"})
    assert client.hgetall(keys.TENANT_REFUSED_KEY) == {b"team-a": b"4"}
    assert client.exists(team.refusals_key) == 0


def test_a_queue_key_that_is_no_list_is_deleted_before_a_node_consumes() -> None:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    team_a, team_b = keys.tenant_namespace("team-a"), keys.tenant_namespace("team-b")
    client.set(team_a.queue_key, "1")  # what INCR on an empty queue key would leave
    client.lpush(team_b.queue_key, "an event")
    client.hset(keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE, "f", "x")
    spoiled = clear_spoiled_queues(client, {"team-a", "team-b"})
    assert spoiled == [keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE, team_a.queue_key]
    assert client.exists(team_a.queue_key) == 0
    assert client.lrange(team_b.queue_key, 0, -1) == [b"an event"]
    order: list[str] = []
    queues = TenantQueues(
        lambda: [b"team-a"],
        lambda queue: order.append("add"),
        lambda queue: None,
        clear=lambda tenants: order.append("clear"),
    )
    queues.refresh()
    assert order == ["clear", "add"]


# -- the rotation, on a real worker node -------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One worker node: the rotation is then exactly kombu's, with nobody to share it."""
    with running_stack(tmp_path_factory.mktemp("rotation") / "data") as running:
        yield running


BENCH = load_script("bench_flood")
"""``scripts/bench_flood.py``: its tenants are made, and its flood pushed, as here."""


def test_one_event_of_a_quiet_tenant_waits_for_at_most_one_of_a_flooding_tenants(
    stack: Stack,
) -> None:
    loud_key, loud_url = BENCH.make_tenant(stack, "loud")
    quiet_key, quiet_url = BENCH.make_tenant(stack, "quiet")
    worker = redis.Redis.from_url(stack.settings.broker_url)
    loud_queue = keys.tenant_namespace("loud").queue_key
    with ServiceClient.connect(quiet_url, api_key=quiet_key, timeout_s=20) as quiet:
        with pytest.raises(UnknownJob):  # the node serves the quiet tenant's queue
            quiet.status("quiet-job")
        BENCH.flood(loud_url, loud_key, keys.tenant_namespace("loud"), 400)
        deadline = time.monotonic() + 20
        while worker.llen(loud_queue) > 390 and time.monotonic() < deadline:
            time.sleep(0.01)  # the node is busy with the backlog
        before = worker.llen(loud_queue)
        with pytest.raises(UnknownJob):
            quiet.status("quiet-job")
        after = worker.llen(loud_queue)
    worker.close()
    assert 0 < after <= before
    # FIFO would have made the quiet read wait behind every queued item (~390); the
    # rotation lets through at most the one running and the one popped just before.
    assert before - after <= 3, (before, after)


def test_a_queue_full_of_garbage_takes_its_turn_like_any_other(stack: Stack) -> None:
    """Garbage is refused before decoding, and still counts as its queue's turn: a
    tenant that floods its queue with junk does not keep it first in the rotation."""
    junk_key, junk_url = BENCH.make_tenant(stack, "junk")
    calm_key, calm_url = BENCH.make_tenant(stack, "calm")
    junk_queue = keys.tenant_namespace("junk").queue_key
    worker = redis.Redis.from_url(stack.settings.broker_url)
    flooder = redis.Redis.from_url(junk_url)
    with ServiceClient.connect(calm_url, api_key=calm_key, timeout_s=20) as calm:
        with pytest.raises(UnknownJob):
            calm.status("calm-job")
        for _ in range(5):
            flooder.lpush(junk_queue, *(["g"] * 2000))
        deadline = time.monotonic() + 20
        while worker.llen(junk_queue) > 9990 and time.monotonic() < deadline:
            time.sleep(0.01)
        before = worker.llen(junk_queue)
        with pytest.raises(UnknownJob):
            calm.status("calm-job")
        after = worker.llen(junk_queue)
    flooder.close()
    worker.close()
    del junk_key
    assert after > 0, "the junk was all refused before the calm read: no test"
    # Without the turn, the calm read waited for all of the junk (~10,000 items).
    assert before - after < 1000, (before, after)
