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
    bso:deadletters                                list of refused queue items, DEADLETTERS_TTL
    bso:deadletters:counts                         hash: refused items per reason, and "total"
    bso:workers:alive                              string, the last worker node to say it runs,
                                                   WORKERS_ALIVE_TTL_S
    bso:broker:<queue>, bso:broker:unacked, ...    Celery/kombu (BROKER_KEY_PREFIX)

Reply keys name the job and the trial (``-`` where the event has none, e.g. a
register with a generated id or a next-trial request) so that an operator can
list one trial's traffic with ``redis-cli --scan --pattern 'bso:reply:job:7:*'``;
the event id alone already makes them unique.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final, TypeGuard

from bso.ids import MAX_ID_LENGTH, is_event_id, is_job_id

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
}
"""Task that handles each event ``kind`` (see :mod:`bso.wire.events`)."""


def reply_key(event_id: str, job_id: str | None = None, trial_number: int | None = None) -> str:
    """The list a reply to ``event_id`` is pushed to."""
    trial = MISSING if trial_number is None else str(trial_number)
    return f"{REPLY_PREFIX}{job_id or MISSING}:{trial}:{event_id}"


def announce_channel(token: str) -> str:
    """The announcement channel named by ``token`` (32 hex digits, see
    :func:`is_announce_channel`)."""
    return f"{ANNOUNCE_PREFIX}{token}"


_ANY_ANNOUNCE_CHANNEL = re.compile(re.escape(ANNOUNCE_PREFIX).encode() + rb"[0-9A-Za-z]+")


def redact_announce_channels(data: bytes) -> bytes:
    """``data`` with the token of every announcement channel in it blanked: who knows a
    caller's channel hears which of its replies are ready (for logs and previews)."""
    return _ANY_ANNOUNCE_CHANNEL.sub(ANNOUNCE_PREFIX.encode() + b"***", data)


def is_announce_channel(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a channel a worker may announce on: nothing a sender
    chooses beyond a token of the one fixed shape."""
    return (
        isinstance(value, str)
        and value.startswith(ANNOUNCE_PREFIX)
        and _ANNOUNCE_TOKEN.fullmatch(value, len(ANNOUNCE_PREFIX)) is not None
    )


def deaths_key(event_id: str) -> str:
    """The counter of worker deaths while running ``event_id``."""
    return f"{DEATHS_PREFIX}{event_id}"


def reply_key_for(payload: Mapping[str, object]) -> str | None:
    """Reply key of an event given as its JSON object, or None without a valid event id.

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
    event_id = payload.get("event_id")
    if not is_event_id(event_id):
        return None
    job_id = payload.get("job_id")
    spec = payload.get("spec")
    if job_id is None and isinstance(spec, Mapping):
        job_id = spec.get("job_id")
    trial = payload.get("trial_number")
    return reply_key(
        event_id,
        job_id if is_job_id(job_id) else None,
        trial if _is_trial_number(trial) else None,
    )


def _is_trial_number(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_TRIAL_NUMBER
