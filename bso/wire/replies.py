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

The worker also *announces* each reply, so that a caller need not poll: every
caller backend subscribes once to a channel of its own
(:func:`bso.wire.keys.announce_channel`, named by 128 random bits), sends its
name with each event (:data:`bso.wire.keys.REPLY_CHANNEL_HEADER`), and the
worker publishes the reply's key there in the SET's round trip.  A wait
(:meth:`ReplyBackend.watch`) then sleeps until its key is announced and costs
one ``GETDEL`` however long the reply took.  The announcement carries only the
key; the reply itself is only ever read from it.

Polling stays, on the one schedule written in :meth:`ReplyBackend.pop`, as
the safety net: dense (from :data:`POLL_FIRST_S` up to :data:`POLL_CAP_S`)
until this caller has heard an announcement, rare (:data:`ANNOUNCED_POLL_S`)
once it knows the workers announce, and dense again if a reply ever turns up
unannounced (a subscription lost without an error, which is then renewed).
A Redis user without the right to subscribe (an ACL written before
announcements) simply polls.  Workers older than announcements refuse the
header: upgrade the workers first (docs/operations.md, "Upgrading").

A broker that cannot be reached raises
:class:`~bso.wire.connection.BrokerUnreachable`, which the caller rides out by
sending the same event again (:mod:`bso_client.transport`).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import redis
from redis.client import PubSub

from bso.wire.connection import OUTAGE_ERRORS, broker_error, redis_client
from bso.wire.keys import ANNOUNCE_TOKEN_LENGTH, SHARED, Namespace

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

SUBSCRIBE_TIMEOUT_S = 5.0
"""How long a caller waits for Redis to confirm its subscription, once."""

SUBSCRIBE_RETRY_S = 30.0
"""After a subscription failed (not refused), how long a caller polls before trying
again: during an outage a re-sent event then waits for one connection, not two."""


class ReplyWatch:
    """Waits for the announcement of one reply.  This one hears none (``channel``
    is None: the worker is asked for no announcement) and only sleeps, so waiting
    on it is plain polling."""

    channel: str | None = None
    """Where the worker should announce the reply (:data:`~bso.wire.keys.REPLY_CHANNEL_HEADER`)."""

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True as soon as the reply was announced."""
        time.sleep(seconds)
        return False

    def missed(self) -> None:
        """The reply came unannounced although announcements were heard before: a
        watch on a subscription may renew it.  This one has none."""


class ReplyBackend(ABC):
    """A set of reply keys: workers store one reply per key, callers take it with a timeout.

    Subclasses provide :meth:`push`, :meth:`take` and :meth:`close`, and
    :meth:`watch` where they can hear announcements; :meth:`pop` waits on the
    one schedule all of them share.
    """

    def __init__(self, namespace: Namespace = SHARED) -> None:
        self.namespace = namespace
        """Where the replies of this caller live: its tenant's keys and channels, or
        the shared ones (:class:`bso.wire.keys.Namespace`)."""
        self.announcing = False
        """Whether this caller heard a reply announced before taking it, and has
        not found one unannounced since: then polls are only a safety net."""

    @abstractmethod
    def push(self, key: str, reply_json: str, ttl_s: int, announce_to: str | None = None) -> None:
        """Store ``reply_json`` at ``key`` (replacing any reply there) for ``ttl_s``
        seconds, and announce ``key`` on the channel ``announce_to``, if any."""

    @abstractmethod
    def take(self, key: str) -> str | None:
        """Take the reply at ``key`` now, deleting it; None if there is none (yet)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections, if any."""

    def watch(self, key: str) -> AbstractContextManager[ReplyWatch]:
        """Listen for the announcement of ``key``'s reply while the block runs.
        Enter it before sending the event, and send the event with the watch's
        ``channel``.  This default hears nothing (polling only)."""
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
                    watch.missed()
                return value
            delay = min(delay * POLL_GROWTH, POLL_CAP_S)
        return None


class RedisReplyBackend(ReplyBackend):
    """Reply keys in Redis: ``SET key value EX ttl`` (and ``PUBLISH`` of the key on the
    caller's channel) to store and announce, one ``SUBSCRIBE`` per caller to hear,
    ``GETDEL`` to take."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 5.0,
        client: redis.Redis | None = None,
        namespace: Namespace = SHARED,
    ) -> None:
        """Connect to ``url``, or use ``client`` (any redis-py compatible client) for it;
        a caller listens on a channel of ``namespace``."""
        super().__init__(namespace)
        self.url = url
        self.redis: redis.Redis = client or redis_client(url, connect_timeout_s=connect_timeout_s)
        self._inbox = _Inbox(self.redis, namespace)

    @property
    def may_subscribe(self) -> bool:
        """False once Redis refused this user a subscription: it then only polls."""
        return self._inbox.allowed

    def push(self, key: str, reply_json: str, ttl_s: int, announce_to: str | None = None) -> None:
        try:
            if announce_to is None:
                self.redis.set(key, reply_json, ex=ttl_s)
                return
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(key, reply_json, ex=ttl_s)
                pipe.publish(announce_to, key)
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
        inbox = self._inbox
        if not inbox.subscribed():
            yield ReplyWatch()
            return
        inbox.expect(key)
        try:
            yield _InboxWatch(inbox, key)
        finally:
            inbox.forget(key)

    def close(self) -> None:
        self._inbox.close()
        self.redis.close()


