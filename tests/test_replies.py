"""Announced replies: a waiting caller is woken by the worker's announcement and takes
the reply once, polls rarely once it knows the workers announce, and falls back to
dense polling when a reply comes unannounced or Redis refuses it a subscription.

The contract tests of the reply backends themselves are in ``test_transport.py``;
these count the takes (GETDELs) a wait costs, which is what announcements save.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import fakeredis
import pytest
import redis

from bso.wire import keys, replies
from bso.wire.replies import RedisReplyBackend, ReplyBackend, ReplyWatch
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


@pytest.fixture
def backend(reply_backend: ReplyBackend) -> ReplyBackend:
    return reply_backend


def answer_later(
    backend: ReplyBackend, watch: ReplyWatch, seconds: float, value: str, key: str = KEY
) -> threading.Timer:
    """What a worker does: store the reply and announce it where the message asked."""
    timer = threading.Timer(seconds, backend.push, args=(key, value, 60, watch.channel))
    timer.start()
    return timer


@contextmanager
def answered_later(
    backend: ReplyBackend, watch: ReplyWatch, seconds: float, value: str, key: str = KEY
) -> Iterator[None]:
    """The block runs while a worker answers after ``seconds``; it has answered after."""
    timer = answer_later(backend, watch, seconds, value, key)
    try:
        yield
    finally:
        timer.join()


def polls_only_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the dense polls 30 s apart, so that a wait of a few seconds ends early only
    at an announcement.  Else a poll ending just as the reply lands finds it before
    the announcement is read, and the caller rightly does not count it as heard."""
    monkeypatch.setattr(replies, "POLL_FIRST_S", 30.0)
    monkeypatch.setattr(replies, "POLL_CAP_S", 30.0)


