"""The door of a tenant's queue: a Lua script that admits an event or refuses it.

A tenant's client does not push onto its queue directly: it runs :data:`DOOR_SCRIPT`
(``EVALSHA``, one round trip, atomic in Redis), which pushes the message only
while the queue holds fewer than ``max_queue`` events and the tenant sent fewer
than ``per_second x`` :data:`~bso.apikeys.ADMISSION_WINDOW_S` events in the last
window (a sliding log of admission times).  Otherwise nothing is queued, the
refusal is logged for the workers to count, and the client raises
:class:`~bso.errors.RateLimited` with the wait until the door admits again: an
event is refused at the door, never accepted and then dropped.

The limits come from the tenant's limits key (:attr:`bso.wire.keys.Namespace.limits_key`),
which ``bso keys`` writes from the store; without one the defaults that the
client passes apply.

The door binds the clients that use it.  Redis has no ACL that lets a user run a
script and not the commands in it, so a tenant's user may also ``LPUSH`` onto its
queue directly, or delete its copy of its limits: it then escapes its rate, not
its queue's bound, which the workers hold from a copy no tenant can touch
(:data:`bso.wire.keys.TENANT_LIMITS_KEY`, ``bso_workers.queue_bounds``); and the
rotation keeps it from delaying any other tenant.  The user may run ``EVALSHA`` but neither ``EVAL``
nor ``SCRIPT``: it can run only scripts the workers loaded (they load this one,
:mod:`bso_workers.tenant_queues`), never a loop of its own that would stall Redis.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

from bso.apikeys import ADMISSION_WINDOW_S, DEFAULT_MAX_QUEUE, DEFAULT_PER_SECOND
from bso.errors import RateLimited
from bso.wire import keys
from bso.wire.keys import Namespace

QUEUE_FULL_RETRY_S: Final = 1.0
"""What a refusal for a full queue tells the client to wait: the queue's own events
drain in about that long on two workers (the default bound of a thousand)."""

DOOR_SCRIPT: Final = f"""
local limits = redis.pcall('GET', KEYS[3])
local max_queue, per_second = tonumber(ARGV[2]), tonumber(ARGV[3])
if type(limits) == 'string' then
  local q, r = string.match(limits, '^(%d+) (%d+)$')
  if q then max_queue, per_second = tonumber(q), tonumber(r) end
end
local function refuse(why, mark, retry_ms)
  redis.pcall('LPUSH', KEYS[4], mark)
  redis.pcall('LTRIM', KEYS[4], 0, {keys.REFUSALS_KEPT - 1})
  return {{0, why, retry_ms}}
end
if redis.call('LLEN', KEYS[1]) >= max_queue then
  return refuse('queue_full', 'q', {int(QUEUE_FULL_RETRY_S * 1000)})
end
local window_ms = {ADMISSION_WINDOW_S * 1000}
local burst = per_second * {ADMISSION_WINDOW_S}
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local newest = tonumber(redis.pcall('LINDEX', KEYS[2], 0))
if newest and newest > now then
  redis.call('LTRIM', KEYS[2], 1, 0)
end
local oldest = tonumber(redis.pcall('LINDEX', KEYS[2], burst - 1))
if oldest and now - oldest < window_ms then
  return refuse('rate', 'r', window_ms - (now - oldest))
end
redis.call('LPUSH', KEYS[2], now)
redis.call('LTRIM', KEYS[2], 0, burst - 1)
redis.call('LPUSH', KEYS[1], ARGV[1])
return {{1, 'admitted', 0}}
"""
"""KEYS: the queue, the admission log, the limits, the refusal list; ARGV: the
message, the default ``max_queue`` and ``per_second``.  Returns ``{admitted (1/0),
why, retry after (ms)}``.

A logged time later than Redis's ``TIME`` means its clock stepped back (NTP
correcting a clock that ran ahead, a VM restored from a snapshot): measured
against such times the window would stay full for as long as the step, and
every event of the tenant be refused for an hour after a step of an hour.  The
log is dropped then, and starts again from now: at most one window's burst
more is admitted, once."""

DOOR_SHA: Final = hashlib.sha1(DOOR_SCRIPT.encode(), usedforsecurity=False).hexdigest()
"""What a client sends to ``EVALSHA``: the script's SHA-1, Redis's name for it."""


def door_keys(namespace: Namespace) -> list[str]:
    """The keys the door reads and writes for ``namespace`` (a tenant's)."""
    return [
        namespace.queue_key,
        namespace.admitted_key,
        namespace.limits_key,
        namespace.refusals_key,
    ]


def door_args(message: str) -> list[str | int]:
    """The script's arguments for ``message``: it, then the default limits."""
    return [message, DEFAULT_MAX_QUEUE, DEFAULT_PER_SECOND]


def refusal(result: object, namespace: Namespace) -> RateLimited | None:
    """The error for a door's answer that refused the event; None when it was admitted."""
    if not (isinstance(result, Sequence) and len(result) == 3 and result[0] == 0):
        return None
    why = result[1].decode() if isinstance(result[1], bytes) else str(result[1])
    retry_after_s = max(0.001, int(result[2]) / 1000)
    what = (
        "its queue is full"
        if why == "queue_full"
        else f"it sent more events than its rate allows over {ADMISSION_WINDOW_S} s"
    )
    return RateLimited(
        f"tenant {namespace.tenant}'s event was refused at the door, not queued: {what} "
        f"(the operator's `bso keys limits` sets them); send it again in {retry_after_s:.3g} s",
        retry_after_s,
    )
