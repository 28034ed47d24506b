"""The door of a tenant's queue (bso.wire.admission) on real Redis 6.2 and 7, as the
tenant's own user runs it: admitted within the limits, refused past them with the
wait, and nothing else the user could run through it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from bso.apikeys import TenantLimits
from bso.errors import RateLimited
from bso.wire import keys
from bso.wire.admission import DOOR_SCRIPT, DOOR_SHA
from bso_client.publisher import RedisPublisher
from bso_workers.stack import start_redis
from bso_workers.supervision import free_port
from tests.test_credentials import REDIS_SERVERS

TEAM = keys.tenant_namespace("team-a")
SECRET = "s" * 43
KEY = "bso_0123456789ab_" + SECRET


@pytest.fixture(scope="module", params=REDIS_SERVERS)
def ports(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[int]:
    """A Redis with an operator (the default user) and team-a's user, as bso keys makes it."""
    port = free_port()
    users = ["--user", "default", "on", "nopass", "~*", "&*", "+@all",
             "--user", keys.tenant_user(TEAM.tenant or ""), "on", f">{SECRET}",
             *TEAM.user_rules.split()]  # fmt: skip
    process = start_redis(
        tmp_path_factory.mktemp("door"), "127.0.0.1", port, request.param, extra_args=users
    )
    try:
        yield port
    finally:
        process.stop()


@pytest.fixture
def operator(ports: int) -> Iterator[redis.Redis]:
    client = redis.Redis(port=ports)
    client.flushall()
    client.script_load(DOOR_SCRIPT)  # what every worker node does
    yield client
    client.close()


def team_url(port: int) -> str:
    return f"redis://{keys.tenant_user(TEAM.tenant or '')}:{SECRET}@127.0.0.1:{port}/0"


def publish(publisher: RedisPublisher, n: int = 1) -> None:
    for i in range(n):
        publisher.publish(keys.TASK_STATUS, '{"job_id":"j"}', f"m{i}")


def test_the_door_admits_a_burst_then_refuses_with_the_wait_and_counts_it(
    operator: redis.Redis, ports: int
) -> None:
    operator.set(TEAM.limits_key, TenantLimits(max_queue=100, per_second=2).encoded())
    publisher = RedisPublisher(team_url(ports), api_key=KEY)
    publish(publisher, 10)  # 2 per second over 5 s
    with pytest.raises(RateLimited) as refused:
        publish(publisher)
    assert operator.llen(TEAM.queue_key) == 10
    assert refused.value.retry_after_s is not None
    assert 4 < refused.value.retry_after_s <= 5
    assert "more events than its rate allows over 5 s" in refused.value.message
    assert operator.lrange(TEAM.refusals_key, 0, -1) == [b"r"]  # for the workers to count
    operator.ltrim(TEAM.admitted_key, 1, -1)  # as if the oldest admission left the window
    publish(publisher)
    assert operator.llen(TEAM.queue_key) == 11
    publisher.close()


def test_the_door_outlives_a_backward_step_of_the_redis_hosts_clock(
    operator: redis.Redis, ports: int
) -> None:
    """Redis's clock stepped back an hour (NTP correcting a clock that ran ahead, a VM
    restored from a snapshot): the door's log holds a burst of times an hour in its
    future.  Every event of the tenant used to be refused as over its rate, with a
    wait of an hour, until the clock caught up; fail-open runs took that for an
    outage and detached.  The log is dropped and the window starts again from now."""
    limits = TenantLimits(max_queue=100, per_second=2)
    operator.set(TEAM.limits_key, limits.encoded())
    seconds, micros = operator.time()
    step_back_ms = 3600 * 1000
    now_ms = seconds * 1000 + micros // 1000
    # Admitted 60 to 15 s before the step, a full burst: without the step, the next
    # event would be admitted at once.
    admitted = [now_ms + step_back_ms - 60_000 + i * 5_000 for i in range(limits.burst)]
    operator.lpush(TEAM.admitted_key, *admitted)
    publisher = RedisPublisher(team_url(ports), api_key=KEY)
    publish(publisher)
    assert operator.llen(TEAM.queue_key) == 1
    assert len(operator.lrange(TEAM.admitted_key, 0, -1)) == 1  # the log, from now on
    publish(publisher, limits.burst - 1)  # the rest of a burst, then the rate holds again
    with pytest.raises(RateLimited) as refused:
        publish(publisher)
    assert refused.value.retry_after_s is not None
    assert refused.value.retry_after_s <= 5
    publisher.close()