class _Inbox:
    """One caller's announcement channel: a subscriber connection shared by the waits
    of all its threads.  One wait at a time reads the connection and hands every
    announced key to the wait that expects it.

    A forked child starts an inbox of its own (another channel; the parent's
    connection is left to the parent).  A subscription that fails for any reason
    other than a refusal is tried again after :data:`SUBSCRIBE_RETRY_S`, so an
    outage does not make every re-send wait for a connection too.
    """

    def __init__(self, client: redis.Redis, namespace: Namespace) -> None:
        self.allowed = True
        """False once Redis refused the subscription (an ACL without SUBSCRIBE, or
        a proxy that has no pub/sub)."""
        self._client = client
        self._namespace = namespace
        self._closed = False
        self._start()

    def _start(self) -> None:
        token = secrets.token_hex(ANNOUNCE_TOKEN_LENGTH // 2)
        self.channel = self._namespace.announce_channel(token)
        self._pid = os.getpid()
        self._pubsub: PubSub | None = None
        self._retry_at = 0.0
        self._expected: Counter[str] = Counter()
        self._heard: set[str] = set()
        self._changed = threading.Condition()
        self._reading = False

    def _own(self) -> None:
        """In a forked child, forget the parent's subscription and lock (the parent
        still uses them) and start afresh."""
        if self._pid != os.getpid():
            self._start()

    def subscribed(self) -> bool:
        """Subscribe once, waiting for Redis to confirm it (so that no announcement
        can come before); False where this user may not, after :meth:`close`, or
        while Redis cannot be reached (the takes report the outage)."""
        self._own()
        with self._changed:
            if self._pubsub is not None:
                return True
            if not self.allowed or self._closed or time.monotonic() < self._retry_at:
                return False
            pubsub = self._client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]
            try:
                pubsub.subscribe(self.channel)
                deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
                while (remaining := deadline - time.monotonic()) > 0:
                    message = pubsub.get_message(timeout=remaining)
                    if message is not None and message["type"] == "subscribe":
                        self._pubsub = pubsub
                        return True
            except redis.ResponseError as exc:  # NOPERM, or no pub/sub at all
                self.allowed = not isinstance(exc, redis.exceptions.NoPermissionError) and (
                    "unknown command" not in str(exc).lower()
                )
            except redis.RedisError:
                pass
            self._retry_at = time.monotonic() + SUBSCRIBE_RETRY_S
            pubsub.close()
            return False

    def expect(self, key: str) -> None:
        self._own()
        with self._changed:
            self._expected[key] += 1

    def forget(self, key: str) -> None:
        self._own()
        with self._changed:
            self._expected[key] -= 1
            if self._expected[key] <= 0:
                del self._expected[key]
                self._heard.discard(key)

    def wait(self, key: str, deadline: float) -> bool | None:
        """Until ``deadline`` (``time.monotonic()``): True once ``key`` was announced,
        False at the deadline, None if the subscription broke meanwhile."""
        while True:
            with self._changed:
                while True:
                    if key in self._heard:
                        self._heard.discard(key)
                        return True
                    if self._pubsub is None:
                        return None
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    if not self._reading:
                        self._reading = True
                        pubsub = self._pubsub
                        break
                    self._changed.wait(remaining)
            self._read(pubsub, remaining)

    def _read(self, pubsub: PubSub, timeout: float) -> None:
        """Read at most one message for up to ``timeout``, as the one reader.  Whatever
        goes wrong (an outage, a closed connection, Ctrl-C), the reader's turn ends
        and a failed subscription is given up, so no wait is ever left unread."""
        heard: str | None = None
        refused = False
        healthy = False
        try:
            message = pubsub.get_message(timeout=timeout)
            healthy = True
        except redis.exceptions.NoPermissionError:  # the ACL changed under us
            refused = True
        except Exception:  # lost, or closed under the read: the takes report outages
            pass
        else:
            if self._announces(message):
                assert message is not None
                heard = decoded(message["data"])
        finally:
            with self._changed:
                self._reading = False
                if heard is not None and heard in self._expected:
                    self._heard.add(heard)
                if not healthy:
                    self.allowed = self.allowed and not refused
                    self._drop(pubsub)
                self._changed.notify_all()

    def _announces(self, message: dict[str, object] | None) -> bool:
        """Whether ``message`` is an announcement on this channel (not a subscription's
        confirmation, which redis-py also hands out, after a reconnect too)."""
        return (
            message is not None
            and message["type"] == "message"
            and decoded(message["channel"]) == self.channel
        )

    def renew(self) -> None:
        """Give up the subscription; the next watch subscribes anew.  For one that looks
        alive but no longer hears (a half-open connection behind a NAT that timed it out)."""
        self._own()
        with self._changed:
            self._drop(self._pubsub)

    def _drop(self, pubsub: PubSub | None) -> None:
        """Close ``pubsub`` and stop using it if it is the current one (under the lock)."""
        if pubsub is not None and pubsub is self._pubsub:
            self._pubsub = None
            pubsub.close()

    def close(self) -> None:
        self._own()
        with self._changed:
            self._closed = True
            self._drop(self._pubsub)


