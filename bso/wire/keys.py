"""Every name bso puts in Redis, and every TTL on it, in one place.

The caller (``bso_client``) and the workers (``bso_workers``) must agree on
reply keys, queue names, task names and the broker's key prefix without
importing each other, so both import this module.  It holds plain strings and
numbers only (no Redis client), which keeps it importable from the slim client
install and trivially testable.

Layout of a Redis database used by bso::

    bso:reply:<job id>:<trial number>:<event id>   string, one JSON reply, REPLY_TTL
    bso:reply:announce:<token>                     pub/sub channel of one caller: workers
                                                   publish the keys of its replies there
    bso:deaths:<event id>                          counter of worker deaths, DEATHS_TTL
    bso:deaths:<tenant>/<event id>                 the same for a tenant's event
    bso:deadletters                                list of refused queue items, DEADLETTERS_TTL
    bso:deadletters:counts                         hash: refused items per reason, and "total"
    bso:workers:alive                              string, the last worker node to say it runs,
                                                   WORKERS_ALIVE_TTL_S
    bso:broker:<queue>, bso:broker:unacked, ...    Celery/kombu (BROKER_KEY_PREFIX)
    bso:tenants                                    set: the tenants whose queues workers serve
    bso:t:<tenant>:reply:<job>:<trial>:<event>     a tenant's replies (its :class:`Namespace`)
    bso:t:<tenant>:reply:announce:<token>          a tenant's announcement channels
    bso:t:<tenant>:limits                          string "<max queue> <per second>": its limits,
                                                   as its door reads them
    bso:t:<tenant>:admitted                        list: its latest admission times (ms)
    bso:t:<tenant>:refusals                        list: its door's refusals not yet counted
    bso:t:<tenant>:alive                           its copy of bso:workers:alive
    bso:tenant-limits                              hash: tenant -> its limits, as the workers
                                                   read them (no tenant can touch it)
    bso:tenant-refused                             hash: tenant -> events refused unapplied
    bso:broker:bso.events.t.<tenant>               a tenant's events queue

Each tenant has a namespace of its own (:class:`Namespace`): its own queue, reply
keys and announcement channels, which only its Redis user
(:func:`tenant_user`) and the workers may touch.  The names without a tenant
(``bso.events``, ``bso:reply:``) are the shared namespace of the ``bso-client``
user, kept for clients set up before tenants had users of their own.

Reply keys name the job and the trial (``-`` where the event has none, e.g. a
register with a generated id or a next-trial request) so that an operator can
list one trial's traffic with ``redis-cli --scan --pattern 'bso:reply:job:7:*'``;
the event id alone already makes them unique.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, TypeGuard

from bso.ids import MAX_ID_LENGTH, is_event_id, is_job_id, is_tenant

KEY_PREFIX: Final = "bso:"
"""Root of every key bso writes, so one Redis can be shared with other users."""

REPLY_PREFIX: Final = KEY_PREFIX + "reply:"
"""Reply keys: the worker stores one reply with ``SET ... EX`` and announces it on
the caller's :func:`announce_channel`, the caller takes it with ``GETDEL``
(strings, not lists, so that a client's ACL needs no BLPOP, which would also let
it take from the events queue)."""

ANNOUNCE_PREFIX: Final = REPLY_PREFIX + "announce:"
"""Pub/sub channels on which workers announce replies, one per caller (a reply
backend), named by a random token: the caller subscribes once and sends its
channel's name with every event (:data:`REPLY_CHANNEL_HEADER`), the worker
publishes the reply's key there after storing it.  A client's ACL lets it
subscribe to exactly named channels under this prefix (no patterns), so only a
holder of the token hears which keys are answered."""

ANNOUNCE_TOKEN_LENGTH: Final = 32
"""Hex digits of the token that names an announcement channel: 128 random bits."""

_ANNOUNCE_TOKEN = re.compile(f"[0-9a-f]{{{ANNOUNCE_TOKEN_LENGTH}}}")

DEATHS_PREFIX: Final = KEY_PREFIX + "deaths:"
"""Per event id: how many deliveries of it ended with their worker's death
(counted only on kombu's redeliveries, see ``bso_workers.deaths``)."""

DEATHS_TTL_S: Final = 24 * 3600
"""How long a death count is kept: far beyond the caller's retry window and any
redelivery, after which an event id is not seen again."""

DEADLETTERS_KEY: Final = KEY_PREFIX + "deadletters"
"""Queue items the workers refused before decoding them (``bso_workers.deadletters``):
one JSON record each, newest first, read with ``bso deadletters``."""

DEADLETTERS_MAX: Final = 1000
"""Records kept in :data:`DEADLETTERS_KEY` (LTRIM on every push): a flood of garbage
costs at most this many records (each holds a preview of at most
:data:`DEADLETTER_PREVIEW_CHARS` characters, not the item)."""

DEADLETTERS_TTL_S: Final = 7 * 24 * 3600
"""The dead-letter list expires this long after its last push: a week to look."""

DEADLETTER_COUNTS_KEY: Final = DEADLETTERS_KEY + ":counts"
"""Hash of refused items per reason plus ``total``; never expires (a few fields)."""

DEADLETTER_PREVIEW_CHARS: Final = 2000
"""Longest escaped preview of a refused item kept in its record and log line."""

DEFAULT_MAX_QUEUE_ITEM_BYTES: Final = 1024 * 1024
"""Largest queue item a worker decodes (``BSO_MAX_QUEUE_ITEM_BYTES``); a bso event
message is a few KiB, and a larger item is dead-lettered unread."""

REPLY_CHANNEL_HEADER: Final = "bso_reply_channel"
"""Message header: the caller's :func:`announce_channel`, on which the worker announces
the reply.  A message without it (an older client) gets its reply unannounced."""

API_KEY_HEADER: Final = "bso_api_key"
"""Message header carrying the caller's API key (:mod:`bso.apikeys`): in a header,
not the task's arguments, so that Flower and ``celery inspect`` never show it."""

SENT_AT_HEADER: Final = "bso_sent_at"
"""Message header: the client's ``time.time()`` when it sent the event, from which the
workers measure time in the queue (``bso_event_queue_seconds``)."""

BROKER_KEY_PREFIX: Final = KEY_PREFIX + "broker:"
"""kombu's ``global_keyprefix``: queues, unacked messages, bindings, pidbox."""

DEFAULT_REPLY_TTL_S: Final = 600
"""How long an unclaimed reply lives.

It must outlast the caller's whole retry window (every attempt's timeout), so
that a reply stored just after a timeout is still there for the retry's polls.
"""

DEFAULT_VISIBILITY_TIMEOUT_S: Final = 300
"""Seconds before kombu hands an unacknowledged message to another worker.

With ``acks_late`` a message stays unacked while its task runs; if the whole
worker node dies (SIGKILL, lost machine) the message comes back after this
long.  It must exceed the hard task time limit, or a slow but healthy task
would be delivered twice at once (harmless, since events are idempotent, but
wasteful).
"""

WORKERS_ALIVE_KEY: Final = KEY_PREFIX + "workers:alive"
"""Set by every running worker node (``bso_workers.presence``) every
:data:`WORKERS_ALIVE_REFRESH_S` with a TTL of :data:`WORKERS_ALIVE_TTL_S`, so that
a caller whose event is not answered can tell "no worker is running" (the key is
gone) from "the workers are slow" (it is there) within seconds, instead of
waiting out every retry.  One key for all nodes, not one per node: the client's
Redis user may GET exactly this key and scan nothing."""

WORKERS_ALIVE_REFRESH_S: Final = 3.0
"""How often a worker node sets :data:`WORKERS_ALIVE_KEY`."""

WORKERS_ALIVE_TTL_S: Final = 10
"""How long :data:`WORKERS_ALIVE_KEY` outlives its last refresh: three refreshes,
so that a node busy for a moment (a garbage collection, a slow Redis round trip)
or restarting is not taken for gone, while a caller still learns that every
worker stopped within this long."""

MISSING: Final = "-"
"""Placeholder for a key part the event does not have."""

MAX_KEY_PART: Final = MAX_ID_LENGTH
"""Longest event id or job id accepted into a key (the event models' own limit)."""

MAX_TRIAL_NUMBER: Final = 2**31 - 1
"""Largest trial number put into a key (the models' and the store's 32-bit limit)."""

EVENTS_QUEUE: Final = "bso.events"
"""Queue of the job events and status reads: latency-sensitive."""

MAINTENANCE_QUEUE: Final = "bso.maintenance"
"""Queue of the periodic sweep, so it never waits behind a burst of events."""

TASK_REGISTER: Final = "bso.register"
TASK_NEXT_TRIAL: Final = "bso.next_trial"
TASK_EPOCH: Final = "bso.epoch"
TASK_END: Final = "bso.end"
TASK_HEARTBEAT: Final = "bso.heartbeat"
TASK_DELETE: Final = "bso.delete"
TASK_DETACHED_RUN: Final = "bso.detached_run"
TASK_RESET: Final = "bso.reset"
TASK_SET_SIZES: Final = "bso.set_sizes"
TASK_RESUME: Final = "bso.resume"
TASK_STATUS: Final = "bso.status"
TASK_LIST_JOBS: Final = "bso.list_jobs"
TASK_SWEEP: Final = "bso.sweep"

TASK_FOR_KIND: Final[Mapping[str, str]] = {
    "register": TASK_REGISTER,
    "next_trial": TASK_NEXT_TRIAL,
    "epoch": TASK_EPOCH,
    "end": TASK_END,
    "heartbeat": TASK_HEARTBEAT,
    "delete": TASK_DELETE,
    "detached_run": TASK_DETACHED_RUN,
    "reset": TASK_RESET,
    "set_sizes": TASK_SET_SIZES,
    "resume": TASK_RESUME,
}
"""Task that handles each event ``kind`` (see :mod:`bso.wire.events`)."""


def reply_key(event_id: str, job_id: str | None = None, trial_number: int | None = None) -> str:
    """The key a reply to ``event_id`` is stored under, in the shared namespace."""
    return SHARED.reply_key(event_id, job_id, trial_number)


_ANY_ANNOUNCE_CHANNEL = re.compile(rb"(announce:)[0-9A-Za-z]+")


def redact_announce_channels(data: bytes) -> bytes:
    """``data`` with the token of every announcement channel in it blanked: who knows a
    caller's channel hears which of its replies are ready (for logs and previews)."""
    return _ANY_ANNOUNCE_CHANNEL.sub(rb"\1***", data)


def deaths_key(event_id: str, tenant: str | None = None) -> str:
    """The counter of worker deaths while running ``event_id``, sent by ``tenant`` (None:
    the shared namespace).  Per tenant, since event ids are chosen by the senders: a
    tenant that marks its own messages redelivered must not count deaths against
    another tenant's event of the same id (``/`` is in neither a tenant nor an event id,
    so no two namespaces' keys coincide)."""
    return f"{DEATHS_PREFIX}{event_id}" if tenant is None else f"{DEATHS_PREFIX}{tenant}/{event_id}"


def reply_key_for(payload: Mapping[str, object]) -> str | None:
    """Reply key of an event given as its JSON object (shared namespace; a tenant's:
    :meth:`Namespace.reply_key_for`), or None without a valid event id.

    Works on any decoded JSON object, valid event or not, so that the caller
    (from ``event.model_dump(mode="json")``) and a worker that could not parse
    the event (from the raw payload) derive the same key: the worker can then
    tell the caller *why* its event was rejected instead of leaving it to time
    out.  Only parts that are valid as the event models define them go into
    the key (ids per :mod:`bso.ids`, a trial number of 1 to 2^31 - 1); any
    other part is treated as absent (:data:`MISSING`), and an invalid event id
    gives no key at all.  So a key is always short printable ASCII under
    :data:`REPLY_PREFIX`: a sender cannot shape it (no control characters, no
    surrogates that would fail to encode, no 4,000-digit trial number) beyond
    choosing valid ids, which it could do anyway.
    """
    return SHARED.reply_key_for(payload)


def _is_trial_number(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_TRIAL_NUMBER


TENANTS_KEY: Final = KEY_PREFIX + "tenants"
"""Set of the tenants with a valid key: every worker node serves their queues
(``bso_workers.tenant_queues``), so a team created while the service runs is
served within seconds.  Written by ``bso up`` and ``bso keys``; the store stays
the truth (``bso up`` writes the set anew from it)."""

TENANT_QUEUE_PREFIX: Final = EVENTS_QUEUE + ".t."
"""A tenant's events queue is this prefix and the tenant's name."""

TENANT_KEY_PREFIX: Final = KEY_PREFIX + "t:"
"""A tenant's reply keys and channels live under this prefix, its name and ``:``."""

TENANT_LIMITS_KEY: Final = KEY_PREFIX + "tenant-limits"
"""Hash of every tenant given its own limits (``bso.apikeys.TenantLimits``, encoded):
the copy the workers bound queues by.  A tenant's door reads the copy in its own
namespace, which the tenant could delete; this one only ``bso keys`` and
``bso up`` write."""

TENANT_REFUSED_KEY: Final = KEY_PREFIX + "tenant-refused"
"""Hash of events refused unapplied per tenant, at its door or past its queue's bound
(the metric ``bso_tenant_refused_total``).  Only workers write it: a door's refusals
reach it through the tenant's refusal list (:attr:`Namespace.refusals_key`)."""

REFUSALS_KEPT: Final = 10_000
"""Most refusals a tenant's refusal list holds between two counts by the workers."""

TENANT_USER_PREFIX: Final = "bso-tenant-"
"""A tenant's Redis user is this prefix and the tenant's name."""


def tenant_user(tenant: str) -> str:
    """The Redis user of ``tenant``'s training jobs."""
    return TENANT_USER_PREFIX + tenant


@dataclass(frozen=True, slots=True)
class Namespace:
    """Where one caller's events go and where its replies come back.

    A tenant's namespace is the tenant's own (its queue, its reply keys, its
    announcement channels): its Redis user may write and read nothing else, and
    the workers answer an event popped from its queue only inside it.  The
    shared namespace (``tenant=None``) is the one of the ``bso-client`` user.
    """

    tenant: str | None = None

    @property
    def queue(self) -> str:
        """The events queue (a kombu queue name; its list is under :data:`BROKER_KEY_PREFIX`)."""
        return EVENTS_QUEUE if self.tenant is None else TENANT_QUEUE_PREFIX + self.tenant

    @property
    def queue_key(self) -> str:
        """The Redis list that holds :attr:`queue` (priority 0, the only one bso uses)."""
        return BROKER_KEY_PREFIX + self.queue

    @property
    def reply_prefix(self) -> str:
        return REPLY_PREFIX if self.tenant is None else f"{TENANT_KEY_PREFIX}{self.tenant}:reply:"

    @property
    def announce_prefix(self) -> str:
        return self.reply_prefix + "announce:"

    def reply_key(
        self, event_id: str, job_id: str | None = None, trial_number: int | None = None
    ) -> str:
        """The key a reply to ``event_id`` is stored under."""
        trial = MISSING if trial_number is None else str(trial_number)
        return f"{self.reply_prefix}{job_id or MISSING}:{trial}:{event_id}"

    def reply_key_for(self, payload: Mapping[str, object]) -> str | None:
        """:func:`reply_key_for` in this namespace."""
        event_id = payload.get("event_id")
        if not is_event_id(event_id):
            return None
        job_id = payload.get("job_id")
        spec = payload.get("spec")
        if job_id is None and isinstance(spec, Mapping):
            job_id = spec.get("job_id")
        trial = payload.get("trial_number")
        return self.reply_key(
            event_id,
            job_id if is_job_id(job_id) else None,
            trial if _is_trial_number(trial) else None,
        )

    def announce_channel(self, token: str) -> str:
        """The announcement channel named by ``token`` (32 hex digits)."""
        return f"{self.announce_prefix}{token}"

    def is_announce_channel(self, value: object) -> TypeGuard[str]:
        """Whether ``value`` is a channel of this namespace a worker may announce on:
        nothing a sender chooses beyond a token of the one fixed shape."""
        prefix = self.announce_prefix
        return (
            isinstance(value, str)
            and value.startswith(prefix)
            and _ANNOUNCE_TOKEN.fullmatch(value, len(prefix)) is not None
        )

    @property
    def alive_key(self) -> str:
        """Whether a worker runs, as this namespace's clients read it: the shared key, or
        the tenant's own copy, which the workers set beside it (a tenant may delete its
        own keys, and then fools only itself)."""
        return WORKERS_ALIVE_KEY if self.tenant is None else self._tenant_key("alive")

    @property
    def limits_key(self) -> str:
        """The tenant's limits (:class:`bso.apikeys.TenantLimits`, encoded), which its
        door reads and ``bso keys`` writes."""
        return self._tenant_key("limits")

    @property
    def admitted_key(self) -> str:
        """The door's log of the tenant's latest admission times (its rate)."""
        return self._tenant_key("admitted")

    @property
    def refusals_key(self) -> str:
        """The door's refusals not yet counted: a list the workers empty into
        :data:`TENANT_REFUSED_KEY` (a counter would need a command that creates a
        string, which the tenant's user must not have)."""
        return self._tenant_key("refusals")

    def _tenant_key(self, name: str) -> str:
        if self.tenant is None:
            raise ValueError(f"the shared namespace has no {name} key: it has no door")
        return f"{TENANT_KEY_PREFIX}{self.tenant}:{name}"

    @property
    def user_rules(self) -> str:
        """The Redis ACL rules of this namespace's training clients: push onto its queue
        (a tenant's: through its door, :mod:`bso.wire.admission`), take its replies
        and hear them announced, read whether a worker runs.

        Redis 6.2 has no per-key command lists: every command here applies to
        every key named.  So no command here may create a key of a type other
        than a list: one that made the queue key a string (INCR, SET, ...) would
        break the workers' pop of every queue.  The only command that creates a
        key is LPUSH; the door's others (LLEN, LINDEX, LTRIM, TIME) read or
        shorten lists of the tenant's own; EVALSHA runs only a script the
        workers loaded.  LTRIM lets a tenant empty its own queue, losing only its
        own events.
        """
        channels = self.announce_prefix + "?" * ANNOUNCE_TOKEN_LENGTH
        common = "resetchannels -@all +lpush +get +getdel +subscribe +unsubscribe +ping +select"
        own = f"~{self.reply_prefix}*"
        if self.tenant is not None:
            common += " +evalsha +llen +lindex +ltrim +time"
            own += f" ~{self.limits_key} ~{self.admitted_key} ~{self.refusals_key}"
        return f"{common} ~{self.queue_key} {own} ~{self.alive_key} &{channels}"


SHARED: Final = Namespace()
"""The shared namespace of the ``bso-client`` user (clients set up before tenants had
Redis users of their own)."""


def tenant_namespace(tenant: str) -> Namespace:
    """``tenant``'s namespace; ``ValueError`` for a name that is not a tenant's."""
    if not is_tenant(tenant):
        raise ValueError(f"{tenant!r} is not a tenant name")
    return Namespace(tenant)


def namespace_of_user(user: str | None) -> Namespace:
    """The namespace a client of Redis user ``user`` publishes in: its tenant's for a
    tenant's user (:func:`tenant_user`), the shared one for any other."""
    if user is not None and user.startswith(TENANT_USER_PREFIX):
        tenant = user[len(TENANT_USER_PREFIX) :]
        if is_tenant(tenant):
            return Namespace(tenant)
    return SHARED


def namespace_of_queue(queue: str) -> Namespace | None:
    """The namespace whose events queue is ``queue``; None for any other queue."""
    if queue == EVENTS_QUEUE:
        return SHARED
    if queue.startswith(TENANT_QUEUE_PREFIX) and is_tenant(
        tenant := queue[len(TENANT_QUEUE_PREFIX) :]
    ):
        return Namespace(tenant)
    return None


def namespace_of_channel(value: object) -> Namespace | None:
    """The namespace whose announcement channel ``value`` is; None for any other value."""
    if not isinstance(value, str):
        return None
    if value.startswith(TENANT_KEY_PREFIX):
        tenant = value[len(TENANT_KEY_PREFIX) :].partition(":")[0]
        namespace = Namespace(tenant) if is_tenant(tenant) else None
    else:
        namespace = SHARED
    return namespace if namespace is not None and namespace.is_announce_channel(value) else None
