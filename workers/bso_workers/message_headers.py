"""What a worker reads off the message it runs: its custom headers and its queue.

The client puts the API key, its send time and its announcement channel in
headers of their own (:mod:`bso.wire.message`), never in the task's arguments,
which Flower and ``celery inspect`` show; the queue a message came from names
its tenant (:func:`namespace_of`).
"""

from __future__ import annotations

from typing import Any

from bso.wire import keys
from bso.wire.keys import SHARED, Namespace


def header_of(request: Any, name: str) -> object:
    """A custom header of the message being run.  A worker's request holds the
    message's custom headers both as attributes and in ``request.headers``; an
    eager call (tests) only in the latter."""
    value = (getattr(request, "headers", None) or {}).get(name)
    return getattr(request, name, None) if value is None else value


def api_key_of(request: Any) -> str | None:
    """The API key header of the message being run.  The key never travels in the
    task's arguments, which Flower, ``celery inspect`` and error logs show."""
    value = header_of(request, keys.API_KEY_HEADER)
    return value if isinstance(value, str) else None


def sent_at_of(request: Any) -> float | None:
    """The client's send time header (:data:`bso.wire.keys.SENT_AT_HEADER`), if any."""
    value = header_of(request, keys.SENT_AT_HEADER)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def namespace_of(request: Any) -> Namespace:
    """The namespace of the queue the message being run was popped from: its routing
    key, which the workers' screen (:func:`bso_workers.envelope.check_item`) checked
    equals that queue, so a sender cannot name another tenant's."""
    routing_key = (getattr(request, "delivery_info", None) or {}).get("routing_key")
    namespace = keys.namespace_of_queue(routing_key) if isinstance(routing_key, str) else None
    return SHARED if namespace is None else namespace


def reply_channel_of(request: Any) -> str | None:
    """The caller's announcement channel (:data:`bso.wire.keys.REPLY_CHANNEL_HEADER`),
    if it named a well-formed one of its message's namespace."""
    value = header_of(request, keys.REPLY_CHANNEL_HEADER)
    return value if namespace_of(request).is_announce_channel(value) else None
