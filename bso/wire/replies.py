"""The reply path: where a worker leaves a reply and how a caller waits for it.

Both sides go through one small interface, :class:`ReplyBackend` (in the
manner of dramatiq's result backends), so the caller's wait / retry / timeout
logic is written once (in :mod:`bso_client.transport`) and runs unchanged on
Redis (:class:`RedisReplyBackend`) or in memory (:class:`StubReplyBackend`,
for tests and for code that wants the whole loop in one process).

A reply is one JSON document stored under a per-event string key
(:func:`bso.wire.keys.reply_key_for`) with ``SET key value EX ttl``, so it never
exists without its TTL; the caller takes it with ``GETDEL``.  Taking rather
than a blocking pop (BLPOP on a list) because Redis 6.2 ACLs cannot tell the
keys of one command apart: a client allowed to BLPOP its reply lists could
also BLPOP (steal) the events queue, while GET/GETDEL cannot take from a list.

The worker also *announces* each reply: in the same round trip as the SET it
publishes an empty message on the channel named like the key
(:func:`bso.wire.keys.reply_channel`).  A caller subscribed to that channel
(:meth:`ReplyBackend.watch`) sleeps until the announcement instead of polling,
so a reply costs it one ``GETDEL`` however long it took.  The announcement
carries nothing: the reply itself is only ever read from its key, and a
client may subscribe only to channels it can name exactly (no pattern
subscriptions), as it may only take keys it can name.

Polling stays, on the one schedule written in :meth:`ReplyBackend.pop`, as
the safety net: dense (from :data:`POLL_FIRST_S` up to :data:`POLL_CAP_S`)
until this caller has heard an announcement, rare (:data:`ANNOUNCED_POLL_S`)
once it knows the workers announce, and dense again if a reply ever turns up
unannounced (an older worker, a lost subscription).  A Redis user without the
right to subscribe (an ACL written before announcements) simply polls.

A broker that cannot be reached raises
:class:`~bso.wire.connection.BrokerUnreachable`, which the caller rides out by
sending the same event again (:mod:`bso_client.transport`).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import redis
from redis.client import PubSub

from bso.wire.connection import OUTAGE_ERRORS, broker_error, redis_client
from bso.wire.keys import reply_channel

POLL_FIRST_S = 0.001
"""Wait before the second poll of a reply key (the first one is immediate)."""

POLL_GROWTH = 1.5
"""Each further wait is this much longer than the one before..."""

POLL_CAP_S = 0.05
"""...up to this: a reply that lands late and unannounced is seen at most 50 ms
after it lands, and a caller waiting out a 10 s timeout that way costs Redis
about 200 GETDELs."""

ANNOUNCED_POLL_S = 1.0
"""Wait between polls once this caller knows the workers announce their replies:
a poll is then only the safety net for an announcement that never came."""

IDLE_SUBSCRIPTIONS = 4
"""Subscriber connections a :class:`RedisReplyBackend` keeps for its next waits
(one per call in flight at once: a training loop and its heartbeat thread)."""


class ReplyWatch:
    """Waits for the announcement of one reply.  This one hears none: it sleeps,
    so waiting on it is plain polling."""

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True as soon as the reply was announced."""
        time.sleep(seconds)
        return False


