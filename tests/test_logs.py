"""Worker log lines: one record is one line, whatever a caller put in its fields."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
from typing import Any

import pytest

from bso_workers.logs import JsonFormatter, KeyValueFormatter

HOSTILE = [
    "line\nts=forged level=ERROR msg=owned",
    "\r\x1b[2J\x1b[31mred",
    "nul\x00byte",
    "del\x7f",
    "c1\x85next",
    "sep\u2028par\u2029",
    "bidi\u202eevil",
    "lone\ud800surrogate",
    "tab\there",
]


def _record(msg: str = "event handled", **extra: Any) -> logging.LogRecord:
    record = logging.LogRecord("bso.tasks", logging.INFO, __file__, 1, msg, None, None)
    record.__dict__.update(extra)
    return record


def _single_printable_line(line: str) -> None:
    assert "\n" not in line
    assert "\r" not in line
    assert line.isprintable(), repr(line)
    line.encode("utf-8")  # no lone surrogate: the stream's encoder cannot fail


@pytest.mark.parametrize("value", HOSTILE)
def test_key_value_lines_escape_control_characters(value: str) -> None:
    line = KeyValueFormatter().format(_record(value, job_id=value, why=value))
    _single_printable_line(line)
    assert f"job_id={json.dumps(value)}" in line


@pytest.mark.parametrize("value", HOSTILE)
def test_json_lines_escape_control_characters_and_round_trip(value: str) -> None:
    line = JsonFormatter().format(_record(value, job_id=value))
    _single_printable_line(line)
    assert line.isascii()
    fields = json.loads(line)
    assert fields["job_id"] == fields["msg"] == value


def test_plain_tokens_stay_bare_and_odd_field_names_stay_one_token() -> None:
    line = KeyValueFormatter().format(_record(job_id="job-1", trial=3, **{"odd key\n": "x"}))
    assert "job_id=job-1 trial=3" in line
    assert "odd_key_=x" in line
    _single_printable_line(line)


def test_json_lines_stay_strict_json_with_non_finite_numbers() -> None:
    line = JsonFormatter().format(_record(ms=math.inf, cost=math.nan, trial=3, ok=1.5))
    fields = json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {line}"))
    assert (fields["ms"], fields["cost"], fields["trial"], fields["ok"]) == ("inf", "nan", 3, 1.5)


@pytest.mark.parametrize("formatter", [KeyValueFormatter(), JsonFormatter()])
def test_a_value_that_cannot_be_printed_does_not_break_the_line(
    formatter: logging.Formatter,
) -> None:
    line = formatter.format(_record(trial=10**5000))
    assert "int of 16610 bits" in line
    _single_printable_line(line)


def test_an_exception_traceback_stays_on_one_line() -> None:
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        record = _record()
        record.exc_info = sys.exc_info()
    for formatter in (KeyValueFormatter(), JsonFormatter()):
        line = formatter.format(record)
        _single_printable_line(line)
        assert "ValueError" in line


def test_a_stream_handler_writes_exactly_one_line_per_record() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(KeyValueFormatter())
    for value in HOSTILE:
        handler.emit(_record(value, job_id=value))
    assert len(stream.getvalue().splitlines()) == len(HOSTILE)
