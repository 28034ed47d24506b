"""A running worker node says so in Redis, so that a caller can tell "no worker" from "slow".

Without it, a training client whose event nobody consumes waits out every
retry (timeout x backoff, over a minute) before it learns anything, and then
cannot say why.  With it, every node sets :data:`bso.wire.keys.WORKERS_ALIVE_KEY`
every :data:`~bso.wire.keys.WORKERS_ALIVE_REFRESH_S` seconds with a TTL of
:data:`~bso.wire.keys.WORKERS_ALIVE_TTL_S`; the client reads it once its event
has gone unanswered for a few seconds (``bso_client.worker_presence``).

The refresh runs on a daemon thread of its own, not on a timer of Celery's
event loop: a solo node runs each event inside that loop, so an event that
takes 20 s would stop the timer and the node would look gone to every caller
while it works.  The thread runs beside the task.  (A node stuck for good is
the hard time limit's business; see ``bso_workers.limits``.)

Nothing here runs at import; ``bso_workers.app`` starts a beacon when the
node is ready and stops it when the node shuts down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime

import redis

from bso.wire import keys
from bso.wire.connection import redact_url, redis_client
from bso_workers.tenant_queues import tenant_names

log = logging.getLogger(__name__)


class PresenceBeacon:
    """Sets :data:`~bso.wire.keys.WORKERS_ALIVE_KEY` from a daemon thread until stopped.

    A failed refresh (Redis restarting, a network blip) is logged once and tried
    again at the next interval: the node itself goes on consuming as soon as
    kombu reconnects, and the key comes back with the next refresh after that.
    """

    def __init__(
        self,
        broker_url: str,
        node: str,
        *,
        interval_s: float = keys.WORKERS_ALIVE_REFRESH_S,
        ttl_s: int = keys.WORKERS_ALIVE_TTL_S,
        connect: Callable[[str], redis.Redis] = redis_client,
    ) -> None:
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"need 0 < interval_s < ttl_s, got {interval_s} and {ttl_s}")
        self.broker_url = broker_url
        self.node = node
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._connect = connect
        self._redis: redis.Redis | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> None:
        """Announce now, then every ``interval_s`` on a daemon thread (again: a no-op)."""
        if self._thread is not None:
            return
        self.announce()
        self._thread = threading.Thread(target=self._run, name="bso-presence", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop refreshing (the key then expires unless another node refreshes it)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
            self._thread = None
        if self._redis is not None:
            self._redis.close()
            self._redis = None

    def announce(self) -> bool:
        """Set the key once; whether Redis took it."""
        value = f"{self.node} {datetime.now(UTC).isoformat(timespec='seconds')}"
        try:
            if self._redis is None:
                self._redis = self._connect(self.broker_url)
            tenants = tenant_names(self._redis.smembers(keys.TENANTS_KEY))
            with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(keys.WORKERS_ALIVE_KEY, value, ex=self.ttl_s)
                for tenant in sorted(tenants):  # each tenant's own copy (Namespace.alive_key)
                    pipe.set(keys.tenant_namespace(tenant).alive_key, value, ex=self.ttl_s)
                pipe.execute()
        except (redis.RedisError, OSError) as exc:
            if not self._failing:
                log.warning(
                    "cannot announce worker %s at %s: %s (trying again every %g s)",
                    self.node,
                    redact_url(self.broker_url),
                    exc,
                    self.interval_s,
                )
            self._failing = True
            return False
        if self._failing:
            log.info("worker %s announced again at %s", self.node, redact_url(self.broker_url))
        self._failing = False
        return True

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.announce()
