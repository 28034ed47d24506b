"""What a job id and an event id may look like: one definition for every layer.

Ids travel from the caller into the spec and event models, the database and
the Redis reply keys (:func:`bso.wire.keys.reply_key_for`).  A reply key is built
from the ids an event carries *even when the event is invalid* (so that the
caller learns why it was refused), so the key builder must recognise a valid
id on its own, without the models: it uses the same predicates as they do.
Restricting ids to a few ASCII characters means they are valid UTF-8, carry
no control characters (nothing to forge a log line or a terminal escape with)
and cannot shape a key outside ``bso:reply:``.
"""

from __future__ import annotations

import re
from typing import Final, TypeGuard

MAX_ID_LENGTH: Final = 128
"""Longest job id or event id (the ``reply`` and ``job`` columns hold 128)."""

JOB_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
"""A job id: 1-128 letters, digits, ``.``, ``_``, ``:`` or ``-``, starting with a
letter or digit.  ``$`` here is matched with :func:`re.fullmatch` (Python's ``$``
alone would also accept a trailing newline)."""

EVENT_ID_PATTERN: Final = r"^[A-Za-z0-9._:-]{1,128}$"
"""An event id: 1-128 letters, digits, ``.``, ``_``, ``:`` or ``-`` (a uuid4 hex by
default)."""

JOB_ID_RULE: Final = (
    "must be 1-128 characters of letters, digits, '.', '_', ':' or '-', "
    "starting with a letter or digit"
)
"""The job id rule in words, for error messages (the id itself is never echoed)."""

TENANT_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
"""A tenant: 1-64 letters, digits, ``.``, ``_`` or ``-``, starting with a letter or
digit.  No ``:`` and no glob character, so a tenant's Redis names
(:class:`bso.wire.keys.Namespace`) never overlap another's and are exact in an ACL
pattern."""

_JOB_ID_RE = re.compile(JOB_ID_PATTERN.strip("^$"))
_TENANT_RE = re.compile(TENANT_PATTERN.strip("^$"))
_EVENT_ID_RE = re.compile(EVENT_ID_PATTERN.strip("^$"))


def is_job_id(value: object) -> TypeGuard[str]:
    """True when ``value`` is a string that is a valid job id."""
    return isinstance(value, str) and _JOB_ID_RE.fullmatch(value) is not None


def is_event_id(value: object) -> TypeGuard[str]:
    """True when ``value`` is a string that is a valid event id."""
    return isinstance(value, str) and _EVENT_ID_RE.fullmatch(value) is not None


def is_tenant(value: object) -> TypeGuard[str]:
    """True when ``value`` is a string that is a valid tenant name."""
    return isinstance(value, str) and _TENANT_RE.fullmatch(value) is not None
