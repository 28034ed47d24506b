"""What a task says, to its caller and to the operator's log, when an event's
transaction failed.

Two audiences, two texts.  The caller (a tenant's training run) learns whether
to send the event again and that nothing was applied; it is never shown the
service's internals: a SQLAlchemy error's text carries the SQL statement, its
parameters, and for a connection failure the database's host, port and role.
The operator's log gets the cause in one line.  A database outage is met by
every event until it ends, so a transient failure logs one WARNING line per
event, not a traceback each (the traceback stays at DEBUG); anything else is a
bug in bso and keeps its traceback at ERROR.
"""

from __future__ import annotations

import logging

from billiard.exceptions import SoftTimeLimitExceeded
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from bso.errors import BsoError, ServiceUnavailable
from bso.wire.events import ErrorReply

TRANSIENT_ERRORS = (OperationalError, PoolTimeoutError, SoftTimeLimitExceeded)
"""Failures after which the same event may well succeed: the database was
unreachable or locked too long, or the task ran out of time.  Their error
reply carries ``service_unavailable``, which the caller retries."""

CAUSE_LIMIT = 300
"""Characters of a failure's cause kept in a log line: a driver's first line
says what went wrong; the rest is hints and links."""


def cause_of(exc: BaseException) -> str:
    """The failure in one line for the operator: the exception's class and its first
    line, a database driver's own error in place of SQLAlchemy's wrapper (which
    appends the statement and its parameters)."""
    inner: BaseException = exc
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        inner = exc.orig
    text = str(inner).strip().splitlines()
    first = text[0].strip() if text else ""
    name = type(inner).__name__
    return f"{name}: {first[:CAUSE_LIMIT]}" if first else name


def failure_reply(event_id: str, exc: Exception) -> ErrorReply:
    """The caller's error reply for an exception that rolled the event's transaction
    back: which kind of failure, never its text (see the module docstring)."""
    if isinstance(exc, SoftTimeLimitExceeded):
        why = "the worker ran out of time (SoftTimeLimitExceeded)"
    elif isinstance(exc, TRANSIENT_ERRORS):
        why = f"its database is unavailable or busy ({type(exc).__name__})"
    else:
        return ErrorReply(
            event_id=event_id,
            code=BsoError.code,
            message=f"internal error in the bso worker ({type(exc).__name__}); nothing was "
            "applied, and the operator's worker log has the details",
        )
    return ErrorReply(
        event_id=event_id,
        code=ServiceUnavailable.code,
        message=f"the service could not apply the event now: {why}; nothing was applied, "
        "send the same event again",
    )


def log_failure(log: logging.Logger, what: str, exc: Exception, fields: dict[str, object]) -> None:
    """Log the failure of ``what`` ("event", "status read", ...) with the event's
    fields: one WARNING line for a transient failure, a traceback otherwise."""
    if isinstance(exc, TRANSIENT_ERRORS):
        log.warning(
            "%s failed for now (the caller sends it again): %s",
            what,
            cause_of(exc),
            extra=fields,
        )
        log.debug("%s failure's traceback", what, exc_info=exc, extra=fields)
    else:
        log.error("%s failed: %s", what, cause_of(exc), exc_info=exc, extra=fields)