class ReplyBackend(ABC):
    """A set of reply keys: workers store one reply per key, callers take it with a timeout.

    Subclasses provide :meth:`push`, :meth:`take` and :meth:`close`, and
    :meth:`watch` where they can announce replies; :meth:`pop` waits on the one
    schedule all of them share.
    """

    def __init__(self) -> None:
        self.announcing = False
        """Whether this caller heard a reply announced before taking it, and has
        not found one unannounced since: then polls are only a safety net."""

    @abstractmethod
    def push(self, key: str, reply_json: str, ttl_s: int) -> None:
        """Store ``reply_json`` at ``key`` (replacing any reply there) for ``ttl_s``
        seconds, and announce it."""

    @abstractmethod
    def take(self, key: str) -> str | None:
        """Take the reply at ``key`` now, deleting it; None if there is none (yet)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections, if any."""

    def watch(self, key: str) -> AbstractContextManager[ReplyWatch]:
        """Listen for the announcement of ``key``'s reply while the block runs.
        Enter it before sending the event, so that the reply cannot be announced
        before anyone listens.  This default hears nothing (polling only)."""
        return nullcontext(ReplyWatch())

    def pop(
        self,
        key: str,
        timeout_s: float,
        *,
        taken_once: bool = False,
        watch: ReplyWatch | None = None,
    ) -> str | None:
        """Take the reply at ``key``, waiting up to ``timeout_s``; None if none came.

        The first take is immediate (skipped when ``taken_once``: the caller
        just took, e.g. pipelined with its publish).  Then each wait ends at the
        reply's announcement (on ``watch``, or on one of its own) or after the
        poll schedule's next step, and is followed by a take.  The schedule:
        :data:`ANNOUNCED_POLL_S` while :attr:`announcing`, else waits growing
        from :data:`POLL_FIRST_S` by :data:`POLL_GROWTH` up to :data:`POLL_CAP_S`.
        The last take is made at the deadline.
        """
        if watch is None:
            with self.watch(key) as own:
                return self._wait_and_take(key, timeout_s, taken_once, own)
        return self._wait_and_take(key, timeout_s, taken_once, watch)

    def _wait_and_take(
        self, key: str, timeout_s: float, taken_once: bool, watch: ReplyWatch
    ) -> str | None:
        deadline = time.monotonic() + timeout_s
        if not taken_once:
            value = self.take(key)
            if value is not None:
                return value
        delay = POLL_FIRST_S
        while (remaining := deadline - time.monotonic()) > 0:
            trusted = self.announcing
            heard = watch.wait(min(ANNOUNCED_POLL_S if trusted else delay, remaining))
            value = self.take(key)
            if value is not None:
                if heard:
                    self.announcing = True
                elif trusted:  # the safety net caught a reply nobody announced
                    self.announcing = False
                return value
            delay = min(delay * POLL_GROWTH, POLL_CAP_S)
        return None


class RedisReplyBackend(ReplyBackend):
    """Reply keys in Redis: ``SET key value EX ttl`` and ``PUBLISH`` on the key's
    channel to store and announce, ``SUBSCRIBE`` to hear it, ``GETDEL`` to take."""

    def __init__(
        self, url: str, *, connect_timeout_s: float = 5.0, client: redis.Redis | None = None
    ) -> None:
        """Connect to ``url``, or use ``client`` (any redis-py compatible client) for it."""
        super().__init__()
        self.url = url
        self.redis: redis.Redis = client or redis_client(url, connect_timeout_s=connect_timeout_s)
        self.may_subscribe = True
        """False once Redis refused this user a subscription: it then only polls."""
        self._idle: list[PubSub] = []
        self._idle_lock = threading.Lock()

    def push(self, key: str, reply_json: str, ttl_s: int) -> None:
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(key, reply_json, ex=ttl_s)
                pipe.publish(reply_channel(key), "")
                pipe.execute()
        except OUTAGE_ERRORS as exc:
            raise broker_error(self.url, exc) from exc

    def take(self, key: str) -> str | None:
        try:
            value = self.redis.getdel(key)
        except OUTAGE_ERRORS as exc:
            raise broker_error(self.url, exc) from exc
        return decoded(value)

    @contextmanager
    def watch(self, key: str) -> Iterator[ReplyWatch]:
        channel = reply_channel(key)
        pubsub = self._subscribed(channel) if self.may_subscribe else None
        if pubsub is None:
            yield ReplyWatch()
            return
        watch = _ChannelWatch(self, pubsub, channel)
        try:
            yield watch
        finally:
            self._release(watch)

    def close(self) -> None:
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for pubsub in idle:
            pubsub.close()
        self.redis.close()

    def _subscribed(self, channel: str) -> PubSub | None:
        """A subscriber connection with SUBSCRIBE sent (its answer is read while
        waiting); None where Redis cannot be reached now (the takes will say so)."""
        with self._idle_lock:
            pubsub = self._idle.pop() if self._idle else None
        if pubsub is None:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        try:
            pubsub.subscribe(channel)
        except redis.RedisError:
            pubsub.close()
            return None
        return pubsub

    def _release(self, watch: _ChannelWatch) -> None:
        pubsub = watch.pubsub
        if not watch.broken:
            try:
                # Answered while the next wait on this connection reads.
                pubsub.unsubscribe(watch.channel)  # type: ignore[no-untyped-call]
            except redis.RedisError:
                watch.broken = True
        if not watch.broken:
            with self._idle_lock:
                if len(self._idle) < IDLE_SUBSCRIPTIONS:
                    self._idle.append(pubsub)
                    return
        pubsub.close()


