"""One clock for every worker node: Redis's, carried forward on each process's own
monotonic clock.

A trial's lease is a duration measured between two wall-clock readings taken on
different machines: the worker that handled the run's last heartbeat writes
``updated_at``, and the worker that runs the sweep compares it with its own
now.  Were each reading the local clock, a node whose clock is two minutes
behind the sweeper's would write heartbeats that look two minutes old at once,
and every trial it served would be ended as ``heartbeat_timeout`` while its run
trained: three of those in a row and a size is ruled out, until no size is
left.  A worker VM restored from a snapshot, its clock hours behind until NTP
steps it, does the same.

So the service's clock on a worker node is :class:`SharedClock`: the Redis
server's ``TIME``, read at most once a minute (:data:`RESYNC_S`) and carried
forward between reads on ``time.monotonic``, which no step of the local clock
moves.  Every node reads the same server, so their readings agree to within a
round trip; a node's own clock may be anything.  A step of the Redis host's
clock moves every node alike within a minute.  While Redis cannot be read
(every event then fails anyway) the last reading is carried forward; a
process that never read it uses its own clock, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import redis

log = logging.getLogger(__name__)

RESYNC_S = 60.0
"""How long a reading of Redis's clock is carried forward before it is read again:
a monotonic clock drifts by microseconds over a minute."""

ServerTime = Callable[[], tuple[int, int]]
"""Redis's ``TIME``: (seconds, microseconds) since the epoch, on the server's clock."""


class SharedClock:
    """UTC now on Redis's clock (see the module); a drop-in for ``BsoService.clock``."""

    def __init__(
        self,
        server_time: ServerTime,
        *,
        resync_s: float = RESYNC_S,
        monotonic: Callable[[], float] = time.monotonic,
        local_now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._server_time = server_time
        self._resync_s = resync_s
        self._monotonic = monotonic
        self._local_now = local_now
        self._lock = threading.Lock()
        self._base: tuple[datetime, float] | None = None
        """(Redis's time at the last reading, this process's monotonic time then)."""
        self._failing = False

    def __call__(self) -> datetime:
        with self._lock:
            mono = self._monotonic()
            if self._base is None or mono - self._base[1] >= self._resync_s:
                self._read(mono)
            if self._base is None:  # never read: this machine's own clock
                return self._local_now()
            at, read_at = self._base
            return at + timedelta(seconds=mono - read_at)

    def _read(self, mono: float) -> None:
        try:
            seconds, micros = self._server_time()
        except (redis.RedisError, OSError) as err:
            if not self._failing:
                log.warning(
                    "cannot read the Redis server's clock (%s: %s); carrying the last reading "
                    "forward",
                    type(err).__name__,
                    err,
                )
            self._failing = True
            return
        self._failing = False
        at = datetime.fromtimestamp(int(seconds), UTC) + timedelta(microseconds=int(micros))
        self._base = (at, mono)


def redis_clock(broker_url: str) -> Callable[[], datetime]:
    """The shared clock of the Redis at ``broker_url``; a broker that is not Redis
    (tests' ``memory://``) leaves each process its own clock."""
    if not broker_url.startswith(("redis://", "rediss://", "unix://")):
        return lambda: datetime.now(UTC)
    client = redis.Redis.from_url(broker_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    return SharedClock(lambda: _time_of(client))


def _time_of(client: redis.Redis) -> tuple[int, int]:
    seconds, micros = client.time()
    return int(seconds), int(micros)
