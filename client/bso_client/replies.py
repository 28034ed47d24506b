"""The reply path: where a worker leaves a reply and how a caller waits for it.

Both sides go through one small interface, :class:`ReplyBackend` (in the
manner of dramatiq's result backends), so the caller's wait / retry / timeout
logic is written once (in :mod:`bso_client.transport`) and runs unchanged on
Redis (:class:`RedisReplyBackend`) or in memory (:class:`StubReplyBackend`,
for tests and for code that wants the whole loop in one process).

A reply is one JSON document pushed onto a per-event list key
(:func:`bso.keys.reply_key_for`) that expires after a TTL; the caller pops it
with a blocking read, so it wakes up the moment the worker pushes, with no
polling and no sleep.

This module also holds the wire models of the read-only status query, the one
request/reply pair that is not a job event of :mod:`bso.events`.
"""

from __future__ import annotations

import socket
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import redis
from pydantic import BaseModel, ConfigDict, Field

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


class ReplyBackend(ABC):
    """A set of reply lists: workers push onto them, callers pop with a timeout."""

    @abstractmethod
    def push(self, key: str, reply_json: str, ttl_s: int) -> None:
        """Add ``reply_json`` to ``key``; the list expires ``ttl_s`` after this push."""

    @abstractmethod
    def pop(self, key: str, timeout_s: float) -> str | None:
        """Take a reply from ``key``, waiting up to ``timeout_s``; None if none came."""

    @abstractmethod
    def close(self) -> None:
        """Release connections, if any."""


def redact_url(url: str) -> str:
    """``url`` with its password replaced, fit for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _keepalive_options() -> dict[int, int]:
    """Probe an idle connection after 10 s, so a vanished Redis host is noticed in
    about half a minute even while a BLPOP without socket timeout is waiting."""
    names = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}
    return {getattr(socket, n): v for n, v in names.items() if hasattr(socket, n)}


class RedisReplyBackend(ReplyBackend):
    """Reply lists in Redis: LPUSH + EXPIRE in one MULTI, BLPOP to wait.

    The connection has no socket read timeout (BLPOP's own timeout bounds the
    wait; a read timeout shorter than it would break the call) but TCP
    keepalive, so a dead server still surfaces as an error.
    """

    def __init__(
        self, url: str, *, connect_timeout_s: float = 5.0, client: redis.Redis | None = None
    ) -> None:
        """Connect to ``url``, or use ``client`` (any redis-py compatible client) for it."""
        self.url = url
        self.redis: redis.Redis = client or redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=None,
            socket_keepalive=True,
            socket_keepalive_options=_keepalive_options(),
            health_check_interval=30,
        )

    def push(self, key: str, reply_json: str, ttl_s: int) -> None:
        try:
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.lpush(key, reply_json)
                pipe.expire(key, ttl_s)
                pipe.execute()
        except redis.ConnectionError as exc:
            raise self._unavailable(exc) from exc

    def pop(self, key: str, timeout_s: float) -> str | None:
        # BLPOP treats 0 as "forever"; a caller asking for no wait gets the shortest one.
        try:
            item = self.redis.blpop([key], timeout=max(timeout_s, 0.001))
        except redis.ConnectionError as exc:
            raise self._unavailable(exc) from exc
        if item is None:
            return None
        _, value = item
        assert isinstance(value, str)
        return value

    def _unavailable(self, exc: Exception) -> ServiceUnavailable:
        return ServiceUnavailable(f"cannot reach Redis at {redact_url(self.url)}: {exc}")

    def close(self) -> None:
        self.redis.close()


class StubReplyBackend(ReplyBackend):
    """Reply lists in this process's memory, with the same semantics as Redis.

    Thread-safe; a waiting :meth:`pop` wakes on the matching push.  TTLs run on
    ``clock`` so that tests can expire replies without sleeping.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lists: dict[str, tuple[deque[str], float]] = {}
        self._changed = threading.Condition()

    def push(self, key: str, reply_json: str, ttl_s: int) -> None:
        with self._changed:
            items = self._live(key) or deque()
            items.appendleft(reply_json)
            self._lists[key] = (items, self._clock() + ttl_s)
            self._changed.notify_all()

    def pop(self, key: str, timeout_s: float) -> str | None:
        with self._changed:
            if not self._changed.wait_for(lambda: bool(self._live(key)), timeout=timeout_s):
                return None
            items = self._live(key)
            assert items
            value = items.popleft()
            if not items:
                del self._lists[key]
            return value

    def close(self) -> None:
        """Nothing to release: the lists are garbage like any other object."""

    def keys(self) -> list[str]:
        """Keys holding unexpired replies, sorted (what ``SCAN`` would show)."""
        with self._changed:
            return sorted(k for k in list(self._lists) if self._live(k))

    def _live(self, key: str) -> deque[str] | None:
        entry = self._lists.get(key)
        if entry is None:
            return None
        items, expires_at = entry
        if self._clock() >= expires_at:
            del self._lists[key]
            return None
        return items