class _ChannelWatch(ReplyWatch):
    """Waits on a subscriber connection for the one message announcing a reply."""

    def __init__(self, backend: RedisReplyBackend, pubsub: PubSub, channel: str) -> None:
        self.backend = backend
        self.pubsub = pubsub
        self.channel = channel
        self.broken = False
        """The subscription failed; the rest of the wait is plain polling."""

    def wait(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self.broken and (remaining := deadline - time.monotonic()) > 0:
            try:
                message = self.pubsub.get_message(timeout=remaining)
            except redis.exceptions.NoPermissionError:  # an ACL without SUBSCRIBE
                self.backend.may_subscribe = False
                self.broken = True
            except redis.RedisError:  # lost connection: the takes report outages
                self.broken = True
            else:
                if self._announces(message):
                    return True
        if (remaining := deadline - time.monotonic()) > 0:
            time.sleep(remaining)
        return False

    def _announces(self, message: dict[str, object] | None) -> bool:
        """Whether ``message`` (None, a subscription's answer, or a message that may
        be left over from an earlier watch on this connection) is this reply's."""
        return (
            message is not None
            and message["type"] == "message"
            and decoded(message["channel"]) == self.channel
        )


def decoded(value: object) -> str | None:
    """A reply as read from Redis (str, or bytes from a client without
    ``decode_responses``) as text; None stays None."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode()
    assert isinstance(value, str)
    return value


class StubReplyBackend(ReplyBackend):
    """Reply keys in this process's memory, with the same semantics as Redis:
    a push replaces the key's reply, sets its TTL and announces it, a take returns
    and deletes it.

    Thread-safe.  TTLs run on ``clock`` so that tests can expire replies
    without sleeping (the waits in :meth:`pop` still run in real time).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._replies: dict[str, tuple[str, float]] = {}
        self._pushes: Counter[str] = Counter()
        self._changed = threading.Condition()

    def push(self, key: str, reply_json: str, ttl_s: int) -> None:
        with self._changed:
            self._replies[key] = (reply_json, self._clock() + ttl_s)
            self._pushes[key] += 1
            self._changed.notify_all()

    def take(self, key: str) -> str | None:
        with self._changed:
            value = self._live(key)
            self._replies.pop(key, None)
            return value

    def watch(self, key: str) -> AbstractContextManager[ReplyWatch]:
        return nullcontext(_StubWatch(self, key))

    def close(self) -> None:
        """Nothing to release: the replies are garbage like any other object."""

    def keys(self) -> list[str]:
        """Keys holding unexpired replies, sorted (what ``SCAN`` would show)."""
        with self._changed:
            return sorted(k for k in list(self._replies) if self._live(k) is not None)

    def _live(self, key: str) -> str | None:
        entry = self._replies.get(key)
        if entry is None:
            return None
        value, expires_at = entry
        if self._clock() >= expires_at:
            del self._replies[key]
            return None
        return value


class _StubWatch(ReplyWatch):
    """Hears the pushes made to one key of a :class:`StubReplyBackend` after it began."""

    def __init__(self, backend: StubReplyBackend, key: str) -> None:
        self._backend = backend
        self._key = key
        with backend._changed:
            self._heard = backend._pushes[key]

    def wait(self, seconds: float) -> bool:
        backend = self._backend
        with backend._changed:
            pushed = backend._changed.wait_for(
                lambda: backend._pushes[self._key] > self._heard, seconds
            )
            self._heard = backend._pushes[self._key]
        return pushed
