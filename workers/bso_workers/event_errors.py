"""What the caller of an event that does not validate is told, and the worker logs.

One line from pydantic's errors: the field paths and messages a caller can act on,
no URLs, no echo of the input, a field name the caller made up shown escaped
(never with raw control characters), and at most
:data:`~bso_workers.envelope.MAX_ERRORS_SHOWN` errors, then how many more.  The line
goes into the caller's ``invalid_event`` reply and the worker's log; with every
error named, an event of 720 KB with 20,000 unknown fields (within the item limit)
made each a megabyte, and a team pushing such events around its door wrote a
megabyte of log per event.
"""

from __future__ import annotations

from pydantic import ValidationError

from bso_workers.envelope import MAX_ERRORS_SHOWN


def describe(exc: ValidationError) -> str:
    """``exc``'s first errors in one line; see the module docstring."""
    errors = exc.errors(include_url=False)
    shown = "; ".join(
        f"{'.'.join(_printable(str(p)) for p in err['loc']) or '(event)'}: {err['msg']}"
        for err in errors[:MAX_ERRORS_SHOWN]
    )
    more = len(errors) - MAX_ERRORS_SHOWN
    return f"{shown}; and {more} more" if more > 0 else shown


def _printable(name: str) -> str:
    return name if name.isprintable() and len(name) <= 64 else ascii(name[:64])
