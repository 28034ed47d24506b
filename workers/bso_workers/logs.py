"""Structured logging: one line per record, ``key=value`` (default) or JSON.

Worker logs are read by people tailing ``bso up`` and by log shippers; both
want the job id, trial and event id as fields they can grep or index rather
than prose.  Callers pass fields through ``extra={...}``; every attribute a
:class:`logging.LogRecord` does not have by default is emitted as a field.
"""

from __future__ import annotations

import json
import logging
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
        return " ".join(f"{k}={_kv_value(v)}" for k, v in fields.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line; values that are not JSON become their ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        fields = record_fields(record)
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return json.dumps(fields, default=str)


_NEEDS_QUOTES = re.compile(r'[\s"=]')


def _kv_value(value: object) -> str:
    text = str(value)
    if text and _NEEDS_QUOTES.search(text) is None:
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