def test_a_full_queue_refuses_until_the_workers_take_from_it(
    operator: redis.Redis, ports: int
) -> None:
    operator.set(TEAM.limits_key, TenantLimits(max_queue=3, per_second=1000).encoded())
    publisher = RedisPublisher(team_url(ports), api_key=KEY)
    publish(publisher, 3)
    with pytest.raises(RateLimited, match="its queue is full") as refused:
        publish(publisher)
    assert refused.value.retry_after_s == 1.0
    assert operator.lrange(TEAM.refusals_key, 0, -1) == [b"q"]
    operator.rpop(TEAM.queue_key)  # a worker took one
    publish(publisher)
    assert operator.llen(TEAM.queue_key) == 3
    publisher.close()


def test_without_a_limits_key_or_with_a_spoiled_one_the_defaults_apply(
    operator: redis.Redis, ports: int
) -> None:
    publisher = RedisPublisher(team_url(ports), api_key=KEY)
    tenant = redis.Redis.from_url(team_url(ports))
    operator.set(TEAM.limits_key, "1 1")
    tenant.getdel(TEAM.limits_key)  # the tenant may delete its own limits: defaults then
    burst = TenantLimits().burst
    publish(publisher, burst)
    with pytest.raises(RateLimited):
        publish(publisher)
    assert operator.llen(TEAM.queue_key) == burst
    tenant.close()
    publisher.close()


def test_a_redis_that_forgot_the_door_lets_the_event_through(
    operator: redis.Redis, ports: int
) -> None:
    """After a Redis restart and before any worker loaded it again: no worker runs to
    protect, and the workers bound the queue themselves (bso_workers.queue_bounds)."""
    operator.script_flush()
    publisher = RedisPublisher(team_url(ports), api_key=KEY)
    publish(publisher)
    assert operator.llen(TEAM.queue_key) == 1
    publisher.close()


@pytest.mark.parametrize(
    "command",
    [
        ("EVAL", "while true do end", "0"),  # a loop would stall Redis for everyone
        ("SCRIPT", "LOAD", "while true do end"),
        ("SCRIPT", "FLUSH"),
        ("SET", TEAM.limits_key, "1000000 1000000"),  # its own limits: read-only
        ("INCR", TEAM.queue_key),  # would make its queue a string: every worker's pop fails
        ("HSET", keys.TENANT_LIMITS_KEY, TEAM.tenant or "", "1000000 1000000"),
        ("LPUSH", keys.TENANT_REFUSED_KEY, "x"),
        (
            "EVALSHA",
            DOOR_SHA,
            "4",
            *(keys.tenant_namespace("team-b").queue_key for _ in range(4)),
            "x",
            "1",
            "1",
        ),  # the door on another tenant's keys
    ],
    ids=lambda c: " ".join(c[:2])[:24],
)
def test_the_tenant_runs_the_door_and_nothing_else(
    operator: redis.Redis, ports: int, command: tuple[str, ...]
) -> None:
    tenant = redis.Redis.from_url(team_url(ports))
    try:
        with pytest.raises(redis.exceptions.ResponseError):
            tenant.execute_command(*command)
    finally:
        tenant.close()
    assert operator.ping()  # not stalled


def test_the_admission_log_stays_as_long_as_one_burst(operator: redis.Redis, ports: int) -> None:
    operator.set(TEAM.limits_key, TenantLimits(max_queue=10_000, per_second=3).encoded())
    publisher = RedisPublisher(team_url(ports), api_key=KEY)
    for _ in range(40):
        try:
            publish(publisher)
        except RateLimited:
            time.sleep(0.01)
    assert operator.llen(TEAM.admitted_key) == TenantLimits(per_second=3).burst
    publisher.close()
