"""The reply path: where a worker leaves a reply and how a caller waits for it.

Both sides go through one small interface, :class:`ReplyBackend` (in the
manner of dramatiq's result backends), so the caller's wait / retry / timeout
logic is written once (in :mod:`bso_client.transport`) and runs unchanged on
Redis (:class:`RedisReplyBackend`) or in memory (:class:`StubReplyBackend`,
for tests and for code that wants the whole loop in one process).

A reply is one JSON document stored under a per-event string key
(:func:`bso.keys.reply_key_for`) with ``SET key value EX ttl``, so it never
exists without its TTL; the caller polls the key with ``GETDEL``.  Polling
rather than a blocking pop (BLPOP on a list) because Redis 6.2 ACLs cannot
tell the keys of one command apart: a client allowed to BLPOP its reply lists
could also BLPOP (steal) the events queue, while GET/GETDEL cannot take from
a list.  The first poll comes at once (a reply usually lands within a few
ms), the next ones after waits that grow to :data:`POLL_CAP_S`; the schedule
is written once, in :meth:`ReplyBackend.pop`.

A broker that cannot be reached (refused or reset connection, timeout, Redis
still loading its append-only file, a read-only replica) raises
:class:`BrokerUnreachable`, which the caller rides out by sending the same
event again (:mod:`bso_client.transport`).

This module also holds the wire models of the read-only status query, the one
request/reply pair that is not a job event of :mod:`bso.events`.
"""

from __future__ import annotations

import ssl
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal
from urllib.parse import unquote_plus, urlsplit, urlunsplit

import redis
from pydantic import BaseModel, ConfigDict, Field
from redis.backoff import NoBackoff
from redis.retry import Retry

from bso.errors import ServiceUnavailable
from bso.events import EventId, JobId, new_event_id
from bso.status import JobStatus


class StatusQuery(BaseModel):
    """Ask for a job's status (what it learned, its current recommendation)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    event_id: EventId = Field(default_factory=new_event_id)
    kind: Literal["status"] = "status"
    job_id: JobId


class StatusReply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    event_id: str
    kind: Literal["status"] = "status"
    status: JobStatus


POLL_FIRST_S = 0.001
"""Wait before the second poll of a reply key (the first one is immediate)."""

POLL_GROWTH = 1.5
"""Each further wait is this much longer than the one before..."""

POLL_CAP_S = 0.05
"""...up to this: a reply that lands late is seen at most 50 ms after it lands,
and a caller waiting out a 10 s timeout costs Redis about 200 GETDELs."""


class BrokerUnreachable(ServiceUnavailable):
    """Redis could not be reached or cannot serve now: the caller may send again.

    Raised for a refused, reset or timed-out connection, for Redis still
    loading its append-only file after a restart, and for a read-only replica
    (a failover in progress).  Not for refused credentials or a command the
    ACL denies, nor for a TLS certificate that fails verification: those do
    not go away by waiting.
    """


def broker_error(url: str, exc: Exception) -> ServiceUnavailable:
    """The error to raise for ``exc``, a Redis or socket error talking to ``url``.

    :class:`BrokerUnreachable` for what an outage looks like, a plain
    :class:`ServiceUnavailable` for what waiting does not cure.  The message
    names the URL with its password masked.
    """
    where = redact_url(url)
    if _caused_by(exc, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
        return ServiceUnavailable(f"Redis at {where} refused the client's credentials: {exc}")
    if _caused_by(exc, redis.exceptions.NoPermissionError):
        return ServiceUnavailable(f"Redis at {where} denied a command to this user: {exc}")
    if _caused_by(exc, ssl.SSLCertVerificationError):
        return ServiceUnavailable(f"Redis at {where} presented a certificate that failed: {exc}")
    return BrokerUnreachable(
        f"cannot reach the bso broker at {where}: {exc} "
        "(is the service running? `bso up` starts one)"
    )


def _caused_by(
    exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]
) -> bool:
    """Whether ``exc`` or an exception it was raised from or during is a ``kind``
    (redis-py wraps socket and TLS errors in its ``ConnectionError``, kombu
    wraps redis-py's errors in its ``OperationalError``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


OUTAGE_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ReadOnlyError,
    redis.exceptions.NoPermissionError,
    OSError,
)
"""What a Redis call may raise when the broker is away (or denies the call);
:func:`broker_error` sorts them.  ``BusyLoadingError`` is a ``ConnectionError``."""


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


def redact_url(url: str) -> str:
    """``url`` with its secrets replaced, fit for error messages and logs.

    Both places a URL can carry a password are redacted: the user info
    (``redis://user:pw@host``) and the query, which redis-py and libpq also read
    a password from (``redis://host/0?password=pw``); a query parameter whose
    name mentions a password, secret, token or key has its value replaced, the
    rest is kept as written.  A URL that does not even parse is not shown at all.
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<a URL that does not parse, not shown>"
    netloc = parts.netloc
    if password is not None:
        netloc = netloc.replace(f":{password}@", ":***@", 1)
    params = parts.query.split("&") if parts.query else []
    for i, param in enumerate(params):
        name, sep, _ = param.partition("=")
        lowered = unquote_plus(name).lower()
        if sep and any(word in lowered for word in ("pass", "pwd", "secret", "token", "key")):
            params[i] = f"{name}=***"
    query = "&".join(params)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def redis_client(url: str, *, connect_timeout_s: float = 5.0) -> redis.Redis:
    """A connection to ``url`` for the reply path: decoded replies, no hidden retries.

    redis-py retries a failed command up to 10 times by default; here it does
    not, so that an outage reaches the one retry loop that handles it
    (``ServiceClient``) at once.  (A pooled connection that died with a
    restarted server is still replaced silently: the pool checks it before
    use.)  Every command is short (no blocking pops), so a read timeout of
    ``connect_timeout_s`` as well turns a hung server into an error, not a hang.
    """
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


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
