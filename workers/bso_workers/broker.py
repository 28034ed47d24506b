"""kombu's Redis transport with one Redis client per channel instead of one per command.

kombu 5's Redis channel builds a new :class:`redis.Redis` object for every
synchronous command group it sends (``conn_or_acquire``): with ``acks_late``
that is twice per task (recording the message as unacked on delivery, and
removing it on the ack).  The connections come from the channel's pool either
way; what is new each time is the client object, and redis-py's constructor
fills a table of ~170 response callbacks.  On the 2-core dev machine that was
the largest single item in the worker node's profile.

This channel builds that client once and reuses it.  A :class:`redis.Redis`
holds no per-call state (each command or pipeline takes a connection from the
pool), so sharing it is what any redis-py program does.  It is dropped
whenever kombu drops its pools (after a fork, on a failed connect, on close),
so it never outlives the pool it draws from.

Wire behaviour, key names and the unacked / visibility-timeout bookkeeping are
kombu's own, unchanged.  Selected in :func:`bso_workers.app.celery_config` via
``broker_transport`` for ``redis://`` broker URLs only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import redis as kombu_redis

TRANSPORT = "bso_workers.broker:Transport"
"""``broker_transport`` value that selects this transport."""


class Channel(kombu_redis.Channel):
    _sync_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        if self._sync_client is None:
            self._sync_client = self._create_client()  # type: ignore[attr-defined]
        yield self._sync_client

    def _disconnect_pools(self) -> None:
        self._sync_client = None
        super()._disconnect_pools()  # type: ignore[misc]


class Transport(kombu_redis.Transport):
    Channel = Channel
