"""The workers' side of a tenant's admission limits: what went around its door.

A tenant's client pushes through its door (:mod:`bso.wire.admission`), which
keeps the tenant's queue within its ``max_queue``.  Redis cannot stop the
tenant's user from pushing onto its queue directly (or from deleting its copy of
its limits), so a worker checks, for every event it pops from a tenant's queue,
how many are still waiting, against the limits no tenant can touch
(:data:`bso.wire.keys.TENANT_LIMITS_KEY`): the door never lets a queue reach its
bound, so a queue at or past it was filled around the door.  Such an event is
answered :class:`~bso.errors.RateLimited` at once, before any database work,
and counted with the door's refusals: a flood pushed around the door costs the
workers a Redis round trip per item, and the rotation
(:mod:`bso_workers.tenant_queues`) keeps it from delaying any other tenant.  The
rate is the door's alone: workers that were down take a tenant's honest backlog
faster than it was admitted, and must not refuse it.
"""

from __future__ import annotations

import logging

import redis

from bso.apikeys import TenantLimits
from bso.errors import RateLimited
from bso.wire import keys
from bso.wire.keys import Namespace

log = logging.getLogger("bso.queue_bounds")


class QueueBounds:
    """Checks a tenant's queue against its limits, for one worker process."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def refusal(self, namespace: Namespace) -> RateLimited | None:
        """The refusal of an event just popped from ``namespace``'s queue, if that queue
        is at or past its bound; None otherwise, for the shared queue, and when Redis
        cannot tell (the event is then handled: a bound is no reason to lose one)."""
        if namespace.tenant is None:
            return None
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.hget(keys.TENANT_LIMITS_KEY, namespace.tenant)
                pipe.llen(namespace.queue_key)
                limits, waiting = pipe.execute()
            bound = TenantLimits.decoded(limits)
            if int(waiting) < bound.max_queue:
                return None
            self.redis.hincrby(keys.TENANT_REFUSED_KEY, namespace.tenant, 1)
        except (redis.RedisError, OSError) as exc:
            log.warning("cannot check a tenant's queue", extra={"error": type(exc).__name__})
            return None
        return RateLimited(
            f"tenant {namespace.tenant}'s queue holds {waiting} events, at or past its bound "
            f"of {bound.max_queue}: events pushed around the door (bso.wire.admission) are "
            "refused unapplied; use the bso client, which waits at the door"
        )
