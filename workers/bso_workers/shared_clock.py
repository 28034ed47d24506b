"""One clock for every worker node: its own, corrected to Redis's where they disagree.

A trial's lease is a duration measured between two wall-clock readings taken on
different machines: the worker that handled the run's last heartbeat writes
``updated_at``, and the worker that runs the sweep compares it with its own
now.  Were each reading the local clock as it is, a node whose clock is two
minutes behind the sweeper's would write heartbeats that look two minutes old at
once, and every trial it served would be ended as ``heartbeat_timeout`` while its
run trained: three of those in a row and a size is ruled out, until no size is
left.  A worker VM restored from a snapshot, its clock hours behind until NTP
steps it, does the same.

So the service's clock on a worker node is :class:`SharedClock`: the node's own
clock, plus its offset from the Redis server's ``TIME`` when that offset is more
than :data:`TOLERANCE_S` (and until it is below :data:`AGREES_S`: no flipping at
the tolerance).  The offset is measured at most once a minute
(:data:`RESYNC_S`), against the midpoint of the round trip.  Every node reads the
same server, so a node whose clock is off by minutes is brought within a round
trip of the others, and a step of its clock is corrected within a minute.  Nodes
whose clocks agree with Redis within the tolerance (one host, or hosts kept by
NTP) keep their own clocks exactly: corrected by a round trip's error, nodes on
one host would disagree by milliseconds, and the order of their commits, which the
replies' timestamps keep (``bso.audit`` replays them in that order), would be lost.
While Redis cannot be read (every event then fails anyway) the last offset holds;
a process that never read it uses its own clock.
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
"""How long an offset from Redis's clock is used before it is measured again."""

TOLERANCE_S = 1.0
"""The offset from Redis's clock a node's own clock may have uncorrected: far below
the shortest lease (10 s), far above a round trip's error."""

AGREES_S = TOLERANCE_S / 10
"""A corrected node is left its own clock again only once its offset is this small:
a node whose offset hovers at the tolerance would otherwise flip between corrected
and not at every measure, its clock stepping back by a second at every other flip."""

ServerTime = Callable[[], tuple[int, int]]
"""Redis's ``TIME``: (seconds, microseconds) since the epoch, on the server's clock."""


class SharedClock:
    """UTC now, on one clock for every node (see the module); a drop-in for
    ``BsoService.clock``."""

    def __init__(
        self,
        server_time: ServerTime,
        *,
        resync_s: float = RESYNC_S,
        monotonic: Callable[[], float] = time.monotonic,
        local_now: Callable[[], datetime] = lambda: datetime.now(UTC),
        release: Callable[[], None] = lambda: None,
    ) -> None:
        """``release``: frees what ``server_time`` reads with (its Redis connection)."""
        self._server_time = server_time
        self._release = release
        self._resync_s = resync_s
        self._monotonic = monotonic
        self._local_now = local_now
        self._lock = threading.Lock()
        self._offset = timedelta(0)
        self._measured_at: float | None = None
        self._failing = False

    @property
    def offset(self) -> timedelta:
        """What is added to this node's clock: zero within the tolerance."""
        return self._offset

    def close(self) -> None:
        """Free the connection to the server (a later measure connects again)."""
        with self._lock:
            self._release()

    def __call__(self) -> datetime:
        with self._lock:
            mono = self._monotonic()
            if self._measured_at is None or mono - self._measured_at >= self._resync_s:
                self._measure(mono)
            return self._local_now() + self._offset

    def _measure(self, mono: float) -> None:
        before = self._local_now()
        try:
            seconds, micros = self._server_time()
        except (redis.RedisError, OSError) as err:
            if not self._failing:
                log.warning(
                    "cannot read the Redis server's clock (%s: %s); keeping this node's "
                    "offset from it, %.3f s",
                    type(err).__name__,
                    err,
                    self._offset.total_seconds(),
                )
            self._failing = True
            return
        after = self._local_now()
        self._failing = False
        self._measured_at = mono
        server = datetime.fromtimestamp(int(seconds), UTC) + timedelta(microseconds=int(micros))
        offset = server - (before + (after - before) / 2)
        corrected = self._offset != timedelta(0)
        if abs(offset.total_seconds()) <= (AGREES_S if corrected else TOLERANCE_S):
            self._offset = timedelta(0)
            return
        if abs((offset - self._offset).total_seconds()) > TOLERANCE_S:
            log.warning(
                "this node's clock is %.1f s %s the Redis server's; the service reads it "
                "corrected by that",
                abs(offset.total_seconds()),
                "behind" if offset > timedelta(0) else "ahead of",
            )
        self._offset = offset


def redis_clock(broker_url: str) -> Callable[[], datetime]:
    """The shared clock of the Redis at ``broker_url``; a broker that is not Redis
    (tests' ``memory://``) leaves each process its own clock."""
    if not broker_url.startswith(("redis://", "rediss://", "unix://")):
        return lambda: datetime.now(UTC)
    client = redis.Redis.from_url(broker_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    return SharedClock(lambda: _time_of(client), release=client.close)


def _time_of(client: redis.Redis) -> tuple[int, int]:
    seconds, micros = client.time()
    return int(seconds), int(micros)
