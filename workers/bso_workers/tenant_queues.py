"""Every worker node serves every tenant's events queue, in rotation.

Each tenant publishes onto a queue of its own (:class:`bso.wire.keys.Namespace`), so
that one tenant's backlog is not every tenant's.  A node consumes the shared events
queue, the maintenance queue and the queue of each tenant in
:data:`bso.wire.keys.TENANTS_KEY`; this consumer step reads that set from the
event loop's timer every :data:`REFRESH_S` seconds and starts (or stops) consuming
the difference, so that a team whose key ``bso keys create`` just made is served
within seconds, by nodes already running.  It also loads the tenants' door script
(:mod:`bso.wire.admission`) each time (Redis forgets scripts when it restarts),
counts the doors' refusals, and deletes any queue key that is not a list before
consuming it (:func:`clear_spoiled_queues`).

The set lives in Redis only, and the store is the truth it is made from
(:func:`bso_workers.tenant_users.serve_tenants`, which ``bso up`` runs at start).
A Redis that lost its keys (restarted without persistence, its append-only file
lost, a key evicted under ``maxmemory``) has no set: the nodes used to read that
as "no tenant", cancelled every tenant's queue, and every team's runs were told
that no worker ran, until someone ran ``bso keys sync`` or restarted the service.
A node that finds the set missing now rebuilds it from the store first (with the
tenants' limits), with one WARNING (:meth:`TenantQueues.refresh`).

The rotation is kombu's own: its Redis transport pops with one ``BRPOP`` over all
of a node's queues and moves the queue it was served from to the end of the list
(its ``round_robin`` cycle), and a node takes one message at a time (prefetch 1).
So under any backlog, an event waits for at most one event of each other queue
with work per node, not for the whole backlog ahead of it
(``tests/test_tenant_queues.py``; ``scripts/bench_flood.py`` measures it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import redis

from bso.ids import is_tenant
from bso.wire import keys
from bso.wire.admission import DOOR_SCRIPT

REFRESH_S = 2.0
"""How often a node looks for tenants added or removed."""

log = logging.getLogger("bso.tenant_queues")


def tenant_names(members: Iterable[bytes | str]) -> set[str]:
    """The tenants in ``members`` (the set's raw members); a member that is not a
    tenant's name is skipped, never served."""
    names = set()
    for member in members:
        name = member.decode("utf-8", "replace") if isinstance(member, bytes) else member
        if is_tenant(name):
            names.add(name)
        else:
            log.warning("skipped a member of the tenants set that is no tenant's name")
    return names


def clear_spoiled_queues(client: redis.Redis, tenants: Iterable[str]) -> list[str]:
    """Delete every queue key of bso's that holds something other than a list; the keys
    deleted.  One such key makes the BRPOP over all of a node's queues fail, and the
    node stop: no user may create one (no tenant's command creates anything but a
    list), so this is a defence against the unforeseen, run before a node consumes."""
    queues = [keys.EVENTS_QUEUE, keys.MAINTENANCE_QUEUE]
    queues += [keys.tenant_namespace(tenant).queue for tenant in sorted(tenants)]
    names = [keys.BROKER_KEY_PREFIX + queue for queue in queues]
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.type(name)
        kinds = pipe.execute()
    spoiled = [
        name
        for name, kind in zip(names, kinds, strict=True)
        if kind not in (b"list", b"none", "list", "none")
    ]
    for name in spoiled:
        log.error("deleted a queue key that was no list", extra={"key": name})
        client.delete(name)
    return spoiled


def count_refusals(client: redis.Redis, tenants: Iterable[str]) -> None:
    """Move the count of each tenant's door refusals (its refusal list) into
    :data:`bso.wire.keys.TENANT_REFUSED_KEY`, which only workers write: the length and
    the deletion in one transaction, so that no refusal is counted twice or lost."""
    ordered = sorted(tenants)
    with client.pipeline(transaction=True) as pipe:
        for tenant in ordered:
            refusals = keys.tenant_namespace(tenant).refusals_key
            pipe.llen(refusals)
            pipe.delete(refusals)
        answers = pipe.execute()
    for tenant, counted in zip(ordered, answers[::2], strict=True):
        if counted:
            client.hincrby(keys.TENANT_REFUSED_KEY, tenant, int(counted))


class TenantQueues:
    """What one node consumes of the tenants' queues, kept equal to the tenants set."""

    def __init__(
        self,
        read_members: Callable[[], Iterable[bytes | str]],
        add: Callable[[str], object],
        cancel: Callable[[str], object],
        *,
        load_door: Callable[[], object] = lambda: None,
        count: Callable[[set[str]], object] = lambda _: None,
        clear: Callable[[set[str]], object] = lambda _: None,
        missing: Callable[[], bool] = lambda: False,
        rebuild: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self._read_members = read_members
        self._add = add
        self._cancel = cancel
        self._load_door = load_door
        self._count = count
        self._clear = clear
        self._missing = missing
        self._rebuild = rebuild
        self.consumed: set[str] = set()

    def refresh(self) -> None:
        """Start consuming the queues of new tenants, stop those of removed ones,
        (re)load the tenants' door (:mod:`bso.wire.admission`), which a restarted
        Redis forgets and a tenant's user cannot load itself, and count the door's
        refusals (:func:`count_refusals`).

        Never raises: the timer runs this on the event loop, which takes an
        ``OSError`` for a lost broker connection.  An unreadable set leaves the
        queues as they are until the next try; a queue that cannot be consumed
        now (its key spoiled) is tried again next time, and the other queues are
        served meanwhile.
        """
        try:
            self._load_door()
            if self._missing() and not self._rebuilt():
                return  # the queues stay as they are until the store answers
            tenants = tenant_names(self._read_members())
        except (redis.RedisError, OSError) as exc:
            log.warning("cannot read the tenants set", extra={"error": type(exc).__name__})
            return
        wanted = {keys.tenant_namespace(tenant).queue for tenant in tenants}
        self._tried(self._clear, tenants, "check the key type of")
        for queue in sorted(wanted - self.consumed):
            if self._tried(self._add, queue, "start consuming"):
                self.consumed.add(queue)
        for queue in sorted(self.consumed - wanted):
            if self._tried(self._cancel, queue, "stop consuming"):
                self.consumed.discard(queue)
        self._tried(self._count, tenants, "count the door's refusals of")

    def _rebuilt(self) -> bool:
        """Rebuild the missing tenants set from the store; False if the store failed."""
        try:
            tenants = sorted(self._rebuild())
        except Exception as exc:  # the store's errors, of any driver: tried again next time
            log.warning(
                "the tenants set is missing from Redis and cannot be rebuilt from the store",
                extra={"error": type(exc).__name__},
            )
            return False
        log.warning(
            "the tenants set was missing from Redis (a restart without persistence, or an "
            "eviction); rebuilt from the store",
            extra={"tenants": ",".join(tenants)},
        )
        return True

    @staticmethod
    def _tried(action: Callable[[Any], object], argument: Any, what: str) -> bool:
        try:
            action(argument)
        except Exception as exc:  # kombu's and redis-py's errors alike: the loop goes on
            log.warning(f"cannot {what} a tenant's queue", extra={"error": type(exc).__name__})
            return False
        return True


def tenant_queues_step(
    broker_url: str,
    interval_s: float = REFRESH_S,
    rebuild: Callable[[redis.Redis], Iterable[str]] | None = None,
) -> type[Any]:
    """A consumer bootstep that keeps the node's tenant queues equal to the tenants set
    (``app.steps["consumer"].add(...)``, :func:`bso_workers.celery_app.create_app`).
    ``rebuild``: writes the set (and the limits) from the store into the Redis it is
    given, returning the tenants, when the set is missing."""
    from celery import bootsteps

    class ServeTenants(bootsteps.StartStopStep):
        """Consumes each tenant's queue; refreshed from the event loop's timer."""

        requires = ("celery.worker.consumer.tasks:Tasks",)

        def __init__(self, parent: Any, **kwargs: Any) -> None:
            super().__init__(parent, **kwargs)
            self.tref: Any = None
            self.client: redis.Redis | None = None

        def start(self, parent: Any) -> None:
            self.client = redis.Redis.from_url(
                broker_url, socket_connect_timeout=5, socket_timeout=5
            )
            client = self.client

            def serve(queue: str) -> None:
                # The tenant's copy of "a worker runs" (the beacon keeps it fresh), from
                # the moment its queue is served: its clients read no other.
                parent.add_task_queue(queue)
                namespace = keys.namespace_of_queue(queue)
                if namespace is not None:
                    value = f"{parent.hostname} serves {queue}"
                    client.set(namespace.alive_key, value, ex=keys.WORKERS_ALIVE_TTL_S)

            queues = TenantQueues(
                lambda: client.smembers(keys.TENANTS_KEY),
                serve,
                parent.cancel_task_queue,
                load_door=lambda: client.script_load(DOOR_SCRIPT),
                count=lambda tenants: count_refusals(client, tenants),
                clear=lambda tenants: clear_spoiled_queues(client, tenants),
                missing=lambda: rebuild is not None and not client.exists(keys.TENANTS_KEY),
                rebuild=lambda: rebuild(client) if rebuild is not None else (),
            )
            queues.refresh()
            self.tref = parent.timer.call_repeatedly(interval_s, queues.refresh)

        def stop(self, parent: Any) -> None:
            if self.tref is not None:
                self.tref.cancel()
                self.tref = None
            if self.client is not None:
                self.client.close()
                self.client = None

    return ServeTenants
