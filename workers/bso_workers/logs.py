"""Structured logging: one line per record, ``key=value`` (default) or JSON.

Worker logs are read by people tailing ``bso up`` and by log shippers; both
want the job id, trial and event id as fields they can grep or index rather
than prose.  Callers pass fields through ``extra={...}``; every attribute a
:class:`logging.LogRecord` does not have by default is emitted as a field.

Fields often carry what a caller sent (an invalid event's payload, a refused
id), so both formats escape every character that is not printable: a control
character, a newline or a terminal escape in a value cannot end the line, forge
another record or repaint the operator's terminal, and a lone surrogate cannot
make the stream's encoder fail.  One record is always exactly one line.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from datetime import UTC, datetime
from typing import Literal, TextIO

_RECORD_ATTRIBUTES = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)).keys()
) | {"message", "asctime", "taskName"}


def record_fields(record: logging.LogRecord) -> dict[str, object]:
    """The standard fields of a record followed by its ``extra`` ones."""
    fields: dict[str, object] = {
        "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
        "level": record.levelname,
        "logger": record.name,
        "pid": record.process,
        "msg": record.getMessage(),
    }
    fields.update((k, v) for k, v in vars(record).items() if k not in _RECORD_ATTRIBUTES)
    return fields


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=INFO logger=bso.tasks msg=handled job_id=j trial=3 ...``."""

    def format(self, record: logging.LogRecord) -> str:
        fields = record_fields(record)
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return " ".join(f"{_kv_key(k)}={_kv_value(v)}" for k, v in fields.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line, ASCII only (every other character is a ``\\u``
    escape); values that are not JSON, and non-finite floats (which strict JSON
    has no literal for), become their ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        fields = record_fields(record)
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        try:
            return json.dumps(fields, default=_text, allow_nan=False)
        except ValueError:  # a non-finite float, a circular value or a giant int somewhere
            return json.dumps({k: _json_scalar(v) for k, v in fields.items()})


def _json_scalar(value: object) -> object:
    if isinstance(value, str | bool) or value is None:
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, int) and value.bit_length() <= 14_000:  # < 4,300 digits
        return value
    return _text(value)


def _text(value: object) -> str:
    """``str(value)``, or a description when even that fails (an int of more than
    4,300 digits cannot be converted): a log line never raises."""
    try:
        return str(value)
    except Exception:  # logging must not fail on any value
        if isinstance(value, int):
            return f"<int of {value.bit_length()} bits>"
        return f"<unprintable {type(value).__name__}>"


_NEEDS_QUOTES = re.compile(r'[\s"=]')
_KEY_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


def _kv_key(key: str) -> str:
    """A field name as one token (names come from code, but an odd one must not
    split the line)."""
    return _KEY_CHARS.sub("_", key) or "_"


def _kv_value(value: object) -> str:
    """``value`` bare when it is one printable token, else as a JSON string (quoted,
    every control and non-printable character escaped)."""
    text = _text(value)
    if text and text.isprintable() and _NEEDS_QUOTES.search(text) is None:
        return text
    return json.dumps(text)


def configure_logging(
    level: str = "INFO", fmt: Literal["kv", "json"] = "kv", stream: TextIO | None = None
) -> None:
    """Send every logger's records to stderr (or ``stream``) in the chosen format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
