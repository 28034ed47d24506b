"""The reply path: where a worker leaves a reply and how a caller waits for it.

Both sides go through one small interface, :class:`ReplyBackend` (in the
manner of dramatiq's result backends), so the caller's wait / retry / timeout
logic is written once (in :mod:`bso_client.transport`) and runs unchanged on
Redis (:class:`RedisReplyBackend`) or in memory (:class:`StubReplyBackend`,
for tests and for code that wants the whole loop in one process).

A reply is one JSON document stored under a per-event string key
(:func:`bso.wire.keys.reply_key_for`) with ``SET key value EX ttl``, so it never
exists without its TTL; the caller polls the key with ``GETDEL``.  Polling
rather than a blocking pop (BLPOP on a list) because Redis 6.2 ACLs cannot
tell the keys of one command apart: a client allowed to BLPOP its reply lists
could also BLPOP (steal) the events queue, while GET/GETDEL cannot take from
a list.  The first poll comes at once (a reply usually lands within a few
ms), the next ones after waits that grow to :data:`POLL_CAP_S`; the schedule
is written once, in :meth:`ReplyBackend.pop`.

A broker that cannot be reached raises
:class:`~bso.wire.connection.BrokerUnreachable`, which the caller rides out by
sending the same event again (:mod:`bso_client.transport`).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import redis

from bso.wire.connection import OUTAGE_ERRORS, broker_error, redis_client

POLL_FIRST_S = 0.001
"""Wait before the second poll of a reply key (the first one is immediate)."""

POLL_GROWTH = 1.5
"""Each further wait is this much longer than the one before..."""

POLL_CAP_S = 0.05
"""...up to this: a reply that lands late is seen at most 50 ms after it lands,
and a caller waiting out a 10 s timeout costs Redis about 200 GETDELs."""


class ReplyBackend(ABC):
    """A set of reply keys: workers store one reply per key, callers take it with a timeout.

    Subclasses provide :meth:`push` and :meth:`take`; :meth:`pop` polls
    :meth:`take` on the one schedule all of them share.
    """

    @abstractmethod
    def push(self, key: str, reply_json: str, ttl_s: int) -> None:
        """Store ``reply_json`` at ``key`` (replacing any reply there) for ``ttl_s`` seconds."""

    @abstractmethod
    def take(self, key: str) -> str | None:
        """Take the reply at ``key`` now, deleting it; None if there is none (yet)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections, if any."""

    def pop(self, key: str, timeout_s: float, *, taken_once: bool = False) -> str | None:
        """Take the reply at ``key``, polling up to ``timeout_s``; None if none came.

        The first poll is immediate (skipped when ``taken_once``: the caller
        just polled, e.g. pipelined with its publish), then waits grow from
        :data:`POLL_FIRST_S` by :data:`POLL_GROWTH` up to :data:`POLL_CAP_S`.
        The last poll is made at the deadline.
        """
        deadline = time.monotonic() + timeout_s
        if not taken_once:
            value = self.take(key)
            if value is not None:
                return value
        delay = POLL_FIRST_S
        while (remaining := deadline - time.monotonic()) > 0:
            time.sleep(min(delay, remaining))
            value = self.take(key)
            if value is not None:
                return value
            delay = min(delay * POLL_GROWTH, POLL_CAP_S)
        return None


class RedisReplyBackend(ReplyBackend):
    """Reply keys in Redis: ``SET key value EX ttl`` to store, ``GETDEL`` to take."""

    def __init__(
        self, url: str, *, connect_timeout_s: float = 5.0, client: redis.Redis | None = None
    ) -> None:
        """Connect to ``url``, or use ``client`` (any redis-py compatible client) for it."""
        self.url = url
        self.redis: redis.Redis = client or redis_client(url, connect_timeout_s=connect_timeout_s)

    def push(self, key: str, reply_json: str, ttl_s: int) -> None:
        try:
            self.redis.set(key, reply_json, ex=ttl_s)
        except OUTAGE_ERRORS as exc:
            raise broker_error(self.url, exc) from exc

    def take(self, key: str) -> str | None:
        try:
            value = self.redis.getdel(key)
        except OUTAGE_ERRORS as exc:
            raise broker_error(self.url, exc) from exc
        return decoded(value)

    def close(self) -> None:
        self.redis.close()


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
    a push replaces the key's reply and sets its TTL, a take returns and deletes it.

    Thread-safe.  TTLs run on ``clock`` so that tests can expire replies
    without sleeping (the polling in :meth:`pop` still sleeps in real time).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._replies: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def push(self, key: str, reply_json: str, ttl_s: int) -> None:
        with self._lock:
            self._replies[key] = (reply_json, self._clock() + ttl_s)

    def take(self, key: str) -> str | None:
        with self._lock:
            value = self._live(key)
            self._replies.pop(key, None)
            return value

    def close(self) -> None:
        """Nothing to release: the replies are garbage like any other object."""

    def keys(self) -> list[str]:
        """Keys holding unexpired replies, sorted (what ``SCAN`` would show)."""
        with self._lock:
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
