"""The queue's message format: a Celery task-protocol-2 message as kombu's Redis
transport stores it, built without Celery.

The client enqueues an event with one ``LPUSH`` of this message (its Redis user
may run nothing else on the queue: see :mod:`bso.wire.keys`); the worker's
:mod:`bso_workers.envelope` checks every popped item against the same format
before kombu or Celery decode it.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any, Final

from bso.wire import keys

_ORIGIN = f"{os.getpid()}@{socket.gethostname()}"

MAX_REPR_CHARS: Final = 1024
"""Longest ``argsrepr`` / ``kwargsrepr`` header: Celery's own publishers' bound
(``app.amqp.argsrepr_maxsize``), which the workers also hold every sender to
(``bso_workers.task_request``)."""


def bounded_repr(text: object) -> object:
    """``text`` cut to :data:`MAX_REPR_CHARS`, ending in ``...`` when cut (as Celery's
    ``saferepr`` does); anything but a string (a missing header) as it is."""
    if isinstance(text, str) and len(text) > MAX_REPR_CHARS:
        return text[: MAX_REPR_CHARS - 3] + "..."
    return text


_NO_CALLBACKS = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def celery_message(
    task_name: str,
    payload_json: str,
    message_id: str,
    queue: str = keys.EVENTS_QUEUE,
    *,
    api_key: str | None = None,
    reply_channel: str | None = None,
) -> str:
    """The kombu/Celery (task protocol 2) message that ``send_task`` would enqueue.

    Same headers and properties as Celery 5's ``send_task`` for a task with
    ``ignore_result`` and no ETA, expiry, retries or callbacks; the body is
    plain JSON instead of base64 (kombu decodes a message without
    ``body_encoding`` as is).  ``argsrepr`` keeps the payload's first
    :data:`MAX_REPR_CHARS` characters, as Flower shows it (the whole payload there
    doubled the item: a detached run of 4,200 epochs, which the models accept, was
    over the workers' 1 MiB item limit and dead-lettered unanswered);
    the API key goes in its own header (:data:`bso.wire.keys.API_KEY_HEADER`), which
    Flower does not show; so does the channel on which the caller hears its reply
    announced (:data:`bso.wire.keys.REPLY_CHANNEL_HEADER`).
    """
    headers: dict[str, Any] = {
        "lang": "py",
        "task": task_name,
        "id": message_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": message_id,
        "parent_id": None,
        "argsrepr": bounded_repr(repr((payload_json,))),
        "kwargsrepr": "{}",
        "origin": _ORIGIN,
        "ignore_result": True,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    if api_key is not None:
        headers[keys.API_KEY_HEADER] = api_key
    if reply_channel is not None:
        headers[keys.REPLY_CHANNEL_HEADER] = reply_channel
    headers[keys.SENT_AT_HEADER] = time.time()
    message = {
        "body": json.dumps([[payload_json], {}, _NO_CALLBACKS]),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            "correlation_id": message_id,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return json.dumps(message)
