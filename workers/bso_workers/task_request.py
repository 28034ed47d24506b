"""The request class of bso's tasks: what a worker repeats of a message's arguments, bounded.

A Celery worker copies a message's ``argsrepr`` and ``kwargsrepr`` headers, as the
sender wrote them, into the ``task-received`` event it publishes (which Flower
keeps, for its last 10,000 tasks) and into ``celery inspect active``'s answer.
Celery's own publishers cut both to 1,024 characters (``app.amqp.argsrepr_maxsize``);
the screen (:mod:`bso_workers.envelope`) bounds only the whole item (1 MiB), and a
tenant's user may ``LPUSH`` items of its own making around its door.  So one team
could make every worker publish, and Flower hold, up to a mebibyte of text per
event: 260 such events of 200-450 KB took Flower from 108 MB to 421 MB resident, and
10,000 of them would hold tens of gigabytes.  bso's client also puts its whole
payload there, which a long detached run makes large.

:class:`BoundedRequest` cuts both to :data:`MAX_REPR_CHARS` on the worker, whatever
the sender wrote, the way Celery's publishers would have.  The task's argument
itself is not touched.
"""

from __future__ import annotations

from typing import Any, Final

from celery.worker.request import Request

MAX_REPR_CHARS: Final = 1024
"""Longest ``argsrepr`` / ``kwargsrepr`` a worker repeats: Celery's own bound."""

REQUEST_CLASS: Final = "bso_workers.task_request:BoundedRequest"
"""What every bso task names as its ``Request`` (``app.task(Request=...)``)."""


def bounded(text: object) -> object:
    """``text`` cut to :data:`MAX_REPR_CHARS`, ending in ``...`` when cut (as Celery's
    ``saferepr`` does); anything but a string (a missing header) as it is."""
    if isinstance(text, str) and len(text) > MAX_REPR_CHARS:
        return text[: MAX_REPR_CHARS - 3] + "..."
    return text


class BoundedRequest(Request):
    """Celery's request with the sender's argument previews bounded (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Where Celery keeps them: its task events and ``info()`` (inspect) read these.
        for name in ("_argsrepr", "_kwargsrepr"):
            setattr(self, name, bounded(getattr(self, name)))