class _InboxWatch(ReplyWatch):
    """One reply's wait on its caller's :class:`_Inbox`."""

    def __init__(self, inbox: _Inbox, key: str) -> None:
        self.channel = inbox.channel
        self._inbox = inbox
        self._key = key

    def wait(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        heard = self._inbox.wait(self._key, deadline)
        if heard is None and (remaining := deadline - time.monotonic()) > 0:
            time.sleep(remaining)  # no subscription any more: this wait is a poll's
        return bool(heard)

    def missed(self) -> None:
        self._inbox.renew()


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
    a push replaces the key's reply, sets its TTL and wakes the waits for it, a take
    returns and deletes it.

    Thread-safe.  TTLs run on ``clock`` so that tests can expire replies
    without sleeping (the waits in :meth:`pop` still run in real time).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._replies: dict[str, tuple[str, float]] = {}
        self._pushes: Counter[str] = Counter()
        self._changed = threading.Condition()

    def push(self, key: str, reply_json: str, ttl_s: int, announce_to: str | None = None) -> None:
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

    def wait_for_push(self, key: str, after: int, seconds: float) -> int:
        """The number of pushes to ``key`` so far, waiting up to ``seconds`` for it to
        exceed ``after``."""
        with self._changed:
            self._changed.wait_for(lambda: self._pushes[key] > after, seconds)
            return self._pushes[key]

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
    """Hears the pushes made to one key of a :class:`StubReplyBackend` after it began
    (in one process, no channel is needed)."""

    def __init__(self, backend: StubReplyBackend, key: str) -> None:
        self._backend = backend
        self._key = key
        self._heard = backend.wait_for_push(key, -1, 0)

    def wait(self, seconds: float) -> bool:
        pushes = self._backend.wait_for_push(self._key, self._heard, seconds)
        heard = pushes > self._heard
        self._heard = pushes
        return heard
