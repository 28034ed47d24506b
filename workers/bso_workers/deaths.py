"""How many times each event's worker died with it: the guard against poison events.

A message is acknowledged only after its task ran (``acks_late``), so an event
whose task ends its process (the hard time limit, the OOM killer, a crashing
driver) is delivered again, and would be forever: Zeus's "a crashed run is
retried forever", one level down, costing a worker per round.  kombu marks
every message it puts back on the queue as redelivered; only for those does a
worker count, per event id in Redis (so that copies a caller re-sent add up),
and from ``BSO_MAX_WORKER_DEATHS`` on it answers ``poison_event`` instead of
running the event again.  First deliveries cost nothing.

A count may include a delivery whose worker did not die but lost it otherwise
(shut down or disconnected while holding it unstarted); the limit leaves room
for that.
"""

from __future__ import annotations

import redis

from bso.wire import keys


class RedisDeathCounter:
    """Death counts in the broker's Redis, each kept :data:`bso.wire.keys.DEATHS_TTL_S`."""

    def __init__(self, url: str, *, client: redis.Redis | None = None) -> None:
        self.redis = client if client is not None else redis.Redis.from_url(url)
        self._owned = client is None

    def record(self, event_id: str, tenant: str | None = None) -> int:
        """Count one more death of ``event_id``'s worker (an event of ``tenant``'s queue,
        None: the shared one); returns the count so far."""
        key = keys.deaths_key(event_id, tenant)
        pipe = self.redis.pipeline()
        pipe.incr(key)
        pipe.expire(key, keys.DEATHS_TTL_S)
        count, _ = pipe.execute()
        return int(count)

    def close(self) -> None:
        if self._owned:
            self.redis.close()
