"""Announced replies: a waiting caller is woken by the worker's announcement and takes
the reply once, polls rarely once it knows the workers announce, and falls back to
dense polling when a reply comes unannounced or Redis refuses it a subscription.

The contract tests of the reply backends themselves are in ``test_transport.py``;
these count the takes (GETDELs) a wait costs, which is what announcements save.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import fakeredis
import pytest
import redis

from bso.wire import keys, replies
from bso.wire.replies import RedisReplyBackend, ReplyBackend, ReplyWatch, StubReplyBackend
from bso_workers.stack import start_redis
from bso_workers.supervision import free_port
from tests.fixtures.redis_server import RedisServer

KEY = keys.reply_key("event-1", "job", 3)


class CountingTakes:
    """Wraps a backend's ``take`` to count the takes a wait makes."""

    def __init__(self, backend: ReplyBackend) -> None:
        self.count = 0
        self._take = backend.take

        def take(key: str) -> str | None:
            self.count += 1
            return self._take(key)

        backend.take = take  # type: ignore[method-assign]


@pytest.fixture(params=["stub", "fakeredis", "redis"])
def backend(request: pytest.FixtureRequest) -> Iterator[ReplyBackend]:
    if request.param == "stub":
        made: ReplyBackend = StubReplyBackend()
    elif request.param == "fakeredis":
        fake = fakeredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
        made = RedisReplyBackend("redis://fake", client=fake)
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        made = RedisReplyBackend(server.fresh_url())
    yield made
    made.close()


def pushed_later(backend: ReplyBackend, seconds: float, value: str) -> threading.Timer:
    timer = threading.Timer(seconds, backend.push, args=(KEY, value, 60))
    timer.start()
    return timer


def test_a_waiting_caller_learns_that_replies_are_announced(backend: ReplyBackend) -> None:
    assert not backend.announcing
    with backend.watch(KEY) as watch:
        timer = pushed_later(backend, 0.3, "late")
        try:
            assert backend.pop(KEY, 10, watch=watch) == "late"
        finally:
            timer.join()
    assert backend.announcing


def test_an_announced_reply_costs_one_take_however_long_it_took(
    backend: ReplyBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Polls only every 30 s: a take before that is the announcement's doing.
    monkeypatch.setattr(replies, "ANNOUNCED_POLL_S", 30.0)
    backend.announcing = True
    takes = CountingTakes(backend)
    with backend.watch(KEY) as watch:
        timer = pushed_later(backend, 0.5, "late")
        try:
            assert backend.pop(KEY, 60, taken_once=True, watch=watch) == "late"
        finally:
            timer.join()
    assert takes.count == 1
    assert backend.announcing


def test_without_announcements_the_caller_polls_densely(backend: ReplyBackend) -> None:
    # A reply found by a poll, never heard: the caller does not start trusting
    # announcements, and the poll schedule is the dense one.
    takes = CountingTakes(backend)
    with nullcontext(ReplyWatch()) as watch:
        timer = pushed_later(backend, 0.3, "late")
        try:
            assert backend.pop(KEY, 10, watch=watch) == "late"
        finally:
            timer.join()
    assert not backend.announcing
    # 1, 1.5, 2.25 ... ms up to 50 ms: about a dozen takes in 0.3 s, never one.
    assert takes.count >= 5


def test_a_reply_nobody_announced_is_caught_and_polling_turns_dense_again(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An older worker (or a subscription lost in a reconnect): SET without PUBLISH.
    monkeypatch.setattr(replies, "ANNOUNCED_POLL_S", 0.2)
    url = redis_server.fresh_url()
    backend = RedisReplyBackend(url)
    old_worker = redis.Redis.from_url(url)
    backend.announcing = True
    try:
        with backend.watch(KEY) as watch:
            timer = threading.Timer(0.05, old_worker.set, args=(KEY, "unannounced"))
            timer.start()
            try:
                assert backend.pop(KEY, 10, taken_once=True, watch=watch) == "unannounced"
            finally:
                timer.join()
        assert not backend.announcing
    finally:
        old_worker.close()
        backend.close()


def test_the_worker_announces_on_the_reply_keys_own_channel(redis_server: RedisServer) -> None:
    url = redis_server.fresh_url()
    worker = RedisReplyBackend(url)
    listener = redis.Redis.from_url(url, decode_responses=True).pubsub()
    try:
        listener.subscribe(keys.reply_channel(KEY))
        worker.push(KEY, '{"kind": "x"}', 60)
        heard = [listener.get_message(timeout=5) for _ in range(2)]
        assert [m["type"] for m in heard if m] == ["subscribe", "message"]
        message = heard[1]
        assert message is not None
        assert message["channel"] == KEY
        assert message["data"] == ""  # the reply itself is only ever read from its key
    finally:
        listener.close()
        worker.close()


def test_a_user_refused_subscriptions_polls_and_stops_asking(tmp_path: Path) -> None:
    port = free_port()
    acl = [
        "--user", "default", "on", "nopass", "~*", "&*", "+@all",
        "--user", "old-client", "on", ">pw", "resetkeys", "resetchannels",
        f"~{keys.REPLY_PREFIX}*", "-@all", "+get", "+getdel",
    ]  # fmt: skip
    process = start_redis(tmp_path, "127.0.0.1", port, extra_args=acl)
    caller = RedisReplyBackend(f"redis://old-client:pw@127.0.0.1:{port}/0")
    worker = RedisReplyBackend(f"redis://127.0.0.1:{port}/0")
    try:
        with caller.watch(KEY) as watch:
            timer = pushed_later(worker, 0.2, "late")
            try:
                assert caller.pop(KEY, 10, watch=watch) == "late"
            finally:
                timer.join()
        assert not caller.may_subscribe
        assert not caller.announcing
        worker.push(KEY, "again", 60)
        assert caller.pop(KEY, 5) == "again"  # no subscription tried: plain polling
    finally:
        caller.close()
        worker.close()
        process.stop()


def test_subscriber_connections_are_reused_across_waits(redis_server: RedisServer) -> None:
    url = redis_server.fresh_url()
    backend = RedisReplyBackend(url)
    try:
        for n in range(3):
            key = keys.reply_key(f"event-{n}", "job", 1)
            with backend.watch(key) as watch:
                backend.push(key, str(n), 60)
                assert backend.pop(key, 5, watch=watch) == str(n)
        assert len(backend._idle) == 1
    finally:
        backend.close()
    assert backend._idle == []
