"""Dead letters: the queue items a worker refused before decoding them.

Anyone who can push onto a bso queue can push anything (``[]``, pickle, a
megabyte of zeros).  The workers' transport (:mod:`bso_workers.broker`) hands
every item it pops from a bso queue to :meth:`DeadLetters.screen` *before*
kombu parses it; an item :func:`bso_workers.envelope.check_item` refuses
never reaches kombu or Celery.  Instead it is

* logged, as a warning with its reason and an escaped, truncated preview
  (``repr`` of the bytes: no raw control characters reach the log), at most once
  per queue and reason every :data:`LOG_EVERY_S` seconds, the next line saying
  how many were held back: a tenant's flood of junk must not fill the workers'
  disks with log lines (the counts and the list below miss none);
* counted per reason in :data:`bso.wire.keys.DEADLETTER_COUNTS_KEY`;
* recorded in the bounded list :data:`bso.wire.keys.DEADLETTERS_KEY` (newest first,
  :data:`~bso.wire.keys.DEADLETTERS_MAX` records, expiring
  :data:`~bso.wire.keys.DEADLETTERS_TTL_S` after the last one), which an operator
  reads with ``bso deadletters`` (:mod:`bso.commands.deadletters`);
* answered with an ``invalid_event`` error reply when the item carries a bso
  event whose reply key can be read (:func:`bso.wire.keys.reply_key_for`), so its
  caller learns why instead of timing out.

The record keeps the preview, not the item: a flood of large items costs
Redis a bounded amount of memory.  Nothing here raises into the transport: a
failed record or reply is logged and the item is dropped all the same.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Final

import redis

from bso.apikeys import redact_key_bytes
from bso.errors import InvalidEvent
from bso.wire import keys
from bso.wire.events import ErrorReply
from bso_workers.envelope import Refused, check_fanout_item, check_item

log = logging.getLogger("bso.deadletters")

LOG_EVERY_S: Final = 10.0
"""Seconds between two log lines about one queue's dead letters of one reason."""


class LogGate:
    """At most one log line per key every :data:`LOG_EVERY_S` seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._held: Counter[tuple[str, str]] = Counter()

    def admit(self, key: tuple[str, str]) -> int | None:
        """None: stay quiet (the item is counted as held back); else log now, the
        number held back since the key's last line given."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < LOG_EVERY_S:
            self._held[key] += 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)


def is_screened(queue: str) -> bool:
    """Whether ``queue`` is one of bso's (the maintenance queue, the shared events queue
    or a tenant's); other kombu lists (the replies to a remote-control caller) are
    read only by that caller, not by workers."""
    return queue == keys.MAINTENANCE_QUEUE or keys.namespace_of_queue(queue) is not None


PushReply = Callable[[str, str, str | None], None]
"""``(reply key, reply JSON, announcement channel or None)``: the workers'
``WorkerRuntime.push``."""


