"""The request class of bso's tasks: what a worker repeats of a message's arguments, bounded.

A Celery worker copies a message's ``argsrepr`` and ``kwargsrepr`` headers, as the
sender wrote them, into the ``task-received`` event it publishes (which Flower
keeps, for its last 10,000 tasks) and into ``celery inspect active``'s answer.
Celery's own publishers cut both to 1,024 characters (``app.amqp.argsrepr_maxsize``);
the screen (:mod:`bso_workers.envelope`) bounds only the whole item (1 MiB), and a
tenant's user may ``LPUSH`` items of its own making around its door.  So one team
could make every worker publish, and Flower hold, up to a mebibyte of text per
event: 260 such events of 200-450 KB took Flower from 108 MB to 421 MB resident, and
10,000 of them would hold tens of gigabytes.

:class:`BoundedRequest` cuts both to :data:`~bso.wire.message.MAX_REPR_CHARS` on the
worker, whatever the sender wrote, the way Celery's publishers (and bso's client,
:func:`bso.wire.message.celery_message`) would have.  The task's argument
itself is not touched.
"""

from __future__ import annotations

from typing import Any, Final

from celery.worker.request import Request

from bso.wire.message import bounded_repr

REQUEST_CLASS: Final = "bso_workers.task_request:BoundedRequest"
"""What every bso task names as its ``Request`` (``app.task(Request=...)``)."""


class BoundedRequest(Request):
    """Celery's request with the sender's argument previews bounded (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Where Celery keeps them: its task events and ``info()`` (inspect) read these.
        for name in ("_argsrepr", "_kwargsrepr"):
            setattr(self, name, bounded_repr(getattr(self, name)))
