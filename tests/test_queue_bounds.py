"""The workers' check of a tenant's queue against its bound: what went around the door."""

from __future__ import annotations

import fakeredis
import pytest
import redis

from bso.apikeys import DEFAULT_MAX_QUEUE, TenantLimits
from bso.wire import keys
from bso_workers.queue_bounds import QueueBounds

TEAM = keys.tenant_namespace("team-a")


@pytest.fixture
def client() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


def bound(client: fakeredis.FakeRedis, max_queue: int) -> None:
    """The limits as bso keys writes them: the workers' copy and the door's."""
    client.hset(keys.TENANT_LIMITS_KEY, "team-a", TenantLimits(max_queue=max_queue).encoded())
    client.set(TEAM.limits_key, TenantLimits(max_queue=max_queue).encoded())


def test_a_queue_below_its_bound_is_served(client: fakeredis.FakeRedis) -> None:
    bound(client, 3)
    client.lpush(TEAM.queue_key, "a", "b")
    assert QueueBounds(client).refusal(TEAM) is None
    assert client.hget(keys.TENANT_REFUSED_KEY, "team-a") is None


def test_a_queue_at_its_bound_was_filled_around_the_door_and_is_refused(
    client: fakeredis.FakeRedis,
) -> None:
    bound(client, 3)
    client.lpush(TEAM.queue_key, "a", "b", "c")
    refused = QueueBounds(client).refusal(TEAM)
    assert refused is not None
    assert refused.code == "rate_limited"
    assert "holds 3 events, at or past its bound of 3" in refused.message
    assert client.hget(keys.TENANT_REFUSED_KEY, "team-a") == b"1"


def test_a_tenant_that_deletes_its_copy_of_its_limits_keeps_its_bound(
    client: fakeredis.FakeRedis,
) -> None:
    bound(client, 3)
    client.delete(TEAM.limits_key)  # the tenant may GETDEL its door's copy
    client.lpush(TEAM.queue_key, "a", "b", "c")
    assert QueueBounds(client).refusal(TEAM) is not None


def test_without_limits_the_default_bound_holds(client: fakeredis.FakeRedis) -> None:
    client.lpush(TEAM.queue_key, *range(DEFAULT_MAX_QUEUE - 1))
    assert QueueBounds(client).refusal(TEAM) is None
    client.lpush(TEAM.queue_key, "one more")
    assert QueueBounds(client).refusal(TEAM) is not None


def test_the_shared_queue_has_no_bound_and_a_redis_outage_loses_no_event() -> None:
    down = redis.Redis(port=1, socket_connect_timeout=0.2)
    assert QueueBounds(down).refusal(keys.SHARED) is None
    assert QueueBounds(down).refusal(TEAM) is None