def test_a_waiting_caller_learns_that_replies_are_announced(
    backend: ReplyBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    polls_only_at_the_deadline(monkeypatch)
    assert not backend.announcing
    with backend.watch(KEY) as watch, answered_later(backend, watch, 0.3, "late"):
        assert backend.pop(KEY, 10, watch=watch) == "late"
    assert backend.announcing


def test_an_announced_reply_costs_one_take_however_long_it_took(
    backend: ReplyBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Polls only every 30 s, and the wait ends at 5 s: a take of the reply before
    # that, with announcing still trusted, is the announcement's doing.
    monkeypatch.setattr(replies, "ANNOUNCED_POLL_S", 30.0)
    backend.announcing = True
    takes = CountingTakes(backend)
    with backend.watch(KEY) as watch, answered_later(backend, watch, 0.5, "late"):
        assert backend.pop(KEY, 5, taken_once=True, watch=watch) == "late"
    assert takes.count == 1
    assert backend.announcing


def test_waits_of_several_threads_share_one_subscription(redis_server: RedisServer) -> None:
    backend = RedisReplyBackend(redis_server.fresh_url())
    backend.announcing = True  # so that only announcements can end these waits early
    results: dict[str, str | None] = {}
    answered = [keys.reply_key(f"event-{n}", "job", 1) for n in range(4)]

    def wait_for(key: str) -> None:
        with backend.watch(key) as watch:
            timers.append(answer_later(backend, watch, 0.2, key, key))
            results[key] = backend.pop(key, 0.9, taken_once=True, watch=watch)

    timers: list[threading.Timer] = []
    threads = [threading.Thread(target=wait_for, args=(key,)) for key in answered]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for timer in timers:
            timer.join()
        backend.close()
    assert results == {key: key for key in answered}
    assert backend.announcing  # none of them was found by the safety net


def test_without_announcements_the_caller_polls_densely(backend: ReplyBackend) -> None:
    # A reply found by a poll, never heard: the caller does not start trusting
    # announcements, and the poll schedule is the dense one.
    takes = CountingTakes(backend)
    with nullcontext(ReplyWatch()) as watch, answered_later(backend, watch, 0.3, "late"):
        assert backend.pop(KEY, 10, watch=watch) == "late"
    assert not backend.announcing
    # 1, 1.5, 2.25 ... ms up to 50 ms: about a dozen takes in 0.3 s.
    assert takes.count >= 5


def test_a_reply_nobody_announced_is_caught_and_polling_turns_dense_again(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An older worker, or a message without the channel header: SET without PUBLISH.
    monkeypatch.setattr(replies, "ANNOUNCED_POLL_S", 0.2)
    url = redis_server.fresh_url()
    backend = RedisReplyBackend(url)
    old_worker = RedisReplyBackend(url)
    backend.announcing = True
    try:
        with backend.watch(KEY) as watch:
            timer = threading.Timer(0.05, old_worker.push, args=(KEY, "unannounced", 60))
            timer.start()
            try:
                assert backend.pop(KEY, 10, taken_once=True, watch=watch) == "unannounced"
            finally:
                timer.join()
        assert not backend.announcing
        # The subscription looked alive but did not hear: it is renewed.
        assert backend._inbox._pubsub is None
    finally:
        old_worker.close()
        backend.close()


def test_the_worker_announces_the_key_on_the_callers_channel(redis_server: RedisServer) -> None:
    url = redis_server.fresh_url()
    worker = RedisReplyBackend(url)
    channel = keys.SHARED.announce_channel("ab" * 16)
    listener = redis.Redis.from_url(url, decode_responses=True).pubsub()
    try:
        listener.subscribe(channel)
        worker.push(KEY, '{"kind": "x"}', 60, channel)
        heard = [listener.get_message(timeout=5) for _ in range(2)]
        assert [m["type"] for m in heard if m] == ["subscribe", "message"]
        message = heard[1]
        assert message is not None
        assert message["channel"] == channel
        assert message["data"] == KEY  # the key only: the reply is read from it
    finally:
        listener.close()
        worker.close()


def test_each_caller_has_a_channel_of_its_own_that_nobody_can_guess(
    redis_server: RedisServer,
) -> None:
    first, second = (RedisReplyBackend(redis_server.fresh_url()) for _ in range(2))
    try:
        with first.watch(KEY) as one, second.watch(KEY) as other:
            assert one.channel is not None
            assert other.channel is not None
            assert one.channel != other.channel
            assert keys.SHARED.is_announce_channel(one.channel)
            assert len(one.channel) == len(keys.ANNOUNCE_PREFIX) + 32  # 128 random bits
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize(
    "channel",
    [
        keys.ANNOUNCE_PREFIX + "ab" * 16,
    ],
)
def test_announcement_channels_have_one_shape(channel: str) -> None:
    assert keys.SHARED.is_announce_channel(channel)
    for wrong in (
        None,
        7,
        channel + "0",
        channel[:-1],
        channel.upper(),
        "/0.celery.pidbox",
        "bso:reply:job:1:event",
        keys.ANNOUNCE_PREFIX + "*",
    ):
        assert not keys.SHARED.is_announce_channel(wrong)


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
            assert watch.channel is None  # so the worker is asked for no announcement
            with answered_later(worker, watch, 0.2, "late"):
                assert caller.pop(KEY, 10, watch=watch) == "late"
        assert not caller.may_subscribe
        assert not caller.announcing
        worker.push(KEY, "again", 60)
        assert caller.pop(KEY, 5) == "again"  # no subscription tried: plain polling
    finally:
        caller.close()
        worker.close()
        process.stop()


def test_a_lost_subscription_degrades_to_polling_and_comes_back(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = redis_server.fresh_url()
    backend = RedisReplyBackend(url)
    admin = redis.Redis.from_url(url)
    try:
        with backend.watch(KEY) as watch:
            assert watch.channel is not None
            admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            with answered_later(backend, watch, 0.2, "late"):
                assert backend.pop(KEY, 5, watch=watch) == "late"  # heard or polled
        polls_only_at_the_deadline(monkeypatch)
        again = keys.reply_key("event-2", "job", 3)
        with (
            backend.watch(again) as watch,  # subscribed again (by redis-py or anew)
            answered_later(backend, watch, 0.2, "later", again),
        ):
            assert backend.pop(again, 5, watch=watch) == "later"
        assert backend.announcing
    finally:
        admin.close()
        backend.close()


def test_a_wait_interrupted_while_reading_leaves_the_subscription_usable(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = RedisReplyBackend(redis_server.fresh_url())
    try:
        with backend.watch(KEY) as watch:
            pubsub = backend._inbox._pubsub
            assert pubsub is not None

            def interrupted(**_: object) -> None:
                raise KeyboardInterrupt

            monkeypatch.setattr(pubsub, "get_message", interrupted)
            with pytest.raises(KeyboardInterrupt):
                watch.wait(1)
        assert not backend._inbox._reading  # the reader's turn ended
        polls_only_at_the_deadline(monkeypatch)
        again = keys.reply_key("event-2", "job", 3)
        with (
            backend.watch(again) as watch,  # subscribed anew, and it hears
            answered_later(backend, watch, 0.1, "later", again),
        ):
            assert backend.pop(again, 5, watch=watch) == "later"
        assert backend.announcing
    finally:
        backend.close()


def test_two_waits_for_one_key_both_hear_it(redis_server: RedisServer) -> None:
    backend = RedisReplyBackend(redis_server.fresh_url())
    try:
        with backend.watch(KEY) as first:
            with backend.watch(KEY):
                pass  # the second wait ends first; the first still expects the key
            with answered_later(backend, first, 0.1, "late"):
                assert first.wait(5)
    finally:
        backend.close()


def test_a_forked_child_subscribes_on_a_channel_of_its_own(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = RedisReplyBackend(redis_server.fresh_url())
    try:
        with backend.watch(KEY) as parents:
            pass
        assert backend._inbox._pubsub is not None
        monkeypatch.setattr(replies.os, "getpid", lambda: -1)  # as in a forked child
        with backend.watch(KEY) as childs:
            assert childs.channel != parents.channel
            with answered_later(backend, childs, 0.1, "late"):
                assert childs.wait(5)
    finally:
        backend.close()


def test_a_failed_subscription_is_not_tried_again_at_once() -> None:
    tries = 0

    def refused(*_: object) -> None:
        raise redis.ConnectionError("refused")

    class Unreachable(fakeredis.FakeRedis):
        def pubsub(self, **kwargs: object) -> redis.client.PubSub:
            nonlocal tries
            tries += 1
            pubsub = super().pubsub(**kwargs)  # type: ignore[arg-type]
            pubsub.subscribe = refused  # type: ignore[method-assign]
            return pubsub

    backend = RedisReplyBackend("redis://fake", client=Unreachable(decode_responses=True))
    try:
        for _ in range(3):
            with backend.watch(KEY) as watch:
                assert watch.channel is None  # polling, and asking for no announcement
        assert tries == 1
        assert backend.may_subscribe  # not refused: tried again later
        backend._inbox._retry_at = 0.0  # as if SUBSCRIBE_RETRY_S had passed
        with backend.watch(KEY):
            pass
        assert tries == 2
    finally:
        backend.close()
