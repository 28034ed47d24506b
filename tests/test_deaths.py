"""The per-event death counter that turns an endlessly redelivered event into poison."""

from __future__ import annotations

import fakeredis

from bso.wire import keys
from bso_workers.deaths import RedisDeathCounter


def test_deaths_add_up_per_event_and_expire() -> None:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    counter = RedisDeathCounter("redis://fake", client=client)
    assert [counter.record("e1"), counter.record("e1"), counter.record("e2")] == [1, 2, 1]
    assert 0 < client.ttl(keys.deaths_key("e1")) <= keys.DEATHS_TTL_S
    counter.close()
    assert client.ping()  # a client it was given is not closed


def test_each_namespace_counts_its_own_deaths_of_an_event_id() -> None:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    counter = RedisDeathCounter("redis://fake", client=client)
    assert [counter.record("e1", "team-b"), counter.record("e1", "team-b")] == [1, 2]
    assert [counter.record("e1"), counter.record("e1", "team-a")] == [1, 1]
    # An event id has no "/": no shared id names a tenant's key.
    assert len({keys.deaths_key("e1"), keys.deaths_key("e1", "a"), keys.deaths_key("a:e1")}) == 3