class DeadLetters:
    """The gate's verdicts and the dead-letter list, for one worker process.

    Its Redis client is made on first use, so an instance created before a
    fork is safe to use after it.
    """

    def __init__(
        self,
        broker_url: str,
        *,
        max_item_bytes: int = keys.DEFAULT_MAX_QUEUE_ITEM_BYTES,
        push_reply: PushReply | None = None,
        client: redis.Redis | None = None,
        log_gate: LogGate | None = None,
    ) -> None:
        self.broker_url = broker_url
        self.log_gate = log_gate or LogGate()
        self.max_item_bytes = max_item_bytes
        self.push_reply = push_reply
        self._redis = client
        self._owned = client is None
        self.worker = f"{os.getpid()}@{socket.gethostname()}"

    def __repr__(self) -> str:  # shown by `celery inspect conf`: no URL, no password
        return f"DeadLetters(max_item_bytes={self.max_item_bytes})"

    def __json__(self) -> str:
        """What kombu's JSON encoder sends for this object: ``inspect conf`` (Flower's
        worker page) replies with the transport options, which hold it."""
        return repr(self)

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis.Redis.from_url(
                self.broker_url, socket_connect_timeout=5, socket_timeout=5
            )
        return self._redis

    def screen(self, item: bytes, queue: str) -> bool:
        """True if kombu may decode ``item``, just popped from ``queue``; else it is
        dead-lettered here and the transport must act as if nothing had been popped."""
        if not is_screened(queue):
            return True
        try:
            refused = check_item(item, queue, self.max_item_bytes)
        except Exception as exc:  # a gap in the gate must not stop the worker either
            log.exception("queue item check failed")
            refused = Refused("bad_envelope", f"the check failed ({type(exc).__name__})")
        return self._verdict(item, queue, refused)

    def screen_fanout(self, item: bytes, channel: str) -> bool:
        """The same for a message on a broadcast channel the process listens to
        (Celery's remote control, ``celery.pidbox``; its monitoring events, which
        Flower hears, ``celeryev``): kombu indexes into those too."""
        try:
            refused = check_fanout_item(item, self.max_item_bytes, channel)
        except Exception as exc:
            log.exception("broadcast message check failed")
            refused = Refused("bad_envelope", f"the check failed ({type(exc).__name__})")
        return self._verdict(item, _printable(channel), refused)

    def _verdict(self, item: bytes, queue: str, refused: Refused | None) -> bool:
        if refused is None:
            return True
        try:
            self.dead_letter(item, queue, refused)
        except Exception:  # the item is dropped all the same; the transport must go on
            log.exception("could not dead-letter a refused item")
        return False

    def dead_letter(self, item: bytes, queue: str, refused: Refused) -> None:
        """Log, count and record a refused item; answer its caller if it can be named."""
        replied = self._reply(refused, keys.namespace_of_queue(queue))
        record: dict[str, object] = {
            "at": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "queue": queue,
            "reason": refused.reason,
            "why": refused.why,
            "bytes": len(item),
            "preview": preview(item, self.max_item_bytes),
            "worker": self.worker,
        }
        if replied is not None:
            record["replied_to"] = replied
        held = self.log_gate.admit((queue, refused.reason))
        if held is not None:
            extra = {**record, "held_back": held} if held else record
            log.warning("queue item refused and dead-lettered", extra=extra)
        try:
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.lpush(keys.DEADLETTERS_KEY, json.dumps(record))
                pipe.ltrim(keys.DEADLETTERS_KEY, 0, keys.DEADLETTERS_MAX - 1)
                pipe.expire(keys.DEADLETTERS_KEY, keys.DEADLETTERS_TTL_S)
                pipe.hincrby(keys.DEADLETTER_COUNTS_KEY, refused.reason, 1)
                pipe.hincrby(keys.DEADLETTER_COUNTS_KEY, "total", 1)
                pipe.execute()
        except (redis.RedisError, OSError) as exc:
            log.error("could not record a dead letter", extra={"error": type(exc).__name__})

    def _reply(self, refused: Refused, namespace: keys.Namespace | None) -> str | None:
        """Push ``invalid_event`` to the reply key of the event in the item, in the
        namespace of the queue it came from, if any; returns the event id answered."""
        event = refused.event
        if event is None or self.push_reply is None or namespace is None:
            return None
        key = namespace.reply_key_for(event)
        event_id = event.get("event_id")
        if key is None or not isinstance(event_id, str):
            return None
        reply = ErrorReply(
            event_id=event_id,
            code=InvalidEvent.code,
            message=f"the queue item carrying this event was refused before decoding "
            f"({refused.reason}): {refused.why}; it is in the dead letters (bso deadletters)",
        )
        try:
            self.push_reply(key, reply.model_dump_json(), refused.reply_channel)
        except Exception as exc:  # Redis down, or anything else: the item is dropped anyway
            log.error("could not answer a refused item", extra={"error": type(exc).__name__})
            return None
        return event_id

    def close(self) -> None:
        if self._owned and self._redis is not None:
            self._redis.close()
            self._redis = None


def _printable(name: str) -> str:
    """A channel name (a pattern subscription's suffix is the publisher's choice)."""
    return name if name.isprintable() and len(name) <= 200 else ascii(name)[:200]


def preview(item: bytes, max_bytes: int = keys.DEFAULT_MAX_QUEUE_ITEM_BYTES) -> str:
    """The item's bytes as an escaped, ASCII-only ``repr``, cut to the preview length.

    A kombu envelope's base64 body is shown decoded (:func:`readable`), so that
    the record says what was sent, not a wall of base64; but only in an item
    within ``max_bytes`` (the workers' item limit).  A larger one is shown from its
    first bytes as they are: decoding it whole (a base64 body of NULs escapes to six
    times its size) took a worker to 14 times the item in memory, 1.2 GB for an
    80 MB item refused for its size (a Redis left at its default takes 512 MB items;
    bso's takes 16 MiB, :func:`bso_workers.redis_server.max_bulk_bytes`).
    """
    limit, size = keys.DEADLETTER_PREVIEW_CHARS, len(item)
    whole = size <= max_bytes
    shown = readable(item) if whole else item[:limit]
    # An item may carry a caller's API key and announcement channel in its headers (a
    # key or token cut at the preview's end is still blanked: the patterns take any
    # part of a secret).
    shown = keys.redact_announce_channels(redact_key_bytes(shown))
    text = repr(shown[:limit])[:limit]
    return text if whole and len(shown) <= limit else f"{text}... ({size} bytes)"


def readable(item: bytes) -> bytes:
    """``item`` with a kombu envelope's base64 ``body`` replaced by its decoded text
    (under the key ``body (decoded)``); any other item unchanged.  Never raises."""
    try:
        envelope = json.loads(item)
        properties = envelope["properties"]
        if properties.get("body_encoding") != "base64":
            return item
        body = base64.b64decode(envelope["body"], validate=True).decode("utf-8")
    except Exception:  # anything at all, deep nesting's RecursionError included
        return item
    rest = {k: v for k, v in envelope.items() if k != "body"}
    return json.dumps({"body (decoded)": body, **rest}, ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )
